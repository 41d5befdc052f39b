// The room page: a thin boot and UI layer. It owns the WebSocket(s) and relays frames to and from
// the rank's worker (web/rank-worker.js) as transferred ArrayBuffers; the protocol is Python.
import { makeChart, fmtBytes, hex, num, sig } from "/web/charts.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const tc = (window.tc = { events: [], state: null, errors: [], boot: null, numpy: null, joinedAt: null,
  stopped: null, finished: null, fault: null, faults: [], sockets: 0, maxCohort: 0, pageStart: performance.now(), phase: "starting" });
tc.leaderView = { speeds: {}, quarantined: {} };  // the room leader's measured samples/s by rank (its report)
const setPhase = (p) => { tc.phase = p; document.body.dataset.phase = p; };
setPhase("starting");

function status(text) { $("status").textContent = text; }
function fail(kind, text) {
  tc.errors.push({ kind, text });
  setPhase("error");
  const e = $("error");
  e.hidden = false;
  e.textContent = text;
  status("Not running.");
}
// an unknown room: say so and name the rooms the server lists (GET /api/rooms, token rooms too,
// as the CLI's "its rooms: ..." does), the first 10 as links; text only, never markup. It named none
// and the user had to guess (a new-user trial)
async function failNoRoom(room) {
  const rooms = await getJSON("/api/rooms");
  const list = rooms.body && Array.isArray(rooms.body.rooms) ? rooms.body.rooms : [];
  const names = list.map((r) => r && r.room).filter((n) => typeof n === "string").map((n) => n.slice(0, 64));
  const shown = names.slice(0, 10), more = names.length > shown.length ? ", …" : "";
  const said = `There is no room named “${room}” on this server.`;
  if (!shown.length) return fail("room", said);
  fail("room", `${said} Rooms here: ${shown.join(", ")}${more}.`);
  const links = shown.flatMap((n, i) => {
    const a = document.createElement("a");
    const q = new URLSearchParams(location.search);   // (the token, link, backend... kept)
    q.set("room", n);
    a.href = `/?${q}`;
    a.textContent = n;
    return i ? [", ", a] : [a];
  });
  $("error").replaceChildren(`${said} Rooms here: `, ...links, `${more}.`);
}
function note(text) { const li = document.createElement("li"); li.textContent = text; $("notes").append(li); }

async function getJSON(url) {
  let r;
  try { r = await fetch(url, { cache: "no-store" }); } catch (e) { return { unreachable: true, error: String(e) }; }
  let body = null;
  try { body = await r.json(); } catch {}
  return { status: r.status, body };
}

const lossChart = makeChart($("loss-chart"), "loss", "#0b5cad", { log: true });
const accChart = makeChart($("acc-chart"), "accuracy", "#0a6b2d", { percent: true });

// the room in the header and the title (text only: the name comes from the URL or the server)
function showRoom(room) {
  $("room-name").textContent = `room ${room}`;
  document.title = `tabcohort: room ${room}`;
}

// what is wrong with the page's own options (a message naming the option), or null
function pageOptionError() {
  const allowed = { link: ["ws", "rtc"], autostart: ["0", "1"], numpy: ["on", "off"], "rtc-loopback": ["0", "1"],
    backend: ["auto", "webgpu", "numpy", "js", "python"], "gpu-test": ["bad-wgsl"] };
  for (const [k, vals] of Object.entries(allowed)) {
    const v = params.get(k);
    if (v !== null && !vals.includes(v)) return `?${k}=${v}: expected ${vals.join(" or ")}.`;
  }
  const b = params.get("batch");
  if (b !== null && !/^[1-9][0-9]{0,5}$/.test(b)) return `?batch=${b}: expected a positive whole number of samples.`;
  // how long the tab tries to reconnect to its server before it gives up (the ranks' 30 s unless told)
  const rc = params.get("reconnect");
  if (rc !== null && !(/^[1-9][0-9]?$/.test(rc) && parseInt(rc, 10) <= 30)) {
    return `?reconnect=${rc}: expected whole seconds, 1..30.`;
  }
  return null;
}

