// Operator view: loads the room's curves since it started (GET /api/rooms/{room}/history), then
// polls the server's room JSON (GET /api/rooms/{room}) once a second.
import { makeChart, fmtBytes, hex, num, sig } from "/web/charts.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const op = (window.tcOperator = { room: null, polls: 0, last: null, error: null });
const lossChart = makeChart($("loss-chart"), "loss", "#0b5cad", { log: true });
const accChart = makeChart($("acc-chart"), "accuracy", "#0a6b2d", { percent: true });
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);

function fail(text) { op.error = text; $("error").hidden = false; $("error").textContent = text; $("status").textContent = "Not available."; }

async function init() {
  let room = params.get("room");
  const token = params.get("token") || "";
  if (!room) {
    try {
      const r = await (await fetch("/api/rooms")).json();
      room = r.rooms[0] && r.rooms[0].room;
    } catch { return fail("The server is unreachable."); }
  }
  if (!room) return fail("This server has no rooms.");
  op.room = room;
  const q = token ? `?token=${encodeURIComponent(token)}` : "";
  $("room-name").textContent = `room ${room}`;
  $("join-link").href = `/?room=${encodeURIComponent(room)}${token ? `&token=${encodeURIComponent(token)}` : ""}`;
  const poll = async () => {
    let r;
    try { r = await fetch(`/api/rooms/${encodeURIComponent(room)}${q}`, { cache: "no-store" }); }
    catch { $("status").textContent = "The server is unreachable; retrying…"; return; }
    if (r.status === 403) { fail("The room token is wrong or missing."); return "stop"; }
    if (r.status === 404) { fail(`There is no room named “${room}”.`); return "stop"; }
    const s = await r.json();
    op.polls++;
    op.last = s;
    render(s, q);
  };
  const loop = async () => { if ((await poll()) !== "stop") setTimeout(loop, 1000); };
  try {  // the room's curves since it started; then the polls extend them
    const h = await (await fetch(`/api/rooms/${encodeURIComponent(room)}/history${q}`, { cache: "no-store" })).json();
    const pts = Array.isArray(h.points) ? h.points : [];
    lossChart.load(pts.map((p) => [p[1], p[2]]));
    accChart.load(pts.map((p) => [p[1], p[3]]));
    op.historyPoints = pts.length;
  } catch { op.historyPoints = 0; }
  loop();
}

function render(s, q) {
  const resumed = Number.isInteger(s.resumed_from_step) ? ` Resuming from the checkpoint at step ${s.resumed_from_step}.` : "";
  $("status").textContent = (s.stopped ? `Stopped: ${s.stop_reason}.` : `Training (${s.topology} over ${s.link}).`) + resumed;
  $("r-n").textContent = `${s.n_connected} (+${s.n_reserved} reserved)`;
  $("r-leader").textContent = hex(s.leader);
  $("r-step").textContent = s.step;
  $("r-loss").textContent = sig(s.loss);
  $("r-acc").textContent = s.accuracy === null ? "–" : `${(s.accuracy * 100).toFixed(1)} %`;
  $("r-relayed").textContent = `${fmtBytes(s.counters.bytes_relayed)} in ${s.counters.frames_relayed} chunks`;
  $("r-pressure").textContent = num(s.pressure, 2);
  const ck = s.checkpoint;
  const dd = $("r-ckpt");
  if (ck) {
    dd.innerHTML = `step ${ck.step}, accuracy ${ck.accuracy === null ? "–" : (ck.accuracy * 100).toFixed(1) + " %"} ` +
      `<a id="ckpt-link" href="/api/rooms/${encodeURIComponent(s.room)}/checkpoint${q}" download>Download checkpoint (float32)</a>`;
  }
  const lead = s.ranks.find((r) => r.report && r.report.is_leader && r.connected);
  if (lead) { lossChart.push(lead.report.step, lead.report.loss); accChart.push(lead.report.step, lead.report.accuracy); }
  $("ranks").querySelector("tbody").innerHTML = s.ranks.map((r) => {
    const p = r.report || {};
    const kind = p.kind === "tab" ? "tab (browser)" : p.kind === "native" ? "native" : "–";
    return `<tr><td>${r.id_hex}</td><td>${kind}</td><td>${r.connected ? "yes" : "no"}</td>` +
      `<td>${p.is_leader ? '<span class="leader">leader</span>' : p.ready ? "follower" : p.running ? "joining" : "–"}</td>` +
      `<td>${p.step ?? "–"}</td><td>${p.cohort ?? "–"}</td><td>${sig(p.loss)}</td><td>${esc(p.backend ?? "–")}</td>` +
      `<td>${num(p.steps_per_s, 1)}</td><td>${fmtBytes(p.wire_bytes_per_s)}/s</td><td>${esc(p.precision ?? "–")}</td>` +
      `<td>${esc(p.fault ?? "none")}</td><td>${r.report_age_s === null ? "–" : r.report_age_s.toFixed(1) + " s"}</td></tr>`;
  }).join("") || `<tr><td colspan="13">no ranks yet</td></tr>`;
}

init();
