/* app.js — the tradeloop dashboard: polls the trainer, evaluator and feedback services and draws the run.
 *
 * Conventions:
 * - The page talks only to its own origin: /config.json ({trainer, evaluator, feedback, poll_ms, run_id}) gives
 *   each service's base path on the dashboard's proxy (`api/<service>`, relative to the page); `?poll=MS` in the
 *   page URL overrides the poll interval.
 * - Each service is polled on its own, every request with a timeout; one that does not answer /health is shown
 *   as down, keeps its last data on the charts, and never stops the others from updating.
 * - The proxy forwards only GET and nothing here sends a token: the page only reads. A service the proxy
 *   cannot reach answers 502, and the page shows it down.
 * - Per-trade Sharpe and DSR are un-annualized, per closed trade (shared/metrics.py).
 * - The readers below (`reportsOf`, `splitMetric`, `equityOf`, ...) accept the services' JSON shapes and a few
 *   near variants, so a renamed wrapper key degrades one panel to "no data yet" rather than breaking the page.
 */
(function () {
  "use strict";

  const SERVICES = ["trainer", "evaluator", "feedback"];
  const SIGNALS = ["E1", "E2", "E3", "E4", "E5", "E6", "E7", "E8", "E9"];
  const SIGNAL_TITLES = {E1: "E1 Q bias", E2: "E2 ε", E3: "E3 γ", E4: "E4 LR scale per branch",
                         E5: "E5 gate threshold", E6: "E6 boosted winners", E7: "E7 hindsight labels",
                         E8: "E8 regime weights", E9: "E9 regime confidence"};
  const TIMEOUT_MS = 2500;
  const LAG_KEEP = 240;  // lag samples kept on the lag chart
  const MAX_MARKED_TRADES = 2000;
  const MAX_EQUITY_POINTS = 4000;  // an equity chart's points (min-max decimated by the evaluator)  // trades marked on an equity chart (a 10^5-bar window can hold 3·10^4)

  const state = {
    config: null,
    pollMs: 3000,
    up: {trainer: null, evaluator: null, feedback: null},
    lastSeen: {},
    status: {},
    history: [],
    reports: [],
    latestDetail: null,   // {epoch, val: {equity, trades, window}, oos: {...}}
    fullMetrics: {},      // epoch → {val: {metrics}, oos: {metrics}} read from the full report when needed
    detailEpoch: null,
    signals: [],
    lagSamples: {evaluator: [], feedback: []},
    t0: Date.now(),
  };

  // ---------------------------------------------------------------------------------------------- fetch
  async function getJSON(base, path) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), TIMEOUT_MS);
    try {
      const r = await fetch(base + path, {signal: ctl.signal, cache: "no-store", mode: "same-origin"});
      if (!r.ok) { const e = new Error(`${path}: HTTP ${r.status}`); e.status = r.status; throw e; }
      return await r.json();
    } finally {
      clearTimeout(timer);
    }
  }

  async function getOr(base, path, fallback) {
    try { return await getJSON(base, path); } catch (e) { return fallback; }
  }

  // ---------------------------------------------------------------------------------------------- readers
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const num = (v) => (isNum(v) ? v : (typeof v === "string" && v.trim() !== "" && Number.isFinite(+v) ? +v : null));

  /* A list inside a payload: the payload itself, or the first array under one of `keys`. */
  function listOf(x, keys) {
    if (Array.isArray(x)) return x;
    if (x && typeof x === "object") {
      for (const k of keys) if (Array.isArray(x[k])) return x[k];
      for (const k of keys) if (x[k] && typeof x[k] === "object") return Object.values(x[k]);
    }
    return [];
  }

  /* The first numeric value found under a key matching `re` (depth-first, bounded depth). */
  function deepFind(obj, re, depth) {
    depth = depth === undefined ? 4 : depth;
    if (!obj || typeof obj !== "object" || depth < 0) return null;
    for (const [k, v] of Object.entries(obj)) if (re.test(k) && num(v) !== null) return num(v);
    for (const v of Object.values(obj)) {
      if (v && typeof v === "object") { const f = deepFind(v, re, depth - 1); if (f !== null) return f; }
    }
    return null;
  }

  /* Sum of every numeric value under a key matching `re` (e.g. the lag of each consumer group). */
  function deepSum(obj, re, depth) {
    depth = depth === undefined ? 4 : depth;
    if (!obj || typeof obj !== "object" || depth < 0) return null;
    let total = null;
    for (const [k, v] of Object.entries(obj)) {
      if (re.test(k) && num(v) !== null) total = (total || 0) + num(v);
      else if (v && typeof v === "object") { const s = deepSum(v, re, depth - 1); if (s !== null) total = (total || 0) + s; }
    }
    return total;
  }

  function reportsOf(payload) {
    return listOf(payload, ["reports", "items", "data", "epochs"])
      .filter((r) => r && num(r.epoch) !== null)
      .sort((a, b) => a.epoch - b.epoch);
  }

  /* A metric of one split of a report summary: r.val.metrics.k, r.val.k, r.metrics.val.k, r.val_k. */
  function splitMetric(r, split, key) {
    const s = r[split];
    const cands = [s && s.metrics && s.metrics[key], s && s[key], r.metrics && r.metrics[split] && r.metrics[split][key],
                   r[`${split}_${key}`], r[`${split}_metrics`] && r[`${split}_metrics`][key]];
    for (const c of cands) if (num(c) !== null) return num(c);
    const full = state.fullMetrics[r.epoch];
    const m = full && full[split] && full[split].metrics;
    return m && num(m[key]) !== null ? num(m[key]) : null;
  }

  /* {equity: number[], trades: object[], window: [s, e] | null} of one split from a detail payload. */
  function splitDetail(payload, split) {
    if (!payload || typeof payload !== "object") return null;
    let s = payload[split];
    if (s === undefined && payload.splits) s = payload.splits[split];
    if (s === undefined || s === null) return null;
    if (Array.isArray(s)) return {equity: s.every((v) => num(v) !== null) ? s.map(num) : null, trades: s, window: null};
    return {equity: Array.isArray(s.equity) ? s.equity.map(num) : null,
            trades: Array.isArray(s.trades) ? s.trades : null,
            window: Array.isArray(s.window) ? s.window : null};
  }

  function historyOf(payload) {
    return listOf(payload, ["history", "epochs", "items", "data"]).filter((h) => h && num(h.epoch) !== null);
  }

  function bundlesOf(payload) {
    return listOf(payload, ["signals", "bundles", "items", "data"])
      .filter((b) => b && (num(b.epoch) !== null || num(b.for_epoch) !== null))
      .sort((a, b) => (a.for_epoch ?? a.epoch + 1) - (b.for_epoch ?? b.epoch + 1));
  }

  /* Scalar series of one signal value: a number; a {key: number} map; a list of numbers (per regime); a list
     of pairs (E6/E7: how many); null (e.g. E5 "no gate") is a gap. */
  function signalComponents(value) {
    if (value === null || value === undefined) return {value: null};
    if (num(value) !== null) return {value: num(value)};
    if (Array.isArray(value)) {
      if (value.length === 0 || Array.isArray(value[0]) || typeof value[0] === "object") return {count: value.length};
      const out = {};
      value.forEach((v, i) => { out[`r${i}`] = num(v); });
      return out;
    }
    if (typeof value === "object") {
      const out = {};
      for (const [k, v] of Object.entries(value)) if (num(v) !== null || v === null) out[k] = num(v);
      return out;
    }
    return {value: null};
  }

  // ---------------------------------------------------------------------------------------------- polling
  async function pollHealth(name) {
    const base = state.config[name];
    try {
      await getJSON(base, "/health");
      let ready = true;
      try { await getJSON(base, "/ready"); } catch (e) { ready = e.status ? false : null; }
      state.up[name] = ready === false ? "unready" : "up";
      state.lastSeen[name] = Date.now();
      state.status[name] = await getOr(base, "/status", state.status[name] || null);
      return true;
    } catch (e) {
      state.up[name] = "down";
      return false;
    }
  }

  async function pollTrainer() {
    if (!(await pollHealth("trainer"))) return;
    const h = historyOf(await getOr(state.config.trainer, "/api/history", null));
    if (h.length) state.history = h;
  }

  async function pollEvaluator() {
    if (!(await pollHealth("evaluator"))) return;
    const base = state.config.evaluator;
    const reports = reportsOf(await getOr(base, "/reports", null));
    pushLag("evaluator", deepSum(state.status.evaluator, /(^|_)lag$/i));
    // metrics a summary row lacks (e.g. the OOS DSR) come from the full report, fetched once per epoch
    for (const r of reports) {
      const have = state.fullMetrics[r.epoch];
      if (!have && ["val", "oos"].some((sp) => splitMetric(r, sp, "dsr") === null || splitMetric(r, sp, "per_trade_sharpe") === null)) {
        const full = await getOr(base, `/reports/${r.epoch}`, null);
        if (full) state.fullMetrics[r.epoch] = {val: full.val && {metrics: full.val.metrics}, oos: full.oos && {metrics: full.oos.metrics}};
      }
    }
    if (reports.length) state.reports = reports;
    const latest = reports.length ? reports[reports.length - 1].epoch : null;
    if (latest !== null && latest !== state.detailEpoch) {
      const detail = {epoch: latest};
      for (const split of ["val", "oos"]) {
        const [eq, tr] = await Promise.all([getOr(base, `/reports/${latest}/equity?split=${split}&max_points=${MAX_EQUITY_POINTS}`, null),
                                            getOr(base, `/reports/${latest}/trades?split=${split}&limit=${MAX_MARKED_TRADES}`, null)]);
        const e = eq && (Array.isArray(eq.equity) ? eq : splitDetail(eq, split));
        const t = tr && (Array.isArray(tr.trades) ? tr : splitDetail(tr, split));
        detail[split] = {equity: e && e.equity ? e.equity.map(num) : null, trades: (t && t.trades) || [],
                         x: e && Array.isArray(e.x) && e.equity && e.x.length === e.equity.length ? e.x.map(num) : null,
                         nTrades: t && num(t.n_trades) !== null ? num(t.n_trades) : ((t && t.trades) || []).length,
                         window: (e && e.window) || (t && t.window) || null};
      }
      if (detail.val.equity) { state.latestDetail = detail; state.detailEpoch = latest; }
    }
  }

  async function pollFeedback() {
    if (!(await pollHealth("feedback"))) return;
    const b = bundlesOf(await getOr(state.config.feedback, "/signals", null));
    if (b.length) state.signals = b;
    pushLag("feedback", deepSum(state.status.feedback, /(^|_)lag$/i));
  }

  function pushLag(name, lag) {
    if (lag === null) return;
    const arr = state.lagSamples[name];
    arr.push([(Date.now() - state.t0) / 1000, lag]);
    if (arr.length > LAG_KEEP) arr.shift();
  }

  // ---------------------------------------------------------------------------------------------- render
  const $ = (id) => document.getElementById(id);
  const charts = {};

  function fmtDuration(s) {
    if (!isNum(s) || s < 0) return "–";
    if (s < 90) return `${Math.round(s)} s`;
    if (s < 5400) return `${Math.round(s / 60)} min`;
    return `${(s / 3600).toFixed(1)} h`;
  }

  function renderServices() {
    for (const name of SERVICES) {
      const card = $(`svc-${name}`);
      const st = state.up[name] || "unknown";
      card.dataset.state = st;
      card.querySelector(".badge").textContent = {up: "up", unready: "not ready", down: "down", unknown: "…"}[st];
      const seen = state.lastSeen[name];
      const s = state.status[name] || {};
      let detail = "";
      if (st === "down") detail = seen ? `no answer; last seen ${Math.round((Date.now() - seen) / 1000)} s ago` : "no answer";
      else {
        const parts = [];
        if (s.phase) parts.push(String(s.phase));
        if (num(s.epoch) !== null) parts.push(`${{trainer: "trained", evaluator: "evaluated", feedback: "bundled"}[name]} epoch ${s.epoch}`);
        if (num(s.stream_lag) !== null) parts.push(`lag ${s.stream_lag}`);
        if (num(s.uptime_s) !== null) parts.push(`up ${fmtDuration(s.uptime_s)}`);
        detail = parts.join(" · ");
      }
      if (st !== "down" && s.last_error) detail += ` — last error: ${String(s.last_error).slice(0, 80)}`;
      card.querySelector(".detail").textContent = detail;
    }
  }

  function renderProgress() {
    // trainer /status: epoch = epochs finished (1-based), epochs = the run's total, phase, training_epoch
    const s = state.status.trainer || {};
    const last = state.history.length ? state.history[state.history.length - 1] : null;
    const epochs = num(s.epochs) ?? deepFind(s, /^(epochs|total_epochs|n_epochs)$/);
    const done = num(s.epoch) ?? (last ? num(last.epoch) : null);
    // "compiling": the epoch in hand compiles its steps first (a GPU's first epoch)
    const current = s.phase === "training" || s.phase === "compiling"
      ? (num(s.training_epoch) ?? (done ?? 0) + 1) : null;
    const overall = epochs && done !== null ? Math.min(1, done / epochs) : 0;
    $("progress-bar").style.width = `${(overall * 100).toFixed(1)}%`;
    const doing = s.phase === "compiling" ? "compiling for" : "training";
    $("epoch").textContent = done !== null ? String(done) + (current !== null ? ` (${doing} ${current})` : "") : "–";
    $("epochs").textContent = epochs !== null ? String(epochs) : "–";
    let eta = num(s.eta_s);
    if (eta === null && epochs && done !== null && state.history.length) {
      const secs = state.history.map((h) => deepFind(h, /^(seconds|epoch_seconds)$/)).filter((v) => v !== null);
      if (secs.length) eta = (secs.reduce((a, b) => a + b, 0) / secs.length) * Math.max(0, epochs - done);
    }
    $("eta").textContent = epochs && done !== null && done >= epochs ? "done" : (eta !== null ? `≈ ${fmtDuration(eta)}` : "–");
    const envRate = deepFind(s, /env_steps_per_s/) ?? (last && deepFind(last, /^env_steps_per_s$/));
    const updRate = deepFind(s, /updates_per_s/) ?? (last && deepFind(last, /^updates_per_s$/));
    $("throughput").textContent = envRate !== null
      ? `${Math.round(envRate).toLocaleString()} env steps/s` + (updRate !== null ? `, ${updRate.toFixed(1)} updates/s` : "")
      : "–";
    const lags = ["evaluator", "feedback"].map((n) => {
      const a = state.lagSamples[n];
      return a.length ? `${n} ${a[a.length - 1][1]}` : null;
    }).filter(Boolean);
    $("lag").textContent = lags.length ? lags.join(", ") : "–";
    const notes = [];
    const fb = s.feedback && typeof s.feedback === "object" ? s.feedback : {};
    if (fb.feedback_timed_out || fb.timed_out) notes.push(fb.knobs_source || "feedback timed out: trained on the last bundle");
    else if (num(fb.waiting_for_bundle) !== null) notes.push(`waiting for the feedback bundle of epoch ${fb.waiting_for_bundle}`);
    if (s.paused) notes.push("paused");
    if (s.device) notes.push(`device ${s.device}`);
    $("trainer-note").textContent = notes.join(" · ");
  }

  function renderCharts() {
    const R = state.reports;
    const series = (split, key) => R.map((r) => [r.epoch, splitMetric(r, split, key)]);
    charts.sharpe.update([{name: "val", color: "#1f77b4", points: series("val", "per_trade_sharpe")},
                          {name: "OOS", color: "#ff7f0e", points: series("oos", "per_trade_sharpe")}]);
    charts.dsr.update([{name: "val", color: "#1f77b4", points: series("val", "dsr")},
                       {name: "OOS", color: "#ff7f0e", points: series("oos", "dsr")}]);

    const d = state.latestDetail;
    for (const split of ["val", "oos"]) {
      const chart = charts[`equity_${split}`];
      const sd = d && d[split];
      if (!sd || !sd.equity) { chart.update([], []); continue; }
      const eq = sd.equity;
      const xs = sd.x || eq.map((_, k) => k);          // bar offsets of the (decimated) points
      const w0 = sd.window ? sd.window[0] : 0;
      const at = (bar) => {                              // the point at or just before a bar offset
        let lo = 0, hi = xs.length - 1;
        while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (xs[mid] <= bar) lo = mid; else hi = mid - 1; }
        return lo;
      };
      const markers = [];
      for (const t of sd.trades || []) {
        const i = num(t.entry_t), j = num(t.exit_t);
        if (i === null) continue;
        const side = num(t.side) || 0;
        const ret = num(t.net_return);
        const label = `${side > 0 ? "long" : "short"} ${i}→${j}` + (ret !== null ? `, net ${(ret * 100).toFixed(2)} %` : "");
        const ie = Math.max(i - w0, 0);
        markers.push({x: ie, y: eq[at(ie)], shape: side > 0 ? "up" : "down", color: side > 0 ? "#1a9850" : "#d73027", title: label});
        if (j !== null) {
          const je = Math.max(j - w0, 0);
          markers.push({x: je, y: eq[at(je)], shape: "x", color: "#555", title: `exit (${t.exit_reason || "?"}) ${label}`});
        }
      }
      chart.opts.title = `${split === "val" ? "Validation" : "OOS"} equity, epoch ${d.epoch}`;
      chart.update([{name: "equity", color: split === "val" ? "#1f77b4" : "#ff7f0e",
                     points: eq.map((v, k) => [xs[k], v])}], markers);
      const n = (sd.trades || []).length, total = sd.nTrades !== undefined ? sd.nTrades : n;
      const shown = total > n ? `${total} trades, the first ${n} marked` : `${n} trades`;
      $(`equity-${split}-note`).textContent = `${shown} (▲ long entry, ▼ short entry, × exit); x: bars into the window`;
    }

    const H = state.history;
    charts.throughput.update([{name: "env steps/s", color: "#2ca02c", points: H.map((h) => [h.epoch, deepFind(h, /^env_steps_per_s$/)])}]);
    charts.lag.update([{name: "evaluator", color: "#1f77b4", points: state.lagSamples.evaluator},
                       {name: "feedback", color: "#2ca02c", points: state.lagSamples.feedback}]);

    // E1–E9: one small chart each; x = the epoch that trained under the bundle
    for (const id of SIGNALS) {
      const comps = {};
      for (const b of state.signals) {
        const sig = (b.signals || {})[id];
        if (!sig) continue;
        const x = num(b.for_epoch) ?? num(b.epoch) + 1;
        const parts = signalComponents(sig && typeof sig === "object" && "value" in sig ? sig.value : sig);
        for (const [k, v] of Object.entries(parts)) (comps[k] = comps[k] || []).push([x, v]);
      }
      charts[id].update(Object.entries(comps).map(([k, pts]) => ({name: k === "value" ? "" : k, points: pts})));
    }
  }

  function render() {
    renderServices();
    renderProgress();
    renderCharts();
    $("last-poll").textContent = `updated ${new Date().toLocaleTimeString()}`;
  }

  // ---------------------------------------------------------------------------------------------- main
  function makeCharts() {
    const C = window.TLChart.LineChart;
    charts.sharpe = new C($("chart-sharpe"), {title: "Per-trade Sharpe by epoch (un-annualized)", yZero: true, xLabel: "epoch", xInteger: true});
    charts.dsr = new C($("chart-dsr"), {title: "Deflated Sharpe Ratio by epoch", xLabel: "epoch", xInteger: true});
    charts.equity_val = new C($("chart-equity-val"), {title: "Validation equity", xLabel: "bar"});
    charts.equity_oos = new C($("chart-equity-oos"), {title: "OOS equity", xLabel: "bar"});
    charts.throughput = new C($("chart-throughput"), {title: "Training throughput (env steps/s)", xLabel: "epoch", xInteger: true});
    charts.lag = new C($("chart-lag"), {title: "Stream lag (entries not yet acked)", xLabel: "s since page load"});
    const box = $("signals");
    for (const id of SIGNALS) {
      const card = document.createElement("div");
      card.className = "card";
      const div = document.createElement("div");
      div.id = `chart-${id}`;
      card.appendChild(div);
      box.appendChild(card);
      charts[id] = new C(div, {title: SIGNAL_TITLES[id], width: 400, height: 200, xLabel: "epoch", xInteger: true});
    }
  }

  async function tick() {
    try {
      await Promise.all([pollTrainer(), pollEvaluator(), pollFeedback()]);
      render();
    } catch (e) {
      console.error("dashboard poll failed", e);  // a bug in a reader must not stop the loop
    } finally {
      setTimeout(tick, state.pollMs);
    }
  }

  async function main() {
    makeCharts();
    state.config = await getJSON("", "config.json");
    const q = new URLSearchParams(location.search).get("poll");
    state.pollMs = Math.max(250, num(q) ?? num(state.config.poll_ms) ?? 3000);
    $("run-id").textContent = state.config.run_id ? `run ${state.config.run_id}` : "";
    tick();
  }

  window.tradeloopDashboard = {state, signalComponents, splitMetric, reportsOf, bundlesOf};
  main().catch((e) => { $("last-poll").textContent = `cannot load config.json: ${e.message}`; });
})();