async function main() {
  // the page's own options are checked before anything loads (a bad one names itself); the
  // header keeps the room's name (it read just "tabcohort" on a bad option)
  const optionError = pageOptionError();
  if (optionError !== null) {
    fail("config", optionError);
    let named = params.get("room");
    if (!named) {   // the room this page would have joined, if the server says (best effort)
      const rooms = await getJSON("/api/rooms");
      const list = (rooms.body && Array.isArray(rooms.body.rooms)) ? rooms.body.rooms : [];
      const pick = list.find((r) => r && (!r.owner_url || r.owner_url === location.origin)) || list[0];
      named = pick && typeof pick.room === "string" ? pick.room : null;
    }
    if (named) showRoom(named);
    return;
  }
  const token = params.get("token") || "";
  const q = token ? `?token=${encodeURIComponent(token)}` : "";
  status("Contacting the server…");
  const boot = await getJSON("/api/boot");
  if (boot.unreachable || boot.status !== 200) return fail("unreachable", "The server is unreachable. Check the address and that tabcohort serve is running.");
  let room = params.get("room");
  if (!room) {
    const rooms = await getJSON("/api/rooms");
    const list = (rooms.body && rooms.body.rooms) || [];
    // in a cluster (README "Cluster") prefer a room this node serves; else go to the room's owner
    const pick = list.find((r) => !r.owner_url || r.owner_url === location.origin) || list[0];
    room = pick && pick.room;
    if (!room) return fail("room", "This server has no room to join.");
    if (pick.owner_url && pick.owner_url !== location.origin && followOwner(pick.owner_url, room)) return;
  }
  // a tab whose node died (README "Cluster"): served by another node, wait here until a live
  // node owns the room, then train there
  if (params.get("failover") && !(await awaitNewOwner(room, params.get("failover")))) return;
  showRoom(room);
  $("operator-link").href = `/operator?room=${encodeURIComponent(room)}${token ? `&token=${encodeURIComponent(token)}` : ""}`;
  const check = await getJSON(`/api/rooms/${encodeURIComponent(room)}${q}`);
  if (check.unreachable) return fail("unreachable", "The server is unreachable.");
  if (check.status === 403) return fail("token", "The room token is wrong or missing: ask the operator for the room link.");
  if (check.status === 404) return failNoRoom(room);
  if (check.body && check.body.stopped === true) {
    // a finished room (README "Resuming"): nothing to train, so no Python runtime is booted and
    // nothing is fetched; the page says so and links the final model (text only, never markup)
    const why = typeof check.body.stop_reason === "string" ? check.body.stop_reason.slice(0, 300) : "";
    tc.finished = { text: `stopped${why ? ` (server: ${why})` : ""} before joining the cohort: the room has finished; nothing was fetched` };
    setPhase("stopped");
    const ck = check.body.checkpoint && typeof check.body.checkpoint === "object" ? check.body.checkpoint : null;
    const at = ck && Number.isInteger(ck.step) ? `; its ${ck.final === true ? "final model" : "last checkpoint"} is of step ${ck.step}` +
      (typeof ck.accuracy === "number" ? `, held-out accuracy ${(ck.accuracy * 100).toFixed(1)} %` : "") : "";
    status(`This room has finished${why ? ` (${why})` : ""}${at}: there is nothing to train here.`);
    $("start").disabled = $("stop").disabled = true;
    // what would train it again (a new-user trial: the page of a diverged room gave no next step)
    note("To train again, the operator serves the room again on a fresh --checkpoint-dir (or with a higher --steps)" +
      (why.startsWith("diverged") ? ", with a smaller --lr or the job fixed." : "."));
    if (ck) {
      const li = document.createElement("li");
      const a = document.createElement("a");
      a.href = `/api/rooms/${encodeURIComponent(room)}/model${q}`;
      a.textContent = "its final model (.npz: tabcohort evaluate --model FILE)";
      li.append("Download ", a, ".");
      $("notes").append(li);
    }
    return;
  }
  const resumed = check.body && check.body.resumed_from_step;
  if (Number.isInteger(resumed)) {
    tc.resumedFrom = resumed;
    const rf = check.body.resumed_from;
    const cid = rf && typeof rf.id === "string" ? ` (${rf.id})` : "";
    const now = check.body.step;
    // (a room that trained far past its resume point still said it "is resuming" there)
    note(Number.isInteger(now) && now > resumed
      ? `This room resumed from its checkpoint at step ${resumed}${cid} and has trained on to step ${now}: its curves start at step ${resumed}, not at a fresh model.`
      : `This room is resuming from its checkpoint at step ${resumed}${cid}: its curves start there, not at a fresh model.`);
  }
  note(`Python runtime: Pyodide ${boot.body.pyodide.version} from ${boot.body.pyodide.source === "local" ? "this server" : "the public CDN (no local copy on the server)"}.`);
  tc.bootInfo = boot.body;
  // a follower measures no speeds: read the leader's from the room's reports every 2 s
  // in a cluster: the other live nodes, and how many polls in a row this page's node missed
  // (each node's origin -> when a listing last named it: a node missing from one listing, its
  // Redis record late to renew on a busy machine, stays a candidate for a minute)
  const peers = new Map();
  let misses = 0, polls = 0;
  const pollLeader = async () => {
    const r = await getJSON(`/api/rooms/${encodeURIComponent(room)}${q}`);
    misses = r.unreachable ? misses + 1 : 0;
    if (!r.unreachable && polls++ % 5 === 0) {
      // a listing that failed (its node busy or dying) or left a node out keeps the nodes known
      // before: it replaced them, and a page whose node was then killed had nowhere to go (a CI
      // run of tests/browser/test_tab_cluster.py: stopped after 30 s at the dead node)
      const all = await getJSON("/api/rooms");
      if (all.body && Array.isArray(all.body.nodes)) {
        for (const n of all.body.nodes) {
          const o = originOf(n && n.url);
          if (o && o !== location.origin) peers.set(o, Date.now());
        }
      }
      for (const [o, t] of peers) if (Date.now() - t > PEER_KEPT_MS) peers.delete(o);
    }
    if (misses >= FAILOVER_MISSES && peers.size) {   // this node is gone: another one takes the room
      // (the most recently listed node: the page cannot ask another origin first, its CSP's
      // connect-src is 'self')
      const o = [...peers.keys()].sort((x, y) => peers.get(y) - peers.get(x))[0];
      const u = new URLSearchParams(location.search);
      u.set("room", room);
      u.set("failover", location.origin);
      status("This page's server stopped answering: moving to another node of the cluster…");
      location.assign(`${o}${location.pathname}?${u.toString()}`);
      return;
    }
    const ranks = r.body && Array.isArray(r.body.ranks) ? r.body.ranks : [];
    // the report the server trusts (a rank with the role), never any that says it leads
    const trusted = r.body ? r.body.trusted_id : null;
    const lead = ranks.find((x) => x && x.connected && x.report && x.id === trusted);
    const sp = lead && lead.report.speeds;
    tc.leaderView.speeds = sp && typeof sp === "object" ? sp : {};
    const qu = lead && lead.report.quarantined;
    tc.leaderView.quarantined = qu && typeof qu === "object" ? qu : {};
    if (r.status !== 403 && r.status !== 404) setTimeout(pollLeader, 2000);
  };
  setTimeout(pollLeader, 2000);

  setPhase("loading");
  status("Loading the Python runtime…");
  const worker = (tc.worker = new Worker("/web/rank-worker.js", { type: "module" }));
  const sockets = new Map();
  const post = (m, transfer) => worker.postMessage(m, transfer || []);
  const watch = new Set();
  let watchTimer = null;
  const ack = (link, ws, n) => {
    post({ k: "ack", link, bytes: n, buffered: ws.bufferedAmount });
    if (ws.bufferedAmount > 0) { watch.add(link); if (!watchTimer) watchTimer = setInterval(pollBuffered, 50); }
  };
  function pollBuffered() {
    for (const link of watch) {
      const ws = sockets.get(link);
      const b = ws ? ws.bufferedAmount : 0;
      post({ k: "ack", link, bytes: 0, buffered: b });
      if (!b) watch.delete(link);
    }
    if (!watch.size) { clearInterval(watchTimer); watchTimer = null; }
  }
  worker.onerror = (e) => fail("worker", `The rank's worker failed: ${e.message || e}`);
  worker.onmessage = (ev) => {
    const d = ev.data;
    switch (d.k) {
      case "ws-open": {
        // one socket per link: a new attempt replaces the last one (closed here, without news)
        const prev = sockets.get(d.link);
        if (prev) { sockets.delete(d.link); prev.close(1000, "replaced"); }
        const ws = new WebSocket(d.url);
        ws.binaryType = "arraybuffer";
        sockets.set(d.link, ws);
        tc.sockets++;
        ws.onopen = () => post({ k: "ws-opened", link: d.link });
        ws.onmessage = (e) => {
          if (typeof e.data === "string") post({ k: "ws-text", link: d.link, text: e.data });
          else post({ k: "ws-chunk", link: d.link, data: e.data }, [e.data]);
        };
        ws.onclose = (e) => {
          // a socket the worker closed or replaced is no news: its close event comes later, and
          // taken for the next attempt's it made the worker give that attempt up too, and a tab
          // once stayed disconnected for good after a server restart (a fault campaign)
          if (sockets.get(d.link) !== ws) return;
          sockets.delete(d.link);
          // 4012: another node of the cluster owns the room; the reason is its base URL
          if (e.code === 4012 && followOwner(e.reason, new URLSearchParams(location.search).get("room"))) return;
          post({ k: "ws-closed", link: d.link, code: e.code, reason: e.reason });
        };
        break;
      }
      case "send": {
        const ws = sockets.get(d.link);
        let n = 0;
        if (ws && ws.readyState === WebSocket.OPEN) for (const b of d.data) { ws.send(b); n += b.byteLength; }
        else for (const b of d.data) n += b.byteLength;
        ack(d.link, ws || { bufferedAmount: 0 }, n);
        break;
      }
      case "send-text": {
        const ws = sockets.get(d.link);
        if (ws && ws.readyState === WebSocket.OPEN) ws.send(d.text);
        ack(d.link, ws || { bufferedAmount: 0 }, d.text.length);
        break;
      }
      case "ws-close": {
        const ws = sockets.get(d.link);
        if (ws) { sockets.delete(d.link); ws.close(1000, "bye"); }
        break;
      }
      case "py": onPy(JSON.parse(d.json)); break;
      case "rtc": rtc.control(JSON.parse(d.json)); break;
      case "rtc-send": rtc.send(d); break;
    }
  };
  const rtc = (tc.rtc = makeRtc(post));
  tc.sendControl = (action, value) => post({ k: "control", action, value });
  $("start").onclick = () => tc.sendControl("start");
  $("stop").onclick = () => tc.sendControl("stop");
  $("leader-controls").onsubmit = (e) => {
    e.preventDefault();
    const lr = parseFloat($("lr").value);
    if (Number.isFinite(lr) && lr > 0) tc.sendControl("lr", lr);
    tc.sendControl("precision", $("precision").value);
  };
  document.addEventListener("freeze", () => tc.events.push({ k: "freeze", t: performance.now() }));
  document.addEventListener("resume", () => tc.events.push({ k: "resume", t: performance.now() }));
  post({ k: "boot", cfg: { base: location.origin, room, token: token || null, boot: boot.body,
    autostart: params.get("autostart") !== "0", numpy: params.get("numpy") !== "off",
    batch: params.get("batch") ? parseInt(params.get("batch"), 10) : null, link: params.get("link") || null,
    backend: params.get("backend") || "auto", gpuTest: params.get("gpu-test") || null,
    reconnect: params.get("reconnect") ? parseInt(params.get("reconnect"), 10) : null,
    mode: params.get("mode") || null } });  // mode=conformance: tests only (tests/browser/page_harness.py)
}

