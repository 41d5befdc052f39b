// Operator view: loads the room's curves since it started (GET /api/rooms/{room}/history), then
// polls the server's room JSON (GET /api/rooms/{room}) once a second.
// Its actions (stop the room) need the operator token `tabcohort serve` prints: the link it
// prints carries it in the URL fragment (#operator=...), which never reaches the server's logs;
// the page keeps it in sessionStorage for this tab and sends it as `Authorization: Bearer`.
import { makeChart, fmtBytes, hex, num, sig } from "/web/charts.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const op = (window.tcOperator = { room: null, polls: 0, last: null, error: null, released: new Map() });
// ranks that left whose seats the server has released (it keeps a left rank's seat and last report
// for serve's --grace, 30 s by default), kept in the table, newest last: at most this many
const RELEASED_KEPT = 20;
const lossChart = makeChart($("loss-chart"), "loss", "#0b5cad", { log: true });
const accChart = makeChart($("acc-chart"), "accuracy", "#0a6b2d", { percent: true });
// any value as a string, for a text node (objects as JSON, so nothing is ever parsed as markup)
const text = (v) => (typeof v === "object" && v !== null ? JSON.stringify(v) : String(v));
// a rank's paths to its peers (its report's links: tcp, rtc, relay, connecting) and the bytes
// each kind carried (link_bytes): counted and formatted here, shown as text
function pathsCell(p) {
  const links = (p.links && typeof p.links === "object") ? p.links : {};
  const n = {};
  for (const [peer, kind] of Object.entries(links)) {
    if (peer !== "server") n[text(kind)] = (n[text(kind)] || 0) + 1;
  }
  const lb = (p.link_bytes && typeof p.link_bytes === "object") ? p.link_bytes : {};
  const parts = Object.keys(n).sort().map((k) => `${k} ${n[k]}${Number.isFinite(lb[k]) ? ` (${fmtBytes(lb[k])})` : ""}`);
  if (!n.relay && Number.isFinite(lb.relay) && lb.relay > 0) parts.push(`relay (${fmtBytes(lb.relay)})`);
  return parts.length ? parts.join(", ") : "–";
}

function operatorToken() {
  const h = new URLSearchParams(location.hash.slice(1)).get("operator");
  if (h) {
    sessionStorage.setItem("tc-operator", h);
    history.replaceState(null, "", location.pathname + location.search);  // off the address bar
  }
  return sessionStorage.getItem("tc-operator") || "";
}
op.token = operatorToken();
const authHeaders = () => (op.token ? { Authorization: `Bearer ${op.token}` } : {});

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
  const joinHref = (t) => `/?room=${encodeURIComponent(room)}${t ? `&token=${encodeURIComponent(t)}` : ""}`;
  $("join-link").href = joinHref(token);
  const poll = async () => {
    let r;
    try { r = await fetch(`/api/rooms/${encodeURIComponent(room)}${q}`, { cache: "no-store", headers: authHeaders() }); }
    catch { $("status").textContent = "The server is unreachable; retrying…"; return; }
    if (r.status === 403 && op.token) {
      // the operator token this tab kept was refused: a restarted `tabcohort serve` makes a new one
      // (unless given --operator-token), and it was sent ahead of the room token, so the view said
      // the room token was wrong and a reload did not help (a new-user trial). Drop it, say so,
      // and poll on with the room token alone.
      sessionStorage.removeItem("tc-operator");
      op.token = "";
      op.staleOperatorToken = true;
      $("error").hidden = false;
      $("error").textContent = "The operator token this page had was refused (tabcohort serve makes a new one " +
        "at each start unless given --operator-token): open the operate: link it printed to act as the operator.";
      return;
    }
    if (r.status === 403) { fail("The room token is wrong or missing."); return "stop"; }
    if (r.status === 429) { $("status").textContent = "Too many failed token checks from this address: retrying…"; return; }
    if (r.status === 404) { fail(`There is no room named “${room}”.`); return "stop"; }
    // anything else that is not the room's JSON (a cluster's 503 while the room changes nodes, a
    // proxy's 502 page) is said and polled again: render() threw on it, and the view froze
    let s = null;
    try { s = r.ok ? await r.json() : null; } catch {}
    if (!s || typeof s !== "object" || !Array.isArray(s.ranks) || !s.counters) {
      $("status").textContent = `The server answered ${r.status} without the room's state; retrying…`;
      return;
    }
    op.polls++;
    op.last = s;
    // the operate: link `tabcohort serve` prints carries no room token, and a tab opened from a
    // join link without it is refused: the operator's answer names it (a string only, in a URL)
    if (!token && typeof s.join_token === "string" && s.join_token) {
      $("join-link").href = joinHref(s.join_token);
    }
    render(s, q);
  };
  // one failed poll never ends the polling (an exception here stopped every later update)
  const loop = async () => {
    let next;
    try { next = await poll(); } catch (e) { op.error = String(e); }
    if (next !== "stop") setTimeout(loop, 1000);
  };
  $("stop-room").addEventListener("click", () => stopRoom(room));
  // without the room token in the URL a download link alone would be refused (the checkpoint and
  // the model export alike): fetch it with the operator token instead and hand the browser the bytes
  $("r-ckpt").addEventListener("click", async (ev) => {
    const a = ev.target.closest && ev.target.closest("#ckpt-link, #model-link");
    if (!a || token || !op.token) return;
    ev.preventDefault();
    const r = await fetch(a.href, { headers: authHeaders() });
    if (!r.ok) return;
    const url = URL.createObjectURL(await r.blob());
    const name = (r.headers.get("Content-Disposition") || "").match(/filename="([^"]+)"/);
    const fallback = a.id === "model-link" ? "model.npz" : "checkpoint.f32";
    const dl = Object.assign(document.createElement("a"), { href: url, download: name ? name[1] : fallback });
    document.body.append(dl);
    dl.click();
    dl.remove();
    URL.revokeObjectURL(url);
  });
  try {  // the room's curves since it started; then the polls extend them
    const h = await (await fetch(`/api/rooms/${encodeURIComponent(room)}/history${q}`, { cache: "no-store", headers: authHeaders() })).json();
    const pts = Array.isArray(h.points) ? h.points : [];
    lossChart.load(pts.map((p) => [p[1], p[2]]));
    accChart.load(pts.map((p) => [p[1], p[3]]));
    op.historyPoints = pts.length;
  } catch { op.historyPoints = 0; }
  loop();
}

