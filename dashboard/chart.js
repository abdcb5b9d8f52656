/* chart.js — a small hand-written SVG line chart for the tradeloop dashboard (no CDN, no dependencies).
 *
 * Usage:
 *   const c = new TLChart.LineChart(element, {title: "Sharpe", yZero: true, xLabel: "epoch", width: 600, height: 220});
 *   c.update([{name: "val", color: "#1f77b4", points: [[x, y], ...]}, ...],
 *            [{x, y, shape: "up" | "down" | "x", color, title}, ...]);
 *
 * Conventions:
 * - x and y are plain numbers; a point whose y is null / NaN / ±inf is a gap (the line breaks there).
 * - Series with many points are drawn as polylines only; up to MAX_DOTS points per series also get a dot
 *   (with a native <title> tooltip).
 * - After each update the element carries data-points (finite points drawn, all series), data-series
 *   (series that hold at least one finite point) and data-markers, so tests and users can see what a
 *   chart holds without reading pixels.
 */
(function (global) {
  "use strict";

  const SVG_NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                   "#7f7f7f", "#bcbd22", "#17becf"];
  const MAX_DOTS = 60;
  const MAX_LINE_POINTS = 1500;  // longer series are thinned (min/max kept per bucket) before drawing

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG_NS, name);
    for (const k in attrs || {}) node.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(node);
    return node;
  }

  function isNum(v) {
    return typeof v === "number" && Number.isFinite(v);
  }

  /* Nice tick values covering [lo, hi] (about n of them): steps of 1, 2 or 5 × 10^k. */
  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / Math.max(1, n);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || 10 * mag;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return out;
  }

  function fmt(v) {
    if (!isNum(v)) return "–";
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (Number.isInteger(v) && a < 1e6) return String(v);
    if (a >= 1e6 || a < 1e-3) return v.toExponential(1);
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    if (a >= 1) return v.toFixed(2);
    return v.toPrecision(2);
  }

  /* Keep the first, last, min and max of each bucket so spikes survive thinning. */
  function thin(points, maxN) {
    if (points.length <= maxN) return points;
    const per = Math.ceil(points.length / (maxN / 2));
    const out = [];
    for (let i = 0; i < points.length; i += per) {
      const chunk = points.slice(i, i + per);
      let lo = chunk[0], hi = chunk[0];
      for (const p of chunk) {
        if (isNum(p[1]) && (!isNum(lo[1]) || p[1] < lo[1])) lo = p;
        if (isNum(p[1]) && (!isNum(hi[1]) || p[1] > hi[1])) hi = p;
      }
      if (lo[0] <= hi[0]) out.push(lo, hi); else out.push(hi, lo);
    }
    return out;
  }

  class LineChart {
    /* element: the container (its content is replaced); opts: {title, yZero, height, xLabel, yLabel}. */
    constructor(element, opts) {
      this.element = element;
      this.opts = Object.assign({title: "", yZero: false, width: 600, height: 220, xLabel: "", xInteger: false},
                                opts || {});
      this.element.classList.add("tl-chart");
      this.update([], []);
    }

    update(series, markers) {
      series = (series || []).filter((s) => s && Array.isArray(s.points));
      markers = (markers || []).filter((m) => m && isNum(m.x) && isNum(m.y));
      const named = series.filter((s) => s.name);
      const showLegend = named.length > 1 || (named.length === 1 && !this.opts.title);
      const legendW = named.reduce((a, s) => a + 22 + 6.5 * s.name.length, 0);
      const W = this.opts.width, H = this.opts.height, L = 52, R = 12;
      // the legend sits right of the title, or on a second row when both do not fit
      const legendRow2 = showLegend && L + 7.5 * this.opts.title.length + legendW > W - R;
      const T = (this.opts.title || showLegend ? 24 : 10) + (legendRow2 ? 16 : 0);
      const B = this.opts.xLabel ? 36 : 24;
      const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img",
                             "aria-label": this.opts.title || "chart"});
      if (this.opts.title) {
        const t = el("text", {x: L, y: 15, class: "tl-title"}, svg);
        t.textContent = this.opts.title;
      }

      let nPoints = 0, nSeries = 0, xs = [], ys = [];
      for (const s of series) {
        let any = false;
        for (const p of s.points) {
          if (isNum(p[0]) && isNum(p[1])) { xs.push(p[0]); ys.push(p[1]); nPoints++; any = true; }
        }
        if (any) nSeries++;
      }
      for (const m of markers) { xs.push(m.x); ys.push(m.y); }
      this.element.dataset.points = String(nPoints);
      this.element.dataset.series = String(nSeries);
      this.element.dataset.markers = String(markers.length);

      if (nPoints === 0) {
        const t = el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "tl-empty"}, svg);
        t.textContent = "no data yet";
        this.element.replaceChildren(svg);
        return;
      }

      let x0 = Math.min(...xs), x1 = Math.max(...xs);
      let y0 = Math.min(...ys), y1 = Math.max(...ys);
      if (this.opts.yZero) { y0 = Math.min(y0, 0); y1 = Math.max(y1, 0); }
      if (x1 === x0) { x0 -= 0.5; x1 += 0.5; }
      if (y1 === y0) { const d = Math.abs(y0) * 0.1 || 0.5; y0 -= d; y1 += d; }
      const pad = (y1 - y0) * 0.06; y0 -= pad; y1 += pad;
      const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
      const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);

      // axes and grid
      const grid = el("g", {class: "tl-grid"}, svg);
      for (const v of niceTicks(y0, y1, 4)) {
        el("line", {x1: L, x2: W - R, y1: sy(v), y2: sy(v)}, grid);
        const t = el("text", {x: L - 6, y: sy(v) + 4, "text-anchor": "end", class: "tl-tick"}, svg);
        t.textContent = fmt(v);
      }
      let xt = niceTicks(x0, x1, 6);
      if (this.opts.xInteger) {
        xt = xt.filter((v) => Number.isInteger(v));
        if (xt.length < 2) xt = [...new Set([Math.ceil(x0), Math.floor(x1)])].filter((v) => v >= x0 && v <= x1);
      }
      for (const v of xt) {
        const t = el("text", {x: sx(v), y: H - B + 14, "text-anchor": "middle", class: "tl-tick"}, svg);
        t.textContent = fmt(v);
      }
      if (this.opts.yZero && y0 < 0 && y1 > 0) el("line", {x1: L, x2: W - R, y1: sy(0), y2: sy(0), class: "tl-zero"}, svg);
      if (this.opts.xLabel) {
        const t = el("text", {x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", class: "tl-axis-label"}, svg);
        t.textContent = this.opts.xLabel;
      }

      // series: one polyline per unbroken run of finite points
      series.forEach((s, i) => {
        const color = s.color || PALETTE[i % PALETTE.length];
        const g = el("g", {class: "tl-series", "data-name": s.name || `series ${i}`}, svg);
        const pts = thin(s.points, MAX_LINE_POINTS);
        let run = [];
        const flush = () => {
          if (run.length > 1) {
            el("polyline", {points: run.join(" "), fill: "none", stroke: color, "stroke-width": 1.8,
                            "stroke-dasharray": s.dashed ? "5 3" : "none", "vector-effect": "non-scaling-stroke"}, g);
          }
          run = [];
        };
        for (const p of pts) {
          if (isNum(p[0]) && isNum(p[1])) run.push(`${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`);
          else flush();
        }
        flush();
        const finite = s.points.filter((p) => isNum(p[0]) && isNum(p[1]));
        if (finite.length <= MAX_DOTS) {
          for (const p of finite) {
            const c = el("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.8, fill: color, class: "tl-dot"}, g);
            el("title", {}, c).textContent = `${s.name || ""} x=${fmt(p[0])} y=${fmt(p[1])}`;
          }
        }
      });

      // markers (trades): triangles up / down, crosses
      const mg = el("g", {class: "tl-markers"}, svg);
      for (const m of markers) {
        const x = sx(m.x), y = sy(m.y), r = 4.5, color = m.color || "#333";
        let node;
        if (m.shape === "up") node = el("path", {d: `M${x},${y - r}L${x + r},${y + r}L${x - r},${y + r}Z`, fill: color}, mg);
        else if (m.shape === "down") node = el("path", {d: `M${x},${y + r}L${x + r},${y - r}L${x - r},${y - r}Z`, fill: color}, mg);
        else node = el("path", {d: `M${x - 3},${y - 3}L${x + 3},${y + 3}M${x - 3},${y + 3}L${x + 3},${y - 3}`,
                                stroke: color, "stroke-width": 1.5}, mg);
        node.setAttribute("class", "tl-marker");
        if (m.title) el("title", {}, node).textContent = m.title;
      }

      // legend
      if (showLegend) {
        const ly = legendRow2 ? 31 : 15;
        let lx = W - R;
        for (let i = named.length - 1; i >= 0; i--) {
          const s = named[i], color = s.color || PALETTE[series.indexOf(s) % PALETTE.length];
          const t = el("text", {x: lx, y: ly, "text-anchor": "end", class: "tl-legend", fill: color}, svg);
          t.textContent = s.name;
          lx -= 8 + 6.5 * s.name.length;
          el("rect", {x: lx, y: ly - 7, width: 8, height: 8, fill: color}, svg);
          lx -= 8;
        }
      }
      this.element.replaceChildren(svg);
    }
  }

  global.TLChart = {LineChart, niceTicks, thin, fmt, PALETTE};
})(window);
