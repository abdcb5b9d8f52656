/* charts.js — the dashboard's line charts: uPlot (vendor/uPlot.iife.min.js, MIT) with tradeloop's axis labels,
 * markers and empty states.
 *
 *   const c = new TLChart(element, {title, x: "epoch" | "time" | "num", y: "num" | "pct", yInt, height, xLabel});
 *   c.setData([{label, color, x: [...], y: [...], points: true, dash: [4, 3], width: 1.5}, ...],
 *             {markers: [{x, label, color}], empty: "no data yet"});
 *
 * Conventions:
 * - Series may have different x arrays: they are merged on the union of their x values (uPlot.join); a null or
 *   non-finite y is a gap.
 * - Tick labels are formatted from the axis' tick increment, so the labels of one axis are always distinct: a
 *   number gets as many decimals as its increment needs (0.99, 0.9925, 0.995, … never "0.99" four times), a date
 *   as much of YYYY-MM-DD HH:MM:SS as its increment needs (UTC).
 * - `y: "pct"` shows fractions as percentages (0.012 → 1.2%); `yInt`: integer ticks only (counts); x "epoch" too.
 * - markers: vertical lines at x (best epoch, rollbacks), labelled at the top.
 * - After each draw the element carries data-points (finite points drawn, all series), data-series (series with at
 *   least one finite point), data-markers, and data-ticks (JSON: the labels of each axis), so tests and users can
 *   see what a chart holds without reading pixels.
 */