// WebRTC mesh links (tabcohort.bus.page.PageConnector drives them from the worker): one
// RTCPeerConnection and one ordered, reliable, binary data channel per peer. Offers and answers
// carry complete SDP (we wait for ICE gathering, bounded), so aiortc peers need no trickle.
// With ?rtc-loopback=1 the page first takes media permission: Chromium offers loopback host
// candidates only to a page holding it (same-machine testing; README, "Tests").
function makeRtc(post) {
  const pcs = new Map();  // `${link}:${peer}` -> {pc, ch, gen}
  const key = (d) => `${d.link}:${d.peer}`;
  let media = null;
  const needMedia = params.get("rtc-loopback") === "1";
  const ready = () => {
    if (!needMedia) return Promise.resolve();
    if (!media) {
      media = navigator.mediaDevices.getUserMedia({ audio: true })
        .then((s) => s.getTracks().forEach((t) => t.stop()))
        .catch((e) => tc.events.push({ k: "rtc-media", error: String(e) }));
    }
    return media;
  };
  const gathered = (pc) => new Promise((resolve) => {
    if (pc.iceGatheringState === "complete") return resolve();
    const t = setTimeout(resolve, 3000);
    pc.addEventListener("icegatheringstatechange", () => {
      if (pc.iceGatheringState === "complete") { clearTimeout(t); resolve(); }
    });
  });
  const current = (d) => { const e = pcs.get(key(d)); return e && e.gen === d.gen ? e : null; };
  const toWorker = (e, k, extra, transfer) => post({ k, link: e.link, peer: e.peer, gen: e.gen, ...extra }, transfer);
  const down = (e, reason) => {
    if (e.down || pcs.get(`${e.link}:${e.peer}`) !== e) return;
    e.down = true;
    toWorker(e, "rtc-down", { reason });
  };
  const local = (e, signal) => toWorker(e, "rtc-local", { text: JSON.stringify(signal) });
  // Below the low-water mark a channel drains without an event: re-acknowledge every 50 ms until
  // its bufferedAmount is 0, so the worker's count (pressure, flow control) does not stay stale.
  const draining = new Set();
  let drainTimer = null;
  const acked = (e) => {
    const b = e.ch && !e.down ? e.ch.bufferedAmount : 0;
    toWorker(e, "rtc-ack", { bytes: 0, buffered: b });
    return b;
  };
  const watchDrain = (e) => {
    if (!e.ch || !e.ch.bufferedAmount) return;
    draining.add(e);
    if (!drainTimer) drainTimer = setInterval(() => {
      for (const x of draining) if (x.down || pcs.get(`${x.link}:${x.peer}`) !== x || !acked(x)) draining.delete(x);
      if (!draining.size) { clearInterval(drainTimer); drainTimer = null; }
    }, 50);
  };
  const setup = (e, ch) => {
    e.ch = ch;
    ch.binaryType = "arraybuffer";
    ch.bufferedAmountLowThreshold = e.lowWater;
    ch.onopen = () => {
      tc.rtcOpened = (tc.rtcOpened || 0) + 1;   // (a pair's channel reopened after a fallback counts again)
      const k = `${e.link}:${e.peer}`;
      tc.rtcOpenedKeys = tc.rtcOpenedKeys || [];
      if (!tc.rtcOpenedKeys.includes(k)) tc.rtcOpenedKeys.push(k);
      const max = e.pc.sctp && e.pc.sctp.maxMessageSize;
      toWorker(e, "rtc-up", { bytes: Number.isFinite(max) && max > 0 ? Math.min(max, 262144) : 65536 });
    };
    ch.onmessage = (m) => {
      if (typeof m.data !== "string") toWorker(e, "rtc-chunk", { data: m.data }, [m.data]);
    };
    ch.onbufferedamountlow = () => { toWorker(e, "rtc-ack", { bytes: 0, buffered: ch.bufferedAmount }); watchDrain(e); };
    ch.onclose = () => down(e, "data channel closed");
    ch.onerror = (ev) => down(e, `data channel error: ${ev.error ? ev.error.message : "unknown"}`);
  };
  async function open(d) {
    close(d, true);
    const e = { link: d.link, peer: d.peer, gen: d.gen, lowWater: d.low_water || 262144, pc: null, ch: null };
    pcs.set(key(d), e);
    await ready();
    if (pcs.get(key(d)) !== e) return;
    const pc = (e.pc = new RTCPeerConnection({ iceServers: d.ice || [] }));
    tc.rtcCreated = (tc.rtcCreated || 0) + 1;
    pc.onconnectionstatechange = () => {
      if (pc.connectionState === "failed" || pc.connectionState === "closed") down(e, `peer connection ${pc.connectionState}`);
    };
    if (d.offer) {
      setup(e, pc.createDataChannel("tabcohort", { ordered: true }));
      await pc.setLocalDescription(await pc.createOffer());
      await gathered(pc);
      if (pcs.get(key(d)) === e) local(e, { kind: "offer", sdp: pc.localDescription.sdp });
    } else {
      pc.ondatachannel = (ev) => setup(e, ev.channel);
      await pc.setRemoteDescription({ type: "offer", sdp: d.sdp });
      await pc.setLocalDescription(await pc.createAnswer());
      await gathered(pc);
      if (pcs.get(key(d)) === e) local(e, { kind: "answer", sdp: pc.localDescription.sdp });
    }
  }
  async function signal(d) {
    const e = current(d);
    if (!e || !e.pc) return;
    const s = d.signal;
    if (s.kind === "answer" && e.pc.signalingState === "have-local-offer") await e.pc.setRemoteDescription({ type: "answer", sdp: s.sdp });
    else if (s.kind === "candidate" && s.candidate) await e.pc.addIceCandidate(s.candidate);
  }
  function close(d, replacing) {
    const e = pcs.get(key(d));
    if (!e || (!replacing && e.gen !== d.gen)) return;
    pcs.delete(key(d));
    e.down = true;
    if (e.ch) e.ch.close();
    if (e.pc) e.pc.close();
  }
  return {
    pcs,
    control(d) {
      const run = d.k === "rtc-open" ? open(d) : d.k === "rtc-signal" ? signal(d) : (close(d, false), null);
      if (run) run.catch((err) => { const e = current(d); if (e) down(e, `negotiation failed: ${err.message || err}`); });
    },
    send(d) {
      const e = current(d);
      let n = 0;
      for (const b of d.data) {
        n += b.byteLength;
        if (e && e.ch && e.ch.readyState === "open") {
          try { e.ch.send(b); } catch (err) { down(e, `send failed: ${err.message || err}`); break; }
        }
      }
      if (e) { toWorker(e, "rtc-ack", { bytes: n, buffered: e.ch ? e.ch.bufferedAmount : 0 }); watchDrain(e); }
    },
  };
}