async function stopRoom(room) {
  const out = $("stop-result");
  // stopping is final for this run: every rank stops, the leader publishes and stores the last
  // checkpoint; a misclick must not end someone's training
  if (!window.confirm(`Stop the room ${room}? Every rank stops and the leader stores the final checkpoint.`)) {
    out.textContent = "Not stopped.";
    return;
  }
  if (!op.token) {
    const t = window.prompt("Operator token (printed by tabcohort serve at start):");
    if (!t) return;
    op.token = t.trim();
    sessionStorage.setItem("tc-operator", op.token);
  }
  let r;
  try { r = await fetch(`/api/rooms/${encodeURIComponent(room)}/stop`, { method: "POST", headers: authHeaders() }); }
  catch { out.textContent = "The server is unreachable."; return; }
  if (r.status === 403) {
    sessionStorage.removeItem("tc-operator");
    op.token = "";
    out.textContent = "The operator token is wrong: try again.";
  } else if (r.status === 429) out.textContent = "Too many wrong tokens from this address: wait a minute.";
  else out.textContent = r.ok ? "Stop requested." : `The server answered ${r.status}.`;
}

function render(s, q) {
  const from = s.resumed_from && typeof s.resumed_from.id === "string" ? ` (${s.resumed_from.id})` : "";
  const resumed = Number.isInteger(s.resumed_from_step) ? ` Resuming from the checkpoint at step ${s.resumed_from_step}${from}.` : "";
  // what is true of the room now: it said "Training (star over ws)." with no rank connected
  // (before any joined, after all left) and while none leads (a new-user trial)
  const n = s.n_connected;
  const now = s.stopped ? `Stopped: ${s.stop_reason}.`
    : !n ? "Waiting for ranks: none connected."
    : s.trusted_id === null || s.trusted_id === undefined ? `${n} rank${n === 1 ? "" : "s"} connected; no rank leads yet.`
    : `Training (${s.topology} over ${s.link}).`;
  $("status").textContent = now + resumed;
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
    const link = (id, path, label) => {
      const a = document.createElement("a");
      a.id = id;
      a.href = `/api/rooms/${encodeURIComponent(s.room)}/${path}${q}`;
      a.download = "";
      a.textContent = label;
      return a;
    };
    // the raw checkpoint (parameters and optimizer state), and the model export (.npz: the
    // parameters and the job) that `tabcohort evaluate --model FILE` reads (README "Export and evaluate")
    dd.replaceChildren(`step ${ck.step}, accuracy ${typeof ck.accuracy === "number" ? (ck.accuracy * 100).toFixed(1) + " %" : "–"} `,
      link("ckpt-link", "checkpoint", "Download checkpoint (float32)"), " · ",
      link("model-link", "model", "Download model (.npz, for tabcohort evaluate)"));
  }
  // the report the server trusts (a rank with the role): a contributor that says it leads was
  // shown as the leader (its loss on the charts, its shares and quarantines in the table)
  const lead = s.ranks.find((r) => r.report && r.connected && r.id === s.trusted_id);
  if (lead) { lossChart.push(lead.report.step, lead.report.loss); accChart.push(lead.report.step, lead.report.accuracy); }
  // shares and measured samples/s by rank: the leader's report (docs/PROTOCOL.md, "Shares")
  const lr = (lead && lead.report) || {};
  const shares = lr.shares && typeof lr.shares === "object" ? lr.shares : {};
  const speeds = lr.speeds && typeof lr.speeds === "object" ? lr.speeds : {};
  // untrusted ranks (docs/PROTOCOL.md): quarantined (seconds left), silent, buckets clipped
  const quar = lr.quarantined && typeof lr.quarantined === "object" ? lr.quarantined : {};
  const silent = Array.isArray(lr.silent) ? lr.silent : [];
  const clipped = lr.clipped && typeof lr.clipped === "object" ? lr.clipped : {};
  // how long the leader's rounds waited for a rank's bucket after all the others were in (ms)
  const held = lr.held_ms && typeof lr.held_ms === "object" ? lr.held_ms : {};
  const shareCell = (k) => {
    if (Object.hasOwn(quar, k)) return `quarantined (${num(quar[k], 0)} s left)`;
    const base = Object.hasOwn(shares, k) ? text(shares[k]) : lead ? "none" : "–";
    const extra = [silent.includes(k) ? "silent: probed only" : "", Object.hasOwn(clipped, k) ? `${text(clipped[k])} clipped` : "",
      Object.hasOwn(held, k) && typeof held[k] === "number" && held[k] >= 1 ? `held rounds ${num(held[k] / 1000, 1)} s in all` : ""];
    return [base, ...extra.filter(Boolean)].join(", ");
  };
  $("r-batch").textContent = lead ? `${text(lr.global_batch ?? "–")} samples a round, epoch ${num(lr.epoch, 2)}` : "–";
  // a rank that left (a tab whose job failed, a rank stopped) stays in the table, greyed and
  // marked left, with its last report (its fault): once the server released its seat too, it
  // dropped out of the table and the operator could not see why it had left (a new-user trial)
  const inState = new Set(s.ranks.map((r) => r.id_hex));
  for (const r of op.shown || []) {
    if (inState.has(r.id_hex)) continue;
    op.released.delete(r.id_hex);
    op.released.set(r.id_hex, { ...r, connected: false, released: true, report_age_s: null });
  }
  for (const k of inState) op.released.delete(k);
  while (op.released.size > RELEASED_KEPT) op.released.delete(op.released.keys().next().value);
  op.shown = s.ranks;
  const listed = [...s.ranks.filter((r) => r.connected), ...s.ranks.filter((r) => !r.connected), ...op.released.values()];
  // every value here comes from a rank's report (untrusted): text nodes only, never markup
  const rows = listed.map((r) => {
    const p = r.report || {};
    const tr = document.createElement("tr");
    if (!r.connected) tr.className = "left";
    const cell = (v) => { const td = document.createElement("td"); td.append(v); tr.append(td); };
    cell(text(r.id_hex));
    cell(p.kind === "tab" ? "tab (browser)" : p.kind === "native" ? "native" : "–");
    // (a seat the server still holds may come back: a rank reconnecting within --grace, or one a
    // restarted server waits for; a released one is gone)
    cell(r.connected ? "yes" : r.released ? "left (seat released)" : "no (seat held)");
    // what it does (its report) and the role the server bound to its link (never its own claim);
    // a leader that is not connected leads no more, whatever its last report said
    const bound = ` (${r.may_lead ? "may lead" : "contributes"})`;
    if (p.is_leader && !r.connected) cell("led before it left" + bound);
    else if (p.is_leader) {
      const sp = document.createElement("span"); sp.className = "leader"; sp.textContent = "leader";
      const td = document.createElement("td"); td.append(sp, bound); tr.append(td);
    } else cell((p.ready ? "follower" : p.running ? "joining" : "–") + bound);
    cell(text(p.step ?? "–"));
    cell(text(p.cohort ?? "–"));
    cell(sig(p.loss));
    // (a backend note can be a sentence: clipped in the table, whole in the cell's tooltip, so
    // the columns after it stay in view)
    const backend = [text(p.backend ?? "–"), p.adapter && p.backend === "webgpu" ? ` on ${text(p.adapter)}` : "", p.backend_note ? ` (${text(p.backend_note)})` : ""].join("");
    cell(backend);
    tr.lastChild.className = "clip";
    tr.lastChild.title = backend;
    cell(num(p.steps_per_s, 1));
    cell(`${fmtBytes(p.wire_bytes_per_s)}/s`);
    // (a rank's fault and precision are its own strings, up to 256 characters: clipped like the
    // backend, whole in the tooltip; without the operator token the server sends no fault of a
    // rank the room does not trust: "–", not "none")
    for (const v of [text(p.precision ?? "–"), Object.hasOwn(p, "fault") ? text(p.fault ?? "none") : "–"]) {
      cell(v);
      tr.lastChild.className = "clip";
      tr.lastChild.title = v;
    }
    cell(typeof r.report_age_s === "number" ? r.report_age_s.toFixed(1) + " s" : "–");
    cell(shareCell(r.id_hex));
    cell(num(Object.hasOwn(speeds, r.id_hex) ? speeds[r.id_hex] : null, 0));
    cell(pathsCell(p));
    return tr;
  });
  if (!rows.length) {
    const tr = document.createElement("tr"), td = document.createElement("td");
    td.colSpan = 16;
    td.textContent = "no ranks yet";
    tr.append(td);
    rows.push(tr);
  }
  $("ranks").querySelector("tbody").replaceChildren(...rows);
}

init();
