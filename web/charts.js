// A small wrapper around uPlot (served from node_modules/uplot at /vendor/uplot/).
// Axis ticks are readable at any scale: numbers keep 2-3 significant digits (1.2e-4, not 0),
// the loss uses a log10 axis (its interesting range spans decades), accuracy is in percent.

// A tick or value label with enough significant digits to tell neighbours apart at any scale.
export function fmtTick(v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "";
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e5 || a < 1e-2) {
    const [m, e] = v.toExponential(1).split("e");
    return `${m.replace(/\.0$/, "")}e${e.replace("+", "")}`;
  }
  return String(Number(v.toPrecision(3)));
}
const fmtStep = (v) => (Number.isInteger(v) ? String(v) : fmtTick(v));
export const fmtPercent = (v) => (v === null || v === undefined || !Number.isFinite(v) ? "" : `${Number((v * 100).toPrecision(3))} %`);

// makeChart(el, label, stroke, {log: true} | {percent: true})
export function makeChart(el, label, stroke, opts = {}) {
  const xs = [], ys = [];
  let plot = null;
  const log = !!opts.log;
  const fmt = opts.percent ? fmtPercent : fmtTick;
  const width = () => Math.max(240, Math.min(el.clientWidth || 320, 900));
  const yScale = log ? { distr: 3, log: 10 } : opts.percent ? { range: (u, lo, hi) => [Math.max(0, Math.min(lo, 0.9) - 0.05), 1] } : {};
  const make = () => {
    if (typeof uPlot === "undefined") return null;
    return new uPlot({
      width: width(), height: 200,
      scales: { x: { time: false }, y: yScale },
      axes: [{ label: "step", values: (u, splits) => splits.map(fmtStep) },
             { label: log ? `${label} (log scale)` : label, size: 60, values: (u, splits) => splits.map(fmt) }],
      series: [{ label: "step", value: (u, v) => fmtStep(v) }, { label, stroke, width: 2, value: (u, v) => fmt(v) }],
      legend: { show: false },
    }, [xs, ys], el);
  };
  plot = make();
  if (plot && el.id) (window.__charts = window.__charts || {})[el.id] = plot;  // tests read the ticks
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => plot && plot.setSize({ width: width(), height: 200 }), 100);
  });
  const add = (x, y) => {
    // (a report without a step pushed an undefined x that stayed first in the data for good)
    if (!Number.isFinite(x) || y === null || y === undefined || !Number.isFinite(y) || (log && y <= 0)) return false;
    if (xs.length && x <= xs[xs.length - 1]) {
      if (x < xs[xs.length - 1]) { xs.length = 0; ys.length = 0; }  // a new run (restart)
      else return false;
    }
    xs.push(x); ys.push(y);
    if (xs.length > 4000) {  // thin the older half: the curve keeps its whole history
      const keep = xs.length - 1000;
      const ox = xs.splice(0, keep), oy = ys.splice(0, keep);
      xs.unshift(...ox.filter((_, i) => i % 2 === 0)); ys.unshift(...oy.filter((_, i) => i % 2 === 0));
    }
    return true;
  };
  return {
    push(x, y) { if (add(x, y) && plot) plot.setData([xs, ys]); },
    // many points at once (the operator view's history): one redraw
    load(points) { let n = 0; for (const [x, y] of points) n += add(x, y) ? 1 : 0; if (n && plot) plot.setData([xs, ys]); },
    get length() { return xs.length; },
    get plot() { return plot; },
  };
}

export const fmtBytes = (n) => {
  if (n === null || n === undefined || !Number.isFinite(n)) return "–";
  const u = ["B", "kB", "MB", "GB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
};
export const hex = (id) => (id === null || id === undefined ? "–" : (id >>> 0).toString(16).padStart(8, "0"));
export const num = (v, d = 2) => (v === null || v === undefined || !Number.isFinite(v) ? "–" : v.toFixed(d));
// a loss (or any small positive number) with significant digits, not fixed decimals
export const sig = (v) => (v === null || v === undefined || !Number.isFinite(v) ? "–" : fmtTick(v));