function onPy(m) {
  tc.events.push(m.k === "state" ? { k: "state", step: m.state.step } : m);
  if (tc.events.length > 500) tc.events.splice(0, 250);
  switch (m.k) {
    case "progress": status(m.text + "…"); break;
    case "boot": tc.boot = m; note(`Pyodide booted in ${m.pyodide_s.toFixed(2)} s.`); break;
    case "numpy": tc.numpy = m; note(m.ok ? `Compute: ${m.text}.` : `Compute: ${m.text}.`); break;
    case "joined":
      tc.joinedAt = (performance.now() - tc.pageStart) / 1000;
      setPhase("training");
      status(`Joined as rank ${hex(m.id)}.`);
      break;
    case "job":
      renderJob(m);
      // a job that failed to load here is this tab's fault (its state report to the server says it
      // too): the Faults field said "none" beside the error, as no state report reaches the page then
      if (m.status === "failed") { tc.fault = String(m.error || "the job failed to load in this tab"); showFault(); }
      break;
    case "download": {
      tc.download = m;
      $("job-dl").hidden = m.got >= m.total;
      $("job-dl-label").textContent = `Downloading the job's ${m.what === "code" ? "code" : "data"}: ` +
        `${fmtBytes(m.got)} of ${fmtBytes(m.total)}`;
      $("job-progress").max = Math.max(1, m.total);
      $("job-progress").value = Math.min(m.got, m.total);
      if (m.cached) note(`The job's ${m.what} (${fmtBytes(m.total)}) came from this browser's cache.`);
      break;
    }
    case "state": render(m.state); break;
    case "error":
      // a refused control (lr or precision from a rank that does not lead) ends nothing: the rank
      // trains on, so the page says it as a note, not as the failure that stops the page
      if (m.kind === "control") note(`Not applied: ${m.text}`);
      else fail(m.kind || "error", m.text);
      break;
    case "finished": {
      // the room had finished before the rank fetched its job: the rank ended (text only, never markup)
      tc.finished = m;
      setPhase("stopped");
      const text = String(m.text || "the room has finished");
      status(`${text.charAt(0).toUpperCase()}${text.slice(1)}.`);
      $("start").disabled = $("stop").disabled = true;
      break;
    }
    case "stopped":
      tc.stopped = m;
      setPhase("stopped");
      // (a tab that gave up its link rejoins as a new rank when the page is loaded again)
      status(`Stopped (${m.reason || "by request"}) at step ${m.step}.` +
             (String(m.reason || "").startsWith("link failed") ? " Reload the page to join again." : ""));
      $("start").disabled = $("stop").disabled = true;
      $("leader-controls").hidden = true;
      break;
    case "log": if (m.stream === "stderr") tc.errors.push({ kind: "stderr", text: m.text }); break;
  }
}

