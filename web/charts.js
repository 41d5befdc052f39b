// A small wrapper around uPlot (served from node_modules/uplot at /vendor/uplot/).
export function makeChart(el, label, stroke) {
  const xs = [], ys = [];
  let plot = null;
  const width = () => Math.max(240, Math.min(el.clientWidth || 320, 900));
  const make = () => {
    if (typeof uPlot === "undefined") return null;
    return new uPlot({
      width: width(), height: 200,
      scales: { x: { time: false } },
      axes: [{ label: "step" }, { label }],
      series: [{ label: "step" }, { label, stroke, width: 2 }],
      legend: { show: false },
    }, [xs, ys], el);
  };
  plot = make();
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => plot && plot.setSize({ width: width(), height: 200 }), 100);
  });
  return {
    push(x, y) {
      if (y === null || y === undefined || !Number.isFinite(y)) return;
      if (xs.length && x <= xs[xs.length - 1]) {
        if (x < xs[xs.length - 1]) { xs.length = 0; ys.length = 0; }  // a new run (restart)
        else return;
      }
      xs.push(x); ys.push(y);
      if (xs.length > 2000) { xs.splice(0, 1000); ys.splice(0, 1000); }
      if (plot) plot.setData([xs, ys]);
    },
    get length() { return xs.length; },
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