(function (global) {
  "use strict";

  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf"];
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const INT_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];

  /* Decimals that show every multiple of `incr` exactly (up to 10). */
  function decimalsFor(incr) {
    if (!(incr > 0)) return 0;
    for (let d = 0; d <= 10; d++) {
      const s = incr * Math.pow(10, d);
      if (Math.abs(s - Math.round(s)) < 1e-6 * Math.max(1, s)) return d;
    }
    return 10;
  }

  function numTicks(splits, incr, pct) {
    const scale = pct ? 100 : 1;
    const inc = incr * scale;
    const big = splits.some((v) => Math.abs(v * scale) >= 1e6) && inc >= 1e4;
    const div = big ? 1e6 : 1, suffix = (big ? "M" : "") + (pct ? "%" : "");
    const d = decimalsFor(inc / div);
    return splits.map((v) => (v == null ? "" : ((v * scale) / div).toFixed(d).replace(/^-(0\.?0*)$/, "$1") + suffix));
  }

  const pad = (n) => String(n).padStart(2, "0");
  const TIME_FORMATS = [
    (d) => `${d.getUTCFullYear()}`,
    (d) => `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}`,
    (d) => `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())}`,
    (d) => `${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}`,
    (d) => `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}`,
    (d) => `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}:${pad(d.getUTCSeconds())}`,
    (d) => d.toISOString().replace("T", " ").slice(0, 19),
  ];

  /* Date labels (x in unix seconds, UTC): the coarsest format the increment allows, and a finer one while two
     labels would read the same. */
  function timeTicks(splits, incr) {
    const start = incr >= 360 * 86400 ? 0 : incr >= 28 * 86400 ? 1 : incr >= 86400 ? 2 : incr >= 60 ? 3 : 5;
    for (let f = start; f < TIME_FORMATS.length; f++) {
      const out = splits.map((v) => (v == null ? "" : TIME_FORMATS[f](new Date(v * 1000))));
      const shown = out.filter((s) => s !== "");
      if (new Set(shown).size === shown.length) return out;
    }
    return splits.map((v) => (v == null ? "" : String(v)));
  }

  const measure = document.createElement("canvas").getContext("2d");
  /* Width of a y axis: its longest label as drawn (uPlot's 12px font), the tick and the gaps. */
  function axisSize(self, values) {
    if (!values) return 40;
    measure.font = "12px system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif";
    const widest = Math.max(0, ...values.map((v) => measure.measureText(String(v)).width));
    return Math.ceil(Math.min(140, widest + 24));
  }

  class TLChart {
    constructor(el, opts) {
      this.el = el;
      this.opts = Object.assign({x: "num", y: "num", height: 220, title: "", xLabel: "", yLabel: ""}, opts || {});
      el.classList.add("tl-chart");
      el.innerHTML = "";
      this.titleEl = document.createElement("div");
      this.titleEl.className = "tl-title";
      this.titleEl.textContent = this.opts.title;
      this.plotEl = document.createElement("div");
      this.plotEl.className = "tl-plot";
      this.emptyEl = document.createElement("div");
      this.emptyEl.className = "tl-empty";
      el.append(this.titleEl, this.plotEl, this.emptyEl);
      this.u = null;
      this.shape = "";
      this.markers = [];
      this.ticks = [[], []];
      this.lastDrawAt = 0;
      this.setData([], {});
    }

    setTitle(t) { this.titleEl.textContent = t; }

    width() { return Math.max(240, (this.el.clientWidth || this.opts.width || 600) - 4); }

    _options(series) {
      const o = this.opts, self = this;
      const xTime = o.x === "time";
      const xVals = (u, splits, ax, space, incr) => {
        const out = xTime ? timeTicks(splits, incr) : numTicks(splits, o.x === "epoch" ? Math.max(1, incr) : incr, false);
        self.ticks[0] = out;
        return out;
      };
      const yVals = (u, splits, ax, space, incr) => {
        const out = numTicks(splits, o.yInt ? Math.max(1, incr) : incr, o.y === "pct");
        self.ticks[1] = out;
        return out;
      };
      return {
        width: this.width(), height: o.height,
        tzDate: xTime ? (ts) => uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC") : undefined,
        scales: {x: {time: xTime}, y: {auto: true}},
        legend: {show: true, live: true},
        cursor: {drag: {x: true, y: false}},
        axes: [
          {values: xVals, label: o.xLabel || undefined, size: xTime ? 36 : 32, space: xTime ? 90 : 50,
           incrs: o.x === "epoch" ? INT_INCRS : undefined},
          {values: yVals, label: o.yLabel || undefined, size: axisSize, space: 30, incrs: o.yInt ? INT_INCRS : undefined},
        ],
        series: [{label: xTime ? "date" : (o.xLabel || "x"), value: xTime ? (u, v) => (v == null ? "–" : timeTicks([v], 1)[0]) : undefined}]
          .concat(series.map((s, i) => ({
            label: s.label, stroke: s.color || PALETTE[i % PALETTE.length], width: s.width || 1.5, dash: s.dash,
            spanGaps: s.spanGaps !== undefined ? s.spanGaps : !s.points,
            points: {show: !!s.points, size: 6, fill: s.color || PALETTE[i % PALETTE.length]},
            value: (u, v) => (v == null ? "–" : numTicks([v], Math.abs(v) >= 100 ? 1 : 1e-4, o.y === "pct")[0]),
          }))),
        hooks: {draw: [(u) => this._drawn(u)]},
      };
    }

    _drawn(u) {
      const ctx = u.ctx, dpr = devicePixelRatio || 1;
      for (const m of this.markers) {
        const px = u.valToPos(m.x, "x", true);
        if (!isNum(px) || px < u.bbox.left - 1 || px > u.bbox.left + u.bbox.width + 1) continue;
        ctx.save();
        ctx.strokeStyle = m.color || "#444";
        ctx.lineWidth = 1.5 * dpr;
        ctx.setLineDash([5 * dpr, 4 * dpr]);
        ctx.beginPath();
        ctx.moveTo(px, u.bbox.top);
        ctx.lineTo(px, u.bbox.top + u.bbox.height);
        ctx.stroke();
        ctx.setLineDash([]);
        ctx.fillStyle = m.color || "#444";
        ctx.font = `${11 * dpr}px system-ui, sans-serif`;
        ctx.textAlign = px > u.bbox.left + u.bbox.width * 0.8 ? "right" : "left";
        ctx.fillText(m.label || "", px + (ctx.textAlign === "left" ? 4 : -4) * dpr, u.bbox.top + 12 * dpr + (m.row || 0) * 13 * dpr);
        ctx.restore();
      }
      this.lastDrawAt = performance.now();
      this.el.dataset.ticks = JSON.stringify(this.ticks);
    }

    /* series: [{label, color, x, y, points, dash, width}]; opts: {markers, empty} */
    setData(series, opts) {
      opts = opts || {};
      series = (series || []).filter((s) => s && s.x && s.y);
      this.markers = opts.markers || [];
      let points = 0, nonEmpty = 0;
      for (const s of series) {
        let n = 0;
        for (const v of s.y) if (isNum(v)) n++;
        points += n;
        if (n) nonEmpty++;
      }
      this.el.dataset.points = String(points);
      this.el.dataset.series = String(nonEmpty);
      this.el.dataset.markers = String(this.markers.length);
      this.emptyEl.textContent = points ? "" : (opts.empty || "no data yet");
      this.el.classList.toggle("is-empty", !points);
      if (!series.length) {
        if (this.u) { this.u.destroy(); this.u = null; this.shape = ""; }
        this.el.dataset.ticks = "[[],[]]";
        return;
      }
      const data = series.length === 1
        ? [Array.from(series[0].x), Array.from(series[0].y, (v) => (isNum(v) ? v : null))]
        : uPlot.join(series.map((s) => [Array.from(s.x), Array.from(s.y, (v) => (isNum(v) ? v : null))]));
      const shape = JSON.stringify(series.map((s) => [s.label, s.color, !!s.points, s.dash || null]));
      if (!this.u || shape !== this.shape) {
        if (this.u) this.u.destroy();
        this.u = new uPlot(this._options(series), data, this.plotEl);
        this.shape = shape;
      } else {
        this.u.setData(data);
      }
    }

    resize() { if (this.u) this.u.setSize({width: this.width(), height: this.opts.height}); }
  }

  TLChart.numTicks = numTicks;
  TLChart.timeTicks = timeTicks;
  TLChart.PALETTE = PALETTE;
  global.TLChart = TLChart;
})(window);