// the Faults field: this tab's own fault (a job it cannot load), then its state's fault and wire
// drops; text only, never markup (a job's name, in its fault, comes from the server)
function showFault() {
  const all = [tc.fault, ...(tc.faults || [])].filter(Boolean).map(String);
  $("s-fault").textContent = [...new Set(all)].join("; ") || "none";
}

// a module job (README "Write your own job"): which one, its size and hash; text only, never markup
function renderJob(m) {
  tc.job = m;
  const e = $("job");
  e.hidden = false;
  const size = `code ${fmtBytes(m.code_bytes)}, data ${fmtBytes(m.data_bytes)}`;
  const what = `Job ${m.name} (${size}; code sha256 ${String(m.code_sha256).slice(0, 12)}, ` +
    `data sha256 ${String(m.data_sha256).slice(0, 12)})`;
  e.textContent = m.status === "failed" ? `${what}: failed to load.` :
    m.status === "ready" ? `${what}: ready, computing on ${m.backend}.` : `${what}: loading.`;
  if (m.status !== "loading") $("job-dl").hidden = true;
}

function render(s) {
  tc.state = s;
  tc.maxCohort = Math.max(tc.maxCohort, s.cohort || 0);
  $("s-id").textContent = hex(s.id);
  // the role the server bound to this tab's link (docs/PROTOCOL.md "Roles"), then what it does now
  const bound = s.may_lead === true ? "may lead" : s.may_lead === false ? "contributes" : null;
  const doing = s.is_leader ? "leader" : s.ready ? "follower" : s.joining ? "joining" : "waiting";
  // a rank that only contributes cannot start training: say what it waits for
  // (and a ready one whose leader is gone: it said "follower" with the step frozen, a new-user trial)
  // (and a tab cut off from the server hears no leader: it said there was none, and told the
  // user to start one, while the leader trained on and the tab was reconnecting: a fault campaign)
  const away = !!s.link && s.link.connected === false && !s.final;
  const waits = s.final ? ""
    : away
    ? ": the link to the server is lost; reconnecting"
    : !s.is_leader && s.may_lead === false && (!s.ready || s.leader_live === false)
    ? (s.ready ? ": no rank that may lead is in the room; training waits for one (started with the trainer token)"
       : ": waiting for a rank that may lead (one started with the trainer token)") : "";
  $("s-role").textContent = (bound ? `${doing} (${bound})` : doing) + waits;
  $("s-role").className = s.is_leader ? "leader" : "";
  $("s-cohort").textContent = s.cohort;
  $("s-step").textContent = s.step;
  $("s-loss").textContent = sig(s.loss);
  const follower = s.ready && !s.is_leader;
  $("s-acc").textContent = s.accuracy === null || s.accuracy === undefined
    ? (follower ? "– (the leader evaluates)" : "–") : `${(s.accuracy * 100).toFixed(1)} %`;
  const accNote = $("acc-note");
  const noAcc = follower && !accChart.length;
  if (accNote.hidden === noAcc) accNote.hidden = !noAcc;
  const accText = `Only the leader (rank ${hex(s.leader)}) evaluates held-out accuracy; this tab is a follower. The operator view shows the room's accuracy.`;
  if (noAcc && accNote.textContent !== accText) accNote.textContent = accText;   // the leader may change
  $("s-sps").textContent = num(s.steps_per_s, 1);
  $("s-samples").textContent = num(s.samples_per_s, 0);
  $("s-bytes").textContent = `${fmtBytes(s.wire_bytes_per_s)}/s`;
  $("s-precision").textContent = s.precision;
  $("s-policy").textContent = s.policy ? `${s.policy.n}, ${s.policy.quorum}, ${s.policy.beat_ms} ms` : "–";
  $("s-backend").textContent = `${s.backend}${s.backend === "webgpu" && s.adapter ? ` on ${s.adapter}` : ""} (${s.transport})`;
  const bn = $("s-backend-note");
  if (bn.textContent !== (s.backend_note || "")) { bn.textContent = s.backend_note || ""; bn.hidden = !s.backend_note; }
  // superseded rounds skipped unread are normal, not a fault (docs/PROTOCOL.md "Follower: receiving messages")
  const drops = Object.entries(s.wire_drops || {}).filter(([k, v]) => v && k !== "round_superseded")
    .map(([k, v]) => `${k} ${v}`);
  tc.faults = [s.fault, ...drops];
  showFault();
  lossChart.push(s.step, s.loss);
  accChart.push(s.step, s.accuracy);
  if (!s.final && tc.phase !== "stopped") {
    $("start").disabled = s.running;
    $("stop").disabled = !s.running;
    // stopped here (the Stop button): say so, not the join line; Start resumes
    if (!s.running && tc.wasRunning) status(`Stopped at step ${s.step}: this tab computes nothing until Start.`);
    else if (s.running && tc.wasRunning === false) status(`Running again as rank ${hex(s.id)}.`);
    tc.wasRunning = !!s.running;
  }
  // the lr / precision controls: only on a tab the server lets lead (an open room's tabs contribute)
  const lead = !!s.is_leader && !s.final && s.may_lead !== false;
  const form = $("leader-controls");
  if (form.hidden === lead) {
    form.hidden = !lead;
    if (lead) { $("lr").value = ""; $("precision").value = s.precision; }
  }
  const apply = form.querySelector("button[type=submit]");
  if (apply.disabled === !!s.running) apply.disabled = !s.running;   // a stopped rank applies nothing
  if (lead) {  // the box stays free for a new value; the current one is its placeholder
    $("lr").placeholder = `now ${sig(s.lr)}`;
    $("lr-now").textContent = `(now ${sig(s.lr)})`;
  }
  // shares: the last round's (every rank holds them); measured samples/s: the leader's own, or
  // those of the room's leader report (docs/PROTOCOL.md, "Shares")
  const shares = s.shares || {};
  const speeds = s.is_leader ? s.speeds || {} : tc.leaderView.speeds;
  const quar = s.is_leader ? s.quarantined || {} : tc.leaderView.quarantined;
  const shareText = (k) => (Object.hasOwn(quar, k) ? "quarantined by the leader"
    : Object.hasOwn(shares, k) ? `${shares[k]} of ${s.global_batch ?? "–"}` : "none");
  let mine = `${shareText(hex(s.id))}, ${num(speeds[hex(s.id)], 0)} samples/s measured`;
  if (s.running && s.ready && !s.is_leader && !Object.hasOwn(shares, hex(s.id)) && !Object.hasOwn(quar, hex(s.id))
      && Object.keys(shares).length && Object.hasOwn(speeds, hex(s.id))) {   // (measured by the leader)
    // why a volunteer's tab computes nothing (docs/PROTOCOL.md, "Shares"): not idle, following
    mine += ` (the other ranks finish the global batch of ${s.global_batch ?? "–"} before one bucket of this tab would ` +
      "arrive; it follows every round, is probed with a sample now and then, and gets a share when rounds are " +
      "long enough: a larger --global-batch)";
  }
  $("s-share").textContent = mine;
  $("s-epoch").textContent = s.epoch === null || s.epoch === undefined ? "–" : num(s.epoch, 2);
  const links = new Map((s.links || []).map((l) => [l.peer, l]));
  const roles = s.roles && typeof s.roles === "object" ? s.roles : {};
  // peer data is untrusted (any rank sends its own backend string): text nodes only, never markup
  const rows = (s.peers || []).map((p) => {
    const l = links.get(p.id) || { transport: s.transport, sent: 0, received: 0 };
    const role = roles[hex(p.id)] === true ? ", may lead" : roles[hex(p.id)] === false ? ", contributes" : "";
    return row([`${hex(p.id)}${p.id === s.leader ? " (leader)" : ""}${role}`, p.backend || "–", l.transport,
      fmtBytes(l.sent), fmtBytes(l.received), shareText(hex(p.id)), num(speeds[hex(p.id)], 0)]);
  });
  document.querySelector("#peers tbody").replaceChildren(...(rows.length ? rows : [row(["no peers yet"], 7)]));
}

