/* app.js — the tradeloop dashboard: the runs on disk and the live run, one page.
 *
 * Data:
 * - `/runs` (services/dashboard/runs.py) lists the runs: those on disk, and the live one when the dashboard runs
 *   beside the services ({"live": id}).
 * - Every read of a run goes through `api(service, path, run)`: the live run's services through the dashboard's
 *   own origin (`/api/<service><path>`, forwarded to the service), a run on disk through `/runs/<run>/<service>
 *   <path>` — the same paths and JSON shapes (shared/runview.py), so the rest of this file does not care which.
 * - Sharpe ratios and DSR are un-annualized, per closed trade (shared/metrics.py). Dates are UTC.
 *
 * Test-set discipline: per epoch the page shows validation only. OOS (the test split) is shown for the checkpoint
 * validation selects (the server's `selected_by_validation`: shared.metrics.select_best's rule), and for every
 * epoch only after the reader ticks the OOS toggle, which says what that risks.
 *
 * URL: #run=ID&epoch=N&oos=1&compare=ID,ID (deep links; the page keeps it current).
 */
(function () {
  "use strict";

  const SERVICES = ["trainer", "evaluator", "feedback"];
  const SIGNALS = ["E1", "E2", "E3", "E4", "E5", "E6", "E7", "E8", "E9"];
  const SIGNAL_TITLES = {E1: "E1 Q bias", E2: "E2 ε", E3: "E3 γ", E4: "E4 LR scale per branch",
                         E5: "E5 gate threshold", E6: "E6 boosted winners", E7: "E7 hindsight labels",
                         E8: "E8 regime weights", E9: "E9 regime confidence"};
  const TIMEOUT_MS = 15000;
  const TRADES_PER_PAGE = 25;
  const RUN_COLORS = TLChart.PALETTE;
  const HEADLINE = [  // [metric key, label, format]
    ["total_return", "total return", "pct"], ["max_drawdown", "max drawdown", "pct"],
    ["per_trade_sharpe", "per-trade Sharpe", "num"], ["dsr", "deflated Sharpe (DSR)", "num"],
    ["psr", "probabilistic Sharpe (PSR)", "num"], ["win_rate", "win rate", "pct"], ["n_trades", "trades", "int"],
    ["profit_factor", "profit factor", "num"], ["mean_bars_held", "mean bars held", "num"],
    ["exposure", "exposure", "pct"], ["turnover", "turnover per bar", "num"],
    ["per_bar_sharpe", "per-bar Sharpe", "num"], ["sortino", "Sortino (per bar)", "num"]];
  const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];

  const state = {
    config: null, pollMs: 3000,
    live: null, runs: [], root: "",
    run: null, epoch: null, showOos: false,
    compare: [], view: "run",
    data: {},          // run id → {status, history, reports, signals, up, seen}
    sheets: {},        // "run|epoch|split" → {sheet, equity}
    trades: {split: "val", offset: 0},
    timings: {},
    loaded: false,
  };

  // -------------------------------------------------------------------------------------------------- fetch
  async function getJSON(path) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), TIMEOUT_MS);
    try {
      const r = await fetch(path, {signal: ctl.signal, cache: "no-store"});
      if (!r.ok) { const e = new Error(`${path}: HTTP ${r.status}`); e.status = r.status; throw e; }
      return await r.json();
    } finally {
      clearTimeout(timer);
    }
  }

  /* The one way to read a run: the live run's services through /api/<service>, a run on disk through /runs/<run>. */
  function api(service, path, run) {
    run = run === undefined ? state.run : run;
    const base = run === state.live ? `/api/${service}` : `/runs/${encodeURIComponent(run)}/${service}`;
    return getJSON(base + path);
  }

  function unpack(b64) {
    if (b64 === null || b64 === undefined) return null;
    const bin = atob(b64);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    return new Float64Array(bytes.buffer);
  }

  // -------------------------------------------------------------------------------------------------- helpers
  const $ = (id) => document.getElementById(id);
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));

  function fmt(v, kind) {
    if (!isNum(v)) return "–";
    if (kind === "pct") return `${(v * 100).toFixed(2)}%`;
    if (kind === "int") return String(Math.round(v));
    const a = Math.abs(v);
    return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(3) : v.toFixed(a >= 100 ? 1 : 4);
  }

  function fmtDuration(s) {
    if (!isNum(s) || s < 0) return "–";
    if (s < 90) return `${Math.round(s)} s`;
    if (s < 5400) return `${Math.round(s / 60)} min`;
    return `${(s / 3600).toFixed(1)} h`;
  }

  const runData = (run) => state.data[run] || (state.data[run] = {status: {}, history: [], reports: [], signals: [], up: {}, seen: {}});
  const selectedEpoch = (d) => { const r = d.reports.find((x) => x.selected_by_validation); return r ? r.epoch : null; };
  const oosVisible = (d, epoch) => state.showOos || (epoch !== null && epoch === selectedEpoch(d));

  function setLoading(what) {
    $("loading").classList.toggle("hidden", !what);
    if (what) $("loading-what").textContent = what;
  }

  // -------------------------------------------------------------------------------------------------- URL state
  function readHash() {
    const h = new URLSearchParams(location.hash.slice(1));
    if (h.get("run")) state.run = h.get("run");
    const e = h.get("epoch");
    state.epoch = e !== null && e !== "" && Number.isFinite(+e) ? +e : null;
    state.showOos = h.get("oos") === "1";
    state.compare = (h.get("compare") || "").split(",").filter(Boolean);
    state.view = state.compare.length >= 2 ? "compare" : "run";
  }

  function writeHash() {
    const h = new URLSearchParams();
    if (state.run) h.set("run", state.run);
    if (state.epoch !== null) h.set("epoch", String(state.epoch));
    if (state.showOos) h.set("oos", "1");
    if (state.view === "compare" && state.compare.length) h.set("compare", state.compare.join(","));
    const s = "#" + h.toString();
    if (location.hash !== s) history.replaceState(null, "", s);
  }

  // -------------------------------------------------------------------------------------------------- loading
  async function loadRuns() {
    const doc = await getJSON("/runs");
    state.live = doc.live;
    state.runs = doc.runs;
    state.root = doc.root;
  }

  async function pollHealth(run, name) {
    const d = runData(run);
    try {
      await api(name, "/health", run);
      let ready = true;
      try { await api(name, "/ready", run); } catch (e) { ready = e.status ? false : null; }
      d.up[name] = ready === false ? "unready" : "up";
      d.seen[name] = Date.now();
      try { d.status[name] = await api(name, "/status", run); } catch (e) { /* keep the last one */ }
    } catch (e) {
      d.up[name] = "down";
    }
  }

  async function loadRun(run) {
    const d = runData(run);
    d.modified = (state.runs.find((r) => r.id === run) || {}).modified;   // the list's time of the run's last change
    let answers = 0;
    const keep = (f) => f.then((v) => { answers++; return v; })
      .catch(() => null);                      // a service that does not answer keeps its last data
    const jobs = [
      keep(api("trainer", "/api/history", run).then((h) => { d.history = h; })),
      keep(api("evaluator", "/reports", run).then((r) => { d.reports = r; })),
      keep(api("feedback", "/signals", run).then((s) => { d.signals = s; })),
    ];
    if (run === state.live) jobs.push(...SERVICES.map((s) => pollHealth(run, s)));
    else jobs.push(keep(api("trainer", "/status", run).then((s) => { d.status.trainer = s; })));
    await Promise.all(jobs);
    d.loaded = true;
    d.answered = answers > 0;                  // false: nothing answered (the run's services or server are gone)
    return d;
  }

  /* One backtest of a checkpoint: {sheet, equity} as promises (cached) — the curve first, drawn as soon as it
     arrives, then the numbers. t0: when the curve's request left (the equity chart's timing). */
  function loadSheet(run, epoch, split) {
    const key = `${run}|${epoch}|${split}`;
    if (state.sheets[key]) return state.sheets[key];
    const chart = charts[`equity_${split}`];
    const maxPoints = Math.max(400, Math.min(4000, 2 * Math.round(chart ? chart.width() : 800)));
    const entry = {t0: performance.now()};
    entry.equity = api("evaluator", `/reports/${epoch}/equity?split=${split}&packed=true&max_points=${maxPoints}`, run)
      .then((eq) => {
        const out = {n_bars: eq.n_bars, window: eq.window};
        for (const k of ["x", "equity", "drawdown", "t", "benchmark", "benchmark_drawdown"]) out[k] = eq.packed ? unpack(eq[k]) : eq[k];
        entry.fetchedAt = performance.now();
        return out;
      });
    // the numbers once the curve is in: the chart comes first, the server does one thing at a time
    entry.sheet = entry.equity.catch(() => null).then(() => api("evaluator", `/reports/${epoch}/tearsheet?split=${split}`, run));
    entry.sheet.catch(() => { delete state.sheets[key]; });      // a failed request is asked again next time
    entry.equity.catch(() => { delete state.sheets[key]; });
    state.sheets[key] = entry;
    return entry;
  }

  // -------------------------------------------------------------------------------------------------- charts
  const charts = {};

  function makeCharts() {
    const C = (id, o) => new TLChart($(id), o);
    charts.sharpe = C("chart-sharpe", {title: "Per-trade Sharpe by epoch (un-annualized)", x: "epoch", xLabel: "epoch"});
    charts.dsr = C("chart-dsr", {title: "Deflated Sharpe ratio by epoch", x: "epoch", xLabel: "epoch"});
    charts.loss = C("chart-loss", {title: "Training loss by epoch", x: "epoch", xLabel: "epoch"});
    charts.updates = C("chart-updates", {title: "Updates per second by epoch", x: "epoch", xLabel: "epoch"});
    charts.envsteps = C("chart-envsteps", {title: "Account-steps per second by epoch", x: "epoch", xLabel: "epoch"});
    charts.wait = C("chart-wait", {title: "Trainer's wait for feedback by epoch (s)", x: "epoch", xLabel: "epoch"});
    charts.equity_val = C("chart-equity-val", {title: "Validation equity", x: "time", height: 260});
    charts.drawdown_val = C("chart-drawdown-val", {title: "Validation drawdown", x: "time", y: "pct", height: 260});
    charts.equity_oos = C("chart-equity-oos", {title: "OOS equity", x: "time", height: 260});
    charts.drawdown_oos = C("chart-drawdown-oos", {title: "OOS drawdown", x: "time", y: "pct", height: 260});
    charts.compare_sharpe = C("chart-compare-sharpe", {title: "Validation per-trade Sharpe by epoch", x: "epoch", xLabel: "epoch"});
    charts.compare_loss = C("chart-compare-loss", {title: "Training loss by epoch", x: "epoch", xLabel: "epoch"});
    charts.compare_equity = C("chart-compare-equity", {title: "Validation equity of each run's selected checkpoint", x: "time", height: 280});
    const box = $("signals");
    for (const id of SIGNALS) {
      const card = document.createElement("div");
      card.className = "card";
      const div = document.createElement("div");
      div.id = `chart-${id}`;
      const note = document.createElement("div");
      note.className = "muted small";
      note.id = `note-${id}`;
      card.append(div, note);
      box.appendChild(card);
      charts[id] = new TLChart(div, {title: SIGNAL_TITLES[id], x: "epoch", xLabel: "epoch", height: 180,
                                     yInt: id === "E6" || id === "E7"});
    }
  }

  function epochMarkers(d) {
    const out = [];
    const sel = selectedEpoch(d);
    if (sel !== null) out.push({x: sel, label: `best (val) e${sel}`, color: "#1a9850"});
    for (const b of d.signals) {
      if (b.rollback) out.push({x: b.epoch, label: `rollback e${b.epoch}`, color: "#d73027", row: 1});
    }
    return out;
  }

  /* Scalar series of one signal of a /signals row (`SignalRow`, or `SignalCount` for E6/E7): its value a number, a
     {key: number} map or a list of numbers (per regime); null (E5 "no gate") is a gap. */
  function signalComponents(sig) {
    if ("count" in sig) return {count: sig.count};
    const value = sig.value;
    if (value === null) return {value: null};
    if (isNum(value)) return {value};
    if (Array.isArray(value)) {
      const out = {};
      value.forEach((v, i) => { out[`r${i}`] = isNum(v) ? v : null; });
      return out;
    }
    if (typeof value === "object") {
      const out = {};
      for (const [k, v] of Object.entries(value)) out[k] = isNum(v) ? v : null;
      return out;
    }
    return {value: null};
  }

  // -------------------------------------------------------------------------------------------------- render: runs
  function renderRunList() {
    const parts = state.root.split("/").filter(Boolean);
    $("runs-root").textContent = state.root ? `in ${parts.length > 2 ? "…/" + parts.slice(-2).join("/") : state.root}` : "";
    $("runs-root").title = state.root;
    const box = $("runs-list");
    if (!state.runs.length) { box.innerHTML = `<div class="muted small">no runs yet</div>`; return; }
    box.innerHTML = "";
    for (const r of state.runs) {
      const row = document.createElement("div");
      row.className = "run-row" + (r.id === state.run && state.view === "run" ? " active" : "");
      row.dataset.run = r.id;
      const cb = document.createElement("input");
      cb.type = "checkbox";
      cb.className = "run-tick";
      cb.checked = state.compare.includes(r.id);
      cb.addEventListener("change", () => {
        state.compare = cb.checked ? [...new Set([...state.compare, r.id])] : state.compare.filter((x) => x !== r.id);
        $("compare-btn").disabled = state.compare.length < 2;
        if (state.view === "compare") showCompare();
      });
      const btn = document.createElement("button");
      btn.type = "button";
      btn.className = "run-open";
      let nEpochs = r.n_epochs, best = r.selected_epoch, bestSR = r.selected ? r.selected.val_per_trade_sharpe : null;
      const d = state.data[r.id];
      if (r.live && d && d.loaded) {                     // the live run's row from its latest poll
        nEpochs = d.history.length;
        best = selectedEpoch(d);
        const row = d.reports.find((x) => x.epoch === best);
        bestSR = row ? row.val_per_trade_sharpe : null;
      }
      const sel = isNum(bestSR) ? ` · best e${best} val SR ${bestSR.toFixed(3)}` : "";
      btn.innerHTML = `<b>${esc(r.id)}</b>${r.live ? ' <span class="live-badge">live</span>' : ""}` +
        `<br><span class="muted small">${esc(r.dataset || "?")} · ${nEpochs} epoch${nEpochs === 1 ? "" : "s"}${esc(sel)}</span>`;
      btn.addEventListener("click", () => openRun(r.id));
      row.append(cb, btn);
      box.appendChild(row);
    }
    $("compare-btn").disabled = state.compare.length < 2;
  }

  // -------------------------------------------------------------------------------------------------- render: one run
  function renderServices(d) {
    for (const name of SERVICES) {
      const card = $(`svc-${name}`);
      const st = d.up[name] || "unknown";
      card.dataset.state = st;
      card.querySelector(".badge").textContent = {up: "up", unready: "not ready", down: "down", unknown: "…"}[st];
      const s = d.status[name] || {};
      let detail = "";
      if (st === "down") {
        const seen = d.seen[name];
        detail = seen ? `no answer; last seen ${Math.round((Date.now() - seen) / 1000)} s ago` : "no answer";
      } else {
        const parts = [];
        if (s.phase) parts.push(String(s.phase));
        if (isNum(s.epoch)) parts.push(`${{trainer: "trained", evaluator: "evaluated", feedback: "bundled"}[name]} epoch ${s.epoch}`);
        if (isNum(s.stream_lag)) parts.push(`lag ${s.stream_lag}`);
        if (isNum(s.uptime_s)) parts.push(`up ${fmtDuration(s.uptime_s)}`);
        detail = parts.join(" · ");
        if (s.last_error) detail += ` — last error: ${String(s.last_error).slice(0, 80)}`;
      }
      card.querySelector(".detail").textContent = detail;
    }
  }

  function renderProgress(run, d) {
    const s = d.status.trainer || {};
    const last = d.history.length ? d.history[d.history.length - 1] : null;
    const done = isNum(s.epoch) ? s.epoch : (last ? last.epoch : null);
    const epochs = isNum(s.epochs) ? s.epochs : done;
    $("epoch").textContent = done !== null ? String(done) : "–";
    $("epochs").textContent = epochs !== null ? String(epochs) : "–";
    $("phase").textContent = s.phase || (run === state.live ? "…" : "finished");
    $("progress-bar").style.width = `${epochs ? Math.min(100, (100 * (done || 0)) / epochs).toFixed(1) : 0}%`;
    const training = s.phase === "training" && isNum(s.iterations) && s.iterations > 0;
    const frac = training ? Math.min(1, (s.iteration || 0) / s.iterations) : (epochs && done >= epochs ? 1 : 0);
    $("iteration-bar").style.width = `${(100 * frac).toFixed(1)}%`;
    $("iteration-note").textContent = training
      ? `epoch ${s.training_epoch}: iteration ${s.iteration || 0} of ${s.iterations}`
      : (s.phase === "waiting_feedback" ? "waiting for the feedback bundle of the last epoch" : "");
    const ups = isNum(s.updates_per_s) ? s.updates_per_s : (last ? last.updates_per_s : null);
    const sps = isNum(s.env_steps_per_s) ? s.env_steps_per_s : (last ? last.env_steps_per_s : null);
    $("throughput").textContent = isNum(ups) || isNum(sps)
      ? `${isNum(ups) ? ups.toFixed(1) : "–"} updates/s, ${isNum(sps) ? Math.round(sps).toLocaleString("en-US") : "–"} account-steps/s`
      : "–";
    const notes = [];
    if (s.feedback && s.feedback.feedback_timed_out) notes.push(s.feedback.knobs_source);
    if (s.paused) notes.push("paused");
    if (s.device) notes.push(`device ${s.device}`);
    $("trainer-note").textContent = notes.join(" · ");
  }

  function renderEpochCharts(d) {
    const R = d.reports, H = d.history;
    const markers = epochMarkers(d);
    const ep = R.map((r) => r.epoch);
    const metric = (split, key) => R.map((r) => r.metrics[split][key] ?? null);
    const sharpe = [{label: "validation", color: "#1f77b4", x: ep, y: metric("val", "per_trade_sharpe"), points: true}];
    const dsr = [{label: "validation", color: "#1f77b4", x: ep, y: metric("val", "dsr"), points: true}];
    if (state.showOos) {
      sharpe.push({label: "OOS", color: "#ff7f0e", x: ep, y: metric("oos", "per_trade_sharpe"), points: true});
      dsr.push({label: "OOS", color: "#ff7f0e", x: ep, y: metric("oos", "dsr"), points: true});
    }
    charts.sharpe.setData(sharpe, {markers});
    charts.dsr.setData(dsr, {markers});
    const he = H.map((h) => h.epoch);
    const col = (k) => H.map((h) => (isNum(h[k]) ? h[k] : null));
    charts.loss.setData([{label: "loss", color: "#d62728", x: he, y: col("loss"), points: true},
                         {label: "C51", color: "#9467bd", x: he, y: col("c51"), points: true, dash: [4, 3]},
                         {label: "IQN", color: "#8c564b", x: he, y: col("iqn"), points: true, dash: [2, 3]}], {markers});
    charts.updates.setData([{label: "updates/s", color: "#2ca02c", x: he, y: col("updates_per_s"), points: true}], {markers});
    charts.envsteps.setData([{label: "account-steps/s", color: "#17becf", x: he, y: col("env_steps_per_s"), points: true}], {markers});
    charts.wait.setData([{label: "wait (s)", color: "#7f7f7f", x: he, y: col("feedback_wait_s"), points: true}],
                        {markers, empty: H.length ? "no wait recorded" : "no data yet"});

    // E1–E9: x = the epoch that trained under the bundle
    for (const id of SIGNALS) {
      const comps = {};
      let present = 0;
      const noGate = [];
      for (const b of d.signals) {
        const sig = b.signals[id];
        if (!sig) continue;
        present++;
        const x = b.for_epoch;
        const parts = signalComponents(sig);
        if (id === "E5" && parts.value === null) noGate.push(x);
        for (const [k, v] of Object.entries(parts)) (comps[k] = comps[k] || {x: [], y: []}).x.push(x), comps[k].y.push(v);
      }
      const series = Object.entries(comps).map(([k, c], i) => ({label: k === "value" ? id : k, x: c.x, y: c.y, points: true,
                                                                color: RUN_COLORS[i % RUN_COLORS.length]}));
      const empty = !present ? "no data yet" : (id === "E5" && noGate.length === present ? "no gate" : "no values");
      charts[id].setData(series, {empty});
      $(`note-${id}`).textContent = id === "E5" && noGate.length
        ? `no gate (every entry allowed) in epoch${noGate.length > 1 ? "s" : ""} ${noGate.join(", ")}` : "";
    }
  }

  function renderEpochSelect(d) {
    const sel = $("epoch-select");
    const R = d.reports;
    const chosen = selectedEpoch(d);
    const want = state.epoch !== null && R.some((r) => r.epoch === state.epoch) ? state.epoch : chosen;
    const opts = R.map((r) => {
      const s = isNum(r.val_per_trade_sharpe) ? r.val_per_trade_sharpe.toFixed(3) : "–";
      return `<option value="${r.epoch}"${r.epoch === want ? " selected" : ""}>epoch ${r.epoch} — val SR ${s}${r.selected_by_validation ? " (selected by validation)" : ""}</option>`;
    }).join("");
    if (sel.dataset.opts !== opts) { sel.innerHTML = opts || "<option>no evaluated checkpoint yet</option>"; sel.dataset.opts = opts; }
    $("selection-note").textContent = chosen !== null
      ? `validation selects epoch ${chosen} (highest validation per-trade Sharpe among epochs with enough trades; ` +
        "where none has enough, the highest of all)" : "";
    return want ?? null;
  }

  function headlineTable(sheets, vis) {
    const splits = vis ? ["val", "oos"] : ["val"];
    const names = {val: "validation", oos: "OOS (test)"};
    let h = `<tr><th></th>${splits.map((s) => `<th>${names[s]}</th>`).join("")}</tr>`;
    const cell = (key, split, v, kind) => `<td data-key="${key}" data-split="${split}"${isNum(v) ? ` data-value="${v}"` : ""}>${fmt(v, kind)}</td>`;
    for (const [key, label, kind] of HEADLINE) {
      h += `<tr><th>${label}</th>${splits.map((s) => cell(key, s, sheets[s] && sheets[s].sheet.metrics[key], kind)).join("")}</tr>`;
    }
    const bench = (s, k) => sheets[s] && sheets[s].sheet.benchmark ? sheets[s].sheet.benchmark[k] : null;
    h += `<tr class="bench"><th>buy-and-hold total return</th>${splits.map((s) => cell("benchmark_total_return", s, bench(s, "total_return"), "pct")).join("")}</tr>`;
    h += `<tr class="bench"><th>buy-and-hold max drawdown</th>${splits.map((s) => cell("benchmark_max_drawdown", s, bench(s, "max_drawdown"), "pct")).join("")}</tr>`;
    if (vis) {                // 1 − OOS / val says how much of validation's edge held: with val ≤ 0 there is none
      const val = sheets.val.sheet.metrics.per_trade_sharpe;
      const gap = isNum(val) && val > 0 ? cell("val_oos_gap", "oos", sheets.val.sheet.val_oos_gap, "pct")
        : `<td data-key="val_oos_gap" data-split="oos" class="muted">n/a (validation ≤ 0)</td>`;
      h += `<tr class="gap"><th title="1 − OOS per-trade Sharpe / validation per-trade Sharpe">val/OOS gap</th><td></td>${gap}</tr>`;
    }
    const sv = sheets.val.sheet;
    h += `<tr><th>DSR trials (checkpoints evaluated)</th>${cell("n_trials", "val", sv.n_trials, "int")}${vis ? "<td></td>" : ""}</tr>`;
    h += `<tr><th>window</th>${splits.map((s) => `<td class="small">${esc((sheets[s].sheet.start ?? `bar ${sheets[s].sheet.window[0]}`).replace("T", " "))} → ${esc((sheets[s].sheet.end ?? `bar ${sheets[s].sheet.window[1]}`).replace("T", " "))}<br>${sheets[s].sheet.n_bars} bars</td>`).join("")}</tr>`;
    return h;
  }

  function monthlyTable(sheet) {
    const rows = sheet.monthly;
    if (!rows.length) return `<div class="muted small">no dates known for this window (the run directory has no market file)</div>`;
    const years = {};
    for (const r of rows) {
      const [y, m] = r.month.split("-").map(Number);
      (years[y] = years[y] || {s: {}, b: {}}).s[m] = r.return;
      years[y].b[m] = r.benchmark;
    }
    const color = (v) => {
      if (!isNum(v)) return "";
      const a = Math.min(1, Math.abs(v) / 0.05);
      return v >= 0 ? `background: rgba(26,152,80,${(0.12 + 0.6 * a).toFixed(2)})` : `background: rgba(215,48,39,${(0.12 + 0.6 * a).toFixed(2)})`;
    };
    const year = (o) => { let g = 1, any = false; for (const v of Object.values(o)) if (isNum(v)) { g *= 1 + v; any = true; } return any ? g - 1 : null; };
    let h = `<table class="monthly"><tr><th></th>${MONTHS.map((m) => `<th>${m}</th>`).join("")}<th>year</th></tr>`;
    for (const y of Object.keys(years).sort()) {
      const {s, b} = years[y];
      h += `<tr><th>${y}</th>${MONTHS.map((_, i) => `<td style="${color(s[i + 1])}" data-month="${y}-${String(i + 1).padStart(2, "0")}">${isNum(s[i + 1]) ? (s[i + 1] * 100).toFixed(1) : ""}</td>`).join("")}<td style="${color(year(s))}"><b>${isNum(year(s)) ? (year(s) * 100).toFixed(1) : ""}</b></td></tr>`;
      h += `<tr class="bench"><th class="small">buy-and-hold</th>${MONTHS.map((_, i) => `<td>${isNum(b[i + 1]) ? (b[i + 1] * 100).toFixed(1) : ""}</td>`).join("")}<td>${isNum(year(b)) ? (year(b) * 100).toFixed(1) : ""}</td></tr>`;
    }
    return h + "</table>";
  }

  function knobsTable(knobs) {
    if (!knobs) return `<tr><td class="muted">the report does not say (defaults)</td></tr>`;
    const list = (v) => (Array.isArray(v) ? v.map((x) => (isNum(x) ? x.toFixed(2) : "–")).join(" · ") : "–");
    const rows = [
      ["E1", "Q bias", isNum(knobs.q_bias) ? knobs.q_bias.toPrecision(4) : "–"],
      ["E2", "ε (exploration)", isNum(knobs.epsilon) ? knobs.epsilon.toFixed(4) : "–"],
      ["E3", "γ (discount)", isNum(knobs.gamma) ? knobs.gamma.toFixed(4) : "–"],
      ["E4", "LR scale per branch", knobs.lr_scale ? Object.entries(knobs.lr_scale).map(([k, v]) => `${k} ${(+v).toFixed(3)}`).join(" · ") : "–"],
      ["E5", "entry gate (ensemble std)", knobs.gate_threshold === null || knobs.gate_threshold === undefined ? "no gate" : (+knobs.gate_threshold).toPrecision(4)],
      ["E6", "boosted replay bars", String(knobs.priority_boost.length)],
      ["E7", "hindsight labels", String(knobs.hindsight.length)],
      ["E8", "regime sampling weights", list(knobs.regime_weights)],
      ["E9", "regime confidence (size)", list(knobs.regime_confidence)],
      ["LR", "decay of every LR (schedule, rollbacks)", isNum(knobs.lr_decay) ? (+knobs.lr_decay).toPrecision(4) : "1"],
    ];
    return rows.map(([id, name, v]) => `<tr data-signal="${id}"><th>${id}</th><td>${name}</td><td class="knob-value">${esc(v)}</td></tr>`).join("");
  }

  function equitySeries(eq) {
    const x = eq.t || eq.x;
    const s = [{label: "strategy", color: "#1f77b4", x, y: eq.equity}];
    if (eq.benchmark) s.push({label: "buy-and-hold", color: "#7f7f7f", x, y: eq.benchmark, dash: [5, 4], width: 1.2});
    const dd = [{label: "strategy", color: "#d62728", x, y: eq.drawdown}];
    if (eq.benchmark_drawdown) dd.push({label: "buy-and-hold", color: "#7f7f7f", x, y: eq.benchmark_drawdown, dash: [5, 4], width: 1.2});
    return [s, dd];
  }

  let sheetToken = 0;
  async function renderTearsheet(run, d, epoch) {
    const token = ++sheetToken;
    const box = $("tearsheet");
    if (epoch === null) {
      box.classList.add("hidden");
      return;
    }
    box.classList.remove("hidden");
    const row = d.reports.find((r) => r.epoch === epoch);
    const hasOos = !!row && Object.keys(row.metrics.oos).length > 0;    // the report has an OOS backtest
    const showOos = oosVisible(d, epoch) && hasOos;
    box.classList.toggle("no-oos", !showOos);
    const entries = {val: loadSheet(run, epoch, "val"), oos: showOos ? loadSheet(run, epoch, "oos") : null};

    // the curves first, each as soon as it is in
    const drawn = ["val", "oos"].map(async (s) => {
      const entry = entries[s];
      if (!entry) {
        charts[`equity_${s}`].setData([], {});
        charts[`drawdown_${s}`].setData([], {});
        return;
      }
      let eq;
      try { eq = await entry.equity; } catch (e) {
        if (token === sheetToken) {                       // not the last checkpoint's curves under this one's name
          charts[`equity_${s}`].setData([], {});
          charts[`drawdown_${s}`].setData([], {});
        }
        return;
      }
      if (token !== sheetToken) return;                   // another checkpoint was picked meanwhile
      const [eqS, ddS] = equitySeries(eq);
      const name = s === "val" ? "Validation" : "OOS";
      const xdesc = eq.t ? "" : " (x: bars into the window)";
      charts[`equity_${s}`].setTitle(`${name} equity, epoch ${epoch}, against buy-and-hold${xdesc}`);
      charts[`drawdown_${s}`].setTitle(`${name} drawdown, epoch ${epoch}${xdesc}`);
      setChartX(charts[`equity_${s}`], !!eq.t);
      setChartX(charts[`drawdown_${s}`], !!eq.t);
      charts[`equity_${s}`].setData(eqS, {});
      charts[`drawdown_${s}`].setData(ddS, {});
      if (!entry.timed) {
        entry.timed = true;
        await new Promise((r) => requestAnimationFrame(() => r()));
        state.timings[`equity_${s}`] = {ms: charts[`equity_${s}`].lastDrawAt - entry.t0, n_bars: eq.n_bars,
                                       points: eq.equity.length, fetch_ms: entry.fetchedAt - entry.t0};
      }
    });

    // then the numbers
    let sheets;
    try {
      sheets = {val: {sheet: await entries.val.sheet}, oos: null};
      if (entries.oos) sheets.oos = {sheet: await entries.oos.sheet.catch(() => null)};
      if (sheets.oos && !sheets.oos.sheet) sheets.oos = null;
    } catch (e) {
      if (token !== sheetToken) return;
      for (const id of ["headline", "monthly", "knobs", "trades"]) $(id).innerHTML = "";   // none of another epoch's
      $("trades-range").textContent = "";
      $("headline-note").textContent = `cannot load the report of epoch ${epoch}: ${e.message}`;
      await Promise.all(drawn);
      return;
    }
    if (token !== sheetToken) return;
    const withOos = showOos && !!sheets.oos;
    $("headline").innerHTML = headlineTable(sheets, withOos);
    const sel = selectedEpoch(d);
    $("headline-note").textContent = (epoch === sel
      ? `Epoch ${epoch} is the checkpoint validation selects: its OOS result is the test of that choice. `
      : (withOos ? `Epoch ${epoch} is not the checkpoint validation selects; its OOS is shown because the OOS toggle is on. `
                 : !hasOos
                   ? `Epoch ${epoch} is not the checkpoint validation selects (epoch ${sel}); its report holds no OOS backtest. `
                 : `OOS hidden: epoch ${epoch} is not the checkpoint validation selects (epoch ${sel}); the OOS toggle above shows it. `))
      + `Sharpe ratios un-annualized, per trade. Checkpoint sha256 ${(sheets.val.sheet.checkpoint_sha256 ?? "").slice(0, 12)}.`;
    $("monthly").innerHTML = `<div class="label small">validation</div>${monthlyTable(sheets.val.sheet)}` +
      (withOos ? `<div class="label small">OOS (test)</div>${monthlyTable(sheets.oos.sheet)}` : "");
    $("knobs").innerHTML = knobsTable(sheets.val.sheet.knobs);
    const ts = $("trades-split");
    const want = withOos ? ["val", "oos"] : ["val"];
    if (ts.options.length !== want.length) {
      ts.innerHTML = want.map((s) => `<option value="${s}">${s === "val" ? "validation" : "OOS (test)"}</option>`).join("");
    }
    if (!want.includes(state.trades.split)) state.trades = {split: "val", offset: 0};
    ts.value = state.trades.split;
    await Promise.all([renderTrades(run, epoch), ...drawn]);
  }

  function setChartX(chart, time) {
    const kind = time ? "time" : "num";
    if (chart.opts.x !== kind) { chart.opts.x = kind; chart.opts.xLabel = time ? "" : "bar"; chart.shape = ""; }
  }

  async function renderTrades(run, epoch) {
    const {split, offset} = state.trades;
    let page;
    try {
      page = await api("evaluator", `/reports/${epoch}/trades?split=${split}&offset=${offset}&limit=${TRADES_PER_PAGE}`, run);
    } catch (e) {
      $("trades").innerHTML = `<tr><td class="muted">cannot load the trades: ${esc(e.message)}</td></tr>`;
      return;
    }
    const n = page.n_trades, rows = page.trades;
    $("trades-range").textContent = page.listed === false
      ? (n ? `${n} trades; their list is not kept (a study run keeps its metrics)` : "no trades")
      : (n ? `trades ${offset + 1}–${offset + rows.length} of ${n}` : "no trades");
    $("trades-prev").disabled = offset <= 0;
    $("trades-next").disabled = page.listed === false || offset + rows.length >= n;
    const dated = rows.length && rows[0].entry_time;
    let h = `<tr><th>#</th><th>side</th><th>${dated ? "entry (UTC)" : "entry bar"}</th><th>${dated ? "exit (UTC)" : "exit bar"}</th><th>bars</th>` +
            `<th>entry price</th><th>exit price</th><th>net return</th><th>exit</th><th>regime</th><th>predicted Q</th></tr>`;
    rows.forEach((t, i) => {
      const cls = t.net_return >= 0 ? "win" : "loss";
      h += `<tr class="${cls}"><td>${offset + i + 1}</td><td>${t.side > 0 ? "long" : "short"} ×${(+t.size).toFixed(2)}</td>` +
           `<td>${esc(dated ? t.entry_time.replace("T", " ") : t.entry_t)}</td><td>${esc(dated ? t.exit_time.replace("T", " ") : t.exit_t)}</td>` +
           `<td>${t.bars}</td><td>${fmt(t.entry_price)}</td><td>${fmt(t.exit_price)}</td>` +
           `<td class="num" data-value="${t.net_return}">${(t.net_return * 100).toFixed(3)}%</td><td>${esc(t.exit_reason)}</td>` +
           `<td>${t.regime}</td><td>${fmt(t.q_pred)}</td></tr>`;
    });
    $("trades").innerHTML = h;
    $("trades").dataset.rows = String(rows.length);
    $("trades").dataset.total = String(n);
  }

  async function renderRun() {
    const run = state.run;
    if (!run) return;
    const d = runData(run);
    const live = run === state.live;
    $("run-title").textContent = `run ${run}${live ? " (live)" : " (on disk)"}`;
    $("live").classList.toggle("hidden", !live);
    if (live) renderServices(d);
    renderProgress(run, d);
    renderEpochCharts(d);
    const epoch = renderEpochSelect(d);
    await renderTearsheet(run, d, epoch);
  }

  // -------------------------------------------------------------------------------------------------- render: compare
  async function renderCompare() {
    const ids = state.compare.filter((id) => state.runs.some((r) => r.id === id));
    $("compare-runs").textContent = ids.join(" · ");
    await Promise.all(ids.map((id) => (runData(id).loaded ? null : loadRun(id))));
    const sharpe = [], loss = [], equity = [];
    let rows = `<tr><th>run</th><th>dataset</th><th>epochs</th><th>selected epoch</th><th>val per-trade Sharpe</th>` +
               `<th title="deflated over the checkpoints evaluated by that epoch (a study's run DSR deflates over all of its epochs)">val DSR by its epoch</th><th>val trades</th><th>OOS per-trade Sharpe (selected)</th><th>val/OOS gap</th></tr>`;
    let allTime = true;
    const curves = await Promise.all(ids.map(async (id) => {
      const d = runData(id), sel = selectedEpoch(d);
      if (sel === null) return null;
      try { return await loadSheet(id, sel, "val").equity; } catch (e) { return null; }
    }));
    ids.forEach((id, i) => {
      const d = runData(id), color = RUN_COLORS[i % RUN_COLORS.length];
      const R = d.reports, H = d.history;
      sharpe.push({label: id, color, x: R.map((r) => r.epoch), y: R.map((r) => r.val_per_trade_sharpe ?? null), points: true});
      loss.push({label: id, color, x: H.map((h) => h.epoch), y: H.map((h) => (isNum(h.loss) ? h.loss : null)), points: true});
      if (curves[i]) { if (!curves[i].t) allTime = false; equity.push({id, color, eq: curves[i]}); }
      const sel = selectedEpoch(d), r = R.find((x) => x.epoch === sel) || {};
      const meta = state.runs.find((x) => x.id === id) || {};
      rows += `<tr data-run="${esc(id)}"><th><span class="swatch" style="background:${color}"></span>${esc(id)}</th><td>${esc(meta.dataset || "?")}</td>` +
              `<td>${H.length}</td><td>${sel ?? "–"}</td><td data-key="val_per_trade_sharpe" data-value="${r.val_per_trade_sharpe ?? ""}">${fmt(r.val_per_trade_sharpe)}</td>` +
              `<td>${fmt(r.val_dsr)}</td><td>${fmt(r.val_n_trades, "int")}</td><td>${fmt(r.oos_per_trade_sharpe)}</td>` +
              // 1 − OOS / val: with val ≤ 0 there was no edge to hold (−87 % would read as OOS beating validation)
              (isNum(r.val_per_trade_sharpe) && r.val_per_trade_sharpe > 0 ? `<td>${fmt(r.val_oos_gap, "pct")}</td>`
                : `<td class="muted" data-key="val_oos_gap">n/a</td>`) + `</tr>`;
    });
    $("compare-table").innerHTML = rows;
    charts.compare_sharpe.setData(sharpe, {});
    charts.compare_loss.setData(loss, {});
    setChartX(charts.compare_equity, allTime);
    charts.compare_equity.setData(equity.map((e) => ({label: e.id, color: e.color, x: allTime ? e.eq.t : e.eq.x, y: e.eq.equity})), {});
    $("compare-equity-note").textContent = allTime ? "" : "x: bars into each run's validation window (not every run has dates)";
  }

  // -------------------------------------------------------------------------------------------------- navigation
  function showCompare() {
    state.view = state.compare.length >= 2 ? "compare" : "run";
    writeHash();
    return renderView();
  }

  async function openRun(id) {
    state.run = id;
    state.epoch = null;
    state.view = "run";
    state.trades = {split: "val", offset: 0};
    writeHash();
    renderRunList();
    if (!runData(id).loaded) {
      setLoading(`run ${id}`);
      $("run").classList.add("hidden");
      await loadRun(id);
    }
    await renderView();
  }

  async function renderView() {
    const compare = state.view === "compare";
    $("compare").classList.toggle("hidden", !compare);
    $("run").classList.toggle("hidden", compare || !state.run);
    renderRunList();
    if (compare) await renderCompare();
    else await renderRun();
    setLoading(null);
    for (const c of Object.values(charts)) c.resize();
  }

  function bindControls() {
    $("oos-toggle").checked = state.showOos;
    $("oos-toggle").addEventListener("change", async (e) => {
      state.showOos = e.target.checked;
      writeHash();
      await renderRun();
    });
    $("epoch-select").addEventListener("change", async (e) => {
      state.epoch = +e.target.value;
      state.trades = {split: "val", offset: 0};
      writeHash();
      await renderTearsheet(state.run, runData(state.run), state.epoch);
    });
    $("trades-split").addEventListener("change", async (e) => {
      state.trades = {split: e.target.value, offset: 0};
      await renderTrades(state.run, currentEpoch());
    });
    $("trades-prev").addEventListener("click", async () => {
      state.trades.offset = Math.max(0, state.trades.offset - TRADES_PER_PAGE);
      await renderTrades(state.run, currentEpoch());
    });
    $("trades-next").addEventListener("click", async () => {
      state.trades.offset += TRADES_PER_PAGE;
      await renderTrades(state.run, currentEpoch());
    });
    $("compare-btn").addEventListener("click", () => showCompare());
    $("compare-close").addEventListener("click", () => { state.view = "run"; writeHash(); renderView(); });
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => { for (const c of Object.values(charts)) c.resize(); }, 150);
    });
  }

  function currentEpoch() {
    const v = $("epoch-select").value;
    return v === "" || !Number.isFinite(+v) ? null : +v;
  }

  // -------------------------------------------------------------------------------------------------- main
  let polls = 0;
  async function tick() {
    try {
      if (state.live && state.run === state.live && state.view === "run") {
        const before = JSON.stringify(runData(state.live).reports.map((r) => r.epoch));
        await loadRun(state.live);
        const d = runData(state.live);
        renderServices(d);
        renderProgress(state.live, d);
        renderEpochCharts(d);
        const epoch = renderEpochSelect(d);
        if (JSON.stringify(d.reports.map((r) => r.epoch)) !== before || epoch !== currentEpochShown) {
          currentEpochShown = epoch;
          await renderTearsheet(state.live, d, epoch);
        }
      }
      if (++polls % 5 === 0) {
        await loadRuns();
        const open = state.run && state.run !== state.live && state.view === "run" ? runData(state.run) : null;
        const row = open && state.runs.find((r) => r.id === state.run);
        if (open && open.loaded && row && row.modified !== open.modified) {   // a run on disk still being written
          await loadRun(state.run);
          await renderView();
        }
      }
      renderRunList();
      const open = state.run ? runData(state.run) : null;
      if (!open || open.answered !== false) $("last-poll").textContent = `updated ${new Date().toLocaleTimeString()}`;
      else if (!$("last-poll").textContent.startsWith("no answer")) {
        const since = new Date().toLocaleTimeString();
        $("last-poll").textContent = `no answer since ${since}: the data shown is the last received`;
      }
    } catch (e) {
      console.error("dashboard poll failed", e);  // a bug in a reader must not stop the loop
    } finally {
      setTimeout(tick, state.pollMs);
    }
  }
  let currentEpochShown = null;

  async function main() {
    makeCharts();
    readHash();
    bindControls();
    const [cfg] = await Promise.all([getJSON("/config.json").catch(() => ({})), loadRuns()]);
    state.config = cfg;
    const q = new URLSearchParams(location.search).get("poll");
    state.pollMs = Math.max(250, (q !== null && Number.isFinite(+q) ? +q : null) ?? (isNum(cfg.poll_ms) ? cfg.poll_ms : 3000));
    if (!state.run || !state.runs.some((r) => r.id === state.run)) {
      const newest = [...state.runs].sort((a, b) => (b.modified || 0) - (a.modified || 0))[0];
      state.run = state.live || (newest ? newest.id : null);
    }
    renderRunList();
    if (!state.run) {
      setLoading(null);
      $("loading").classList.remove("hidden");
      $("loading").setAttribute("aria-busy", "false");
      $("loading").innerHTML = `<div><b>No runs yet</b> under <code>${esc(state.root)}</code>. Start one with ` +
        "<code>tradeloop up</code>, or point the dashboard at a directory of runs: <code>tradeloop show DIR</code>.</div>";
      return;
    }
    setLoading(`run ${state.run}`);
    await loadRun(state.run);
    currentEpochShown = renderEpochSelect(runData(state.run));
    await renderView();
    state.loaded = true;
    $("last-poll").textContent = `updated ${new Date().toLocaleTimeString()}`;
    setTimeout(tick, state.pollMs);
  }

  window.tradeloopDashboard = {state, charts, api, signalComponents, selectedEpoch, openRun};
  main().catch((e) => {
    setLoading(null);
    $("loading").classList.remove("hidden");
    $("loading").innerHTML = `<div><b>Cannot load the dashboard</b>: ${esc(e.message)}</div>`;
  });
})();
