// Small inline-SVG charts for the fedgpu dashboard: no library, nothing from the network.
"use strict";

(() => {
  const NS = "http://www.w3.org/2000/svg";

  function el(tag, attrs, text) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function clear(svg) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
  }

  // About `count` round numbers between lo and hi.
  function ticks(lo, hi, count, integer) {
    if (!(hi > lo)) return [lo];
    let step = Math.pow(10, Math.floor(Math.log10((hi - lo) / count)));
    for (const m of [1, 2, 5, 10]) {
      if ((hi - lo) / (step * m) <= count) { step *= m; break; }
    }
    if (integer) step = Math.max(1, Math.round(step));
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
      out.push(Number(v.toFixed(10)));
    }
    return out;
  }

  function fmt(v) {
    if (Math.abs(v) >= 1000) return v.toFixed(0);
    if (Math.abs(v) >= 10) return v.toFixed(1).replace(/\.0$/, "");
    return Number(v.toPrecision(3)).toString();
  }

  function extent(series, key, opts) {
    let lo = Infinity;
    let hi = -Infinity;
    for (const s of series) {
      for (const p of s.points) {
        lo = Math.min(lo, p[key]);
        hi = Math.max(hi, p[key]);
      }
    }
    if (opts.min !== undefined) lo = opts.min;
    if (opts.max !== undefined) hi = opts.max;
    if (lo === hi) { lo -= 1; hi += 1; }
    return [lo, hi];
  }

  // A line chart with axes: series = [{name, cls, points: [{x, y, label}]}].
  // opts: {yMin, yMax, xLabel}. Every point is a <circle class="point CLS" data-x data-y>.
  function lineChart(svg, series, opts) {
    opts = opts || {};
    clear(svg);
    const [, , W, H] = svg.getAttribute("viewBox").split(" ").map(Number);
    const m = {l: 44, r: 10, t: 24, b: 34};
    const drawn = series.filter((s) => s.points.length);
    if (!drawn.length) {
      svg.appendChild(el("text", {x: W / 2, y: H / 2, class: "empty", "text-anchor": "middle"},
        "no data yet"));
      return;
    }
    const [x0, x1] = extent(drawn, 0, {});
    const [y0, y1] = extent(drawn, 1, {min: opts.yMin, max: opts.yMax});
    const sx = (x) => m.l + (x - x0) / (x1 - x0) * (W - m.l - m.r);
    const sy = (y) => H - m.b - (y - y0) / (y1 - y0) * (H - m.t - m.b);
    const axes = el("g", {class: "axes"});
    for (const t of ticks(y0, y1, 4, false)) {
      axes.appendChild(el("line", {x1: m.l, x2: W - m.r, y1: sy(t), y2: sy(t), class: "grid"}));
      axes.appendChild(el("text", {x: m.l - 4, y: sy(t) + 3, "text-anchor": "end"}, fmt(t)));
    }
    for (const t of ticks(x0, x1, 8, true)) {
      axes.appendChild(el("text", {x: sx(t), y: H - m.b + 14, "text-anchor": "middle"}, fmt(t)));
    }
    axes.appendChild(el("line", {x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b, class: "axis"}));
    if (opts.xLabel) {
      axes.appendChild(el("text", {x: (W + m.l) / 2, y: H - 4, "text-anchor": "middle"},
        opts.xLabel));
    }
    svg.appendChild(axes);
    drawn.forEach((s, i) => {
      const g = el("g", {class: "series " + s.cls, "data-series": s.name});
      const d = s.points.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + " " +
        sy(p[1]).toFixed(1)).join(" ");
      g.appendChild(el("path", {d, class: "line"}));
      for (const p of s.points) {
        const c = el("circle", {cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1), r: 3,
          class: "point", "data-x": p[0], "data-y": p[1]});
        c.appendChild(el("title", {}, `${s.name} round ${p[0]}: ${fmt(p[1])}`));
        g.appendChild(c);
      }
      svg.appendChild(g);
      const lx = m.l + 8 + i * 110;
      svg.appendChild(el("rect", {x: lx, y: 6, width: 10, height: 3, class: "key " + s.cls}));
      svg.appendChild(el("text", {x: lx + 14, y: 11, class: "legend"}, s.name));
    });
  }

  // A tiny chart without axes for a table cell: series = [{name, cls, points: [{x, y}]}].
  function sparkline(svg, series) {
    clear(svg);
    const [, , W, H] = svg.getAttribute("viewBox").split(" ").map(Number);
    const drawn = series.filter((s) => s.points.length);
    if (!drawn.length) return;
    const [x0, x1] = extent(drawn, 0, {});
    const [, y1] = extent(drawn, 1, {min: 0});
    const sx = (x) => 2 + (x - x0) / (x1 - x0) * (W - 4);
    const sy = (y) => H - 2 - y / (y1 || 1) * (H - 4);
    for (const s of drawn) {
      const g = el("g", {class: "series " + s.cls, "data-series": s.name});
      const d = s.points.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + " " +
        sy(p[1]).toFixed(1)).join(" ");
      g.appendChild(el("path", {d, class: "line"}));
      for (const p of s.points) {
        const c = el("circle", {cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1), r: 1.6,
          class: "point", "data-x": p[0], "data-y": p[1]});
        c.appendChild(el("title", {}, `round ${p[0]} ${s.name}: ${p[1]} MiB`));
        g.appendChild(c);
      }
      svg.appendChild(g);
    }
  }

  window.FedgpuCharts = {lineChart, sparkline, svgElement: el};
})();