// A table row of text cells (textContent: a value is shown as typed, never parsed as HTML).
function row(cells, span) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    const td = document.createElement("td");
    td.textContent = String(c);
    if (span) td.colSpan = span;
    tr.append(td);
  }
  return tr;
}

main().catch((e) => fail("page", `The page failed: ${e.message || e}`));

// Go to the page of the room at the cluster node that owns it (a 4012 close reason or the room
// list's owner_url). Only an http(s) origin is followed; the query (room, token) is kept.
function followOwner(ownerUrl, room) {
  const origin = originOf(ownerUrl);
  if (!origin || origin === location.origin) return false;
  const q = new URLSearchParams(location.search);
  if (room) q.set("room", room);
  q.delete("failover");
  location.assign(`${origin}${location.pathname}?${q.toString()}`);
  return true;
}

// polls (2 s apart) this page's node may miss before the page moves to another node
const FAILOVER_MISSES = 3;
// how long a node named by a room listing stays a place to move to after the last listing that named it
const PEER_KEPT_MS = 60000;

// how long a page that moved waits for a live node to own its room
const FAILOVER_WAIT_MS = 120000;

function originOf(url) {
  let u;
  try { u = new URL(String(url)); } catch (_) { return null; }
  return u.protocol === "http:" || u.protocol === "https:" ? u.origin : null;
}

// The page came here (?failover=ORIGIN) because the node at ORIGIN stopped answering: wait until
// the cluster names another owner of the room; true once it is this node (train here), false
// when the page went on to the owner or gave up (it says why).
async function awaitNewOwner(room, dead) {
  const gone = originOf(dead);
  const t0 = Date.now();
  while (Date.now() - t0 < FAILOVER_WAIT_MS) {
    const r = await getJSON("/api/rooms");
    const list = (r.body && Array.isArray(r.body.rooms)) ? r.body.rooms : [];
    const entry = list.find((x) => x && x.room === room);
    const owner = entry && originOf(entry.owner_url);
    if (owner && owner !== gone) {
      if (owner !== location.origin) return !followOwner(owner, room);
      const q = new URLSearchParams(location.search);
      q.delete("failover");
      history.replaceState(null, "", `${location.pathname}?${q.toString()}`);
      note(`The node this page came from (${gone || "unknown"}) stopped answering; this node took the room over.`);
      return true;
    }
    status(`The node this page came from stopped answering; waiting for another node to take the room over (${Math.round((Date.now() - t0) / 1000)} s)…`);
    await new Promise((res) => setTimeout(res, 1000));
  }
  fail("unreachable", `No node of the cluster took the room over within ${FAILOVER_WAIT_MS / 1000} s.`);
  return false;
}
