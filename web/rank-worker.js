// The rank's Python runs here: a dedicated module Web Worker (Pyodide requires a module worker;
// timers in a worker are not throttled when the tab is hidden). This file only boots Pyodide,
// installs the client wheel, and moves messages: protocol logic is Python
// (tabcohort.runtime.tab, tabcohort.bus.page). The page owns the WebSocket.
//
// page -> worker: {k: "boot", cfg}, then link and control messages (queued in `inbox`; Python
// drains the whole inbox per wake-up). worker -> page: {k: "py", json} UI messages, and the
// link messages of tabcohort.bus.page (chunks as transferred ArrayBuffers): WebSocket
// (ws-*) and, in a mesh room, WebRTC (rtc-*: the page owns the RTCPeerConnections).

import * as kernels from "./mlp-kernels.js";

// the js and webgpu backends' kernels, driven from Python (tabcohort.model.backend_js)
self.tcKernels = kernels;

const inbox = [];
let wake = null;

self.tcSetWake = (f) => {
  wake = f || null;
  if (wake && inbox.length) wake();
};
// A follower that is behind needs only the newest round of each lead (docs/PROTOCOL.md,
// "Follower: receiving messages", superseded rounds): when one take holds two or more complete
// round frames from the same sender on the same link, the older ones are dropped here, before
// Python converts and decodes them (a tab following a fast cohort would otherwise spend a core on
// rounds it can no longer use). Each lane's drops are summarised in one {k: "conflated"} item
// after its kept items, so the bus still counts the bytes it received.
const CHUNK_HEADER_BYTES = 22;   // tabcohort.wire.chunk.CHUNK_HEADER
const WIRE_VERSION = 1;
const MSG_ROUND = 3;             // tabcohort.wire.frame.MSG_TYPES["round"]
self.tcConflate = (items) => {
  const frames = new Map();
  for (let i = 0; i < items.length; i++) {
    const d = items[i];
    if ((d.k !== "ws-chunk" && d.k !== "rtc-chunk") || !(d.data instanceof ArrayBuffer)) continue;
    if (d.data.byteLength < CHUNK_HEADER_BYTES) continue;
    const v = new DataView(d.data);
    if (v.getUint8(0) !== WIRE_VERSION) continue;
    const sender = v.getUint32(2, true), fid = v.getUint32(10, true);
    const index = v.getUint16(14, true), count = v.getUint16(16, true);
    const lane = `${d.k}|${d.link}|${d.peer}|${d.gen}|${sender}`;
    const key = `${lane}|${fid}`;
    let f = frames.get(key);
    if (!f) { f = { lane, sender, count, seen: new Set(), at: [], round: false, bad: false }; frames.set(key, f); }
    if (f.count !== count || f.seen.has(index) || index >= count) f.bad = true;
    f.seen.add(index);
    f.at.push(i);
    if (index === 0) f.round = d.data.byteLength > CHUNK_HEADER_BYTES && v.getUint8(CHUNK_HEADER_BYTES) === MSG_ROUND;
  }
  const newest = new Map();
  const whole = [];
  for (const f of frames.values()) {
    if (!f.round || f.bad || f.seen.size !== f.count) continue;
    whole.push(f);
    const n = newest.get(f.lane);
    if (!n || f.at[f.at.length - 1] > n.at[n.at.length - 1]) newest.set(f.lane, f);
  }
  const drop = new Set();
  const lanes = new Map();
  for (const f of whole) {
    if (newest.get(f.lane) === f) continue;
    let s = lanes.get(f.lane);
    if (!s) {
      const d = items[f.at[0]];
      s = { k: "conflated", via: d.k, link: d.link, peer: d.peer, gen: d.gen, sender: f.sender, frames: 0, chunks: 0, bytes: 0 };
      lanes.set(f.lane, s);
    }
    s.frames++;
    for (const i of f.at) { drop.add(i); s.chunks++; s.bytes += items[i].data.byteLength; }
  }
  if (!drop.size) return items;
  const out = [];
  for (let i = 0; i < items.length; i++) if (!drop.has(i)) out.push(items[i]);
  for (const s of lanes.values()) out.push(s);
  return out;
};
self.tcTakeInbox = () => self.tcConflate(inbox.splice(0, inbox.length));
self.tcPost = (obj) => self.postMessage(obj);
self.tcPostJson = (json) => self.postMessage({ k: "py", json });
self.tcSendText = (link, text) => self.postMessage({ k: "send-text", link, text });
self.tcPostJsonTo = (json) => self.postMessage({ k: "rtc", json });
self.tcRtcSend = (link, peer, gen, arr) => {
  const bufs = [];
  for (const u8 of arr) {
    const whole = u8.byteOffset === 0 && u8.byteLength === u8.buffer.byteLength;
    bufs.push(whole ? u8.buffer : u8.slice().buffer);
  }
  self.postMessage({ k: "rtc-send", link, peer, gen, data: bufs }, bufs);
};
self.tcSendChunks = (link, arr) => {
  const bufs = [];
  for (const u8 of arr) {
    const whole = u8.byteOffset === 0 && u8.byteLength === u8.buffer.byteLength;
    bufs.push(whole ? u8.buffer : u8.slice().buffer);
  }
  self.postMessage({ k: "send", link, data: bufs }, bufs);
};

const ui = (obj) => self.postMessage({ k: "py", json: JSON.stringify(obj) });
const progress = (text, t0) =>
  ui({ k: "progress", text, t: t0 === undefined ? undefined : (performance.now() - t0) / 1000 });

self.onmessage = (ev) => {
  const d = ev.data;
  if (d && d.k === "boot") {
    boot(d.cfg).catch((e) => ui({ k: "error", kind: "boot", text: `boot failed: ${e && (e.message || e)}` }));
    return;
  }
  inbox.push(d);
  if (wake && inbox.length === 1) wake();
};

async function withTimeout(p, ms) {
  let t;
  const to = new Promise((resolve) => { t = setTimeout(() => resolve("timeout"), ms); });
  try { return await Promise.race([p, to]); } finally { clearTimeout(t); }
}

async function boot(cfg) {
  const t0 = performance.now();
  const b = cfg.boot;
  const indexURL = new URL(b.pyodide.url, cfg.base).href;
  progress(`loading the Python runtime: Pyodide ${b.pyodide.version} from ${b.pyodide.source === "local" ? "this server" : "the public CDN"}`, t0);
  const { loadPyodide } = await import(new URL("pyodide.mjs", indexURL).href);
  const opts = { indexURL, env: { HOME: "/home/pyodide" } };
  if (b.stdlib && b.stdlib.url) opts.stdLibURL = new URL(b.stdlib.url, cfg.base).href;  // precompiled .pyc
  if (b.packages.source === "local") {
    opts.lockFileURL = new URL("pyodide-lock.json", new URL(b.packages.url, cfg.base)).href;
  } else {
    opts.packageBaseUrl = b.packages.url;
  }
  opts.stdout = (line) => ui({ k: "log", text: line });
  opts.stderr = (line) => ui({ k: "log", text: line, stream: "stderr" });
  const py = await loadPyodide(opts);
  self.tcPyodide = py;  // for tests and bench (wasm heap size over DevTools): tests/browser/test_tab_memory.py
  const tBoot = (performance.now() - t0) / 1000;
  ui({ k: "boot", pyodide_s: tBoot, source: b.pyodide.source, version: b.pyodide.version });

  progress("installing the tabcohort client package", t0);
  const resp = await fetch(new URL(b.wheel.url, cfg.base).href, { cache: "no-store" });
  if (!resp.ok) throw new Error(`wheel: HTTP ${resp.status}`);
  py.unpackArchive(new Uint8Array(await resp.arrayBuffer()), "wheel", { extractDir: b.site_packages });

  let numpy = false;
  let numpyNote = "not requested";
  if (cfg.numpy !== false) {
    progress(`loading numpy from ${b.packages.source === "local" ? "this server" : "the public CDN"}`, t0);
    const errors = [];
    // loadPackage does not throw when a package cannot be fetched: only its error callback says so.
    const r = await withTimeout(
      py.loadPackage("numpy", { messageCallback: () => {}, errorCallback: (m) => errors.push(m) }).catch((e) => errors.push(String(e))),
      cfg.numpyTimeoutMs || 20000,
    );
    if (r === "timeout") errors.push("timed out");
    try {
      py.runPython("import numpy");
      numpy = true;
      numpyNote = `numpy from ${b.packages.source === "local" ? "this server" : "the CDN"}`;
    } catch {
      const why = errors.join(" ").replace(/\s+/g, " ").replace("The following error occurred while loading numpy:", "").trim();
      numpyNote = `numpy unavailable from ${b.packages.source === "local" ? "this server's package directory" : "the public CDN"} (${(why || "import failed").slice(0, 160)})`;
    }
  }
  ui({ k: "numpy", ok: numpy, text: numpyNote });
  const pycfg = {
    base: cfg.base, room: cfg.room, token: cfg.token || null, autostart: cfg.autostart !== false,
    backend: cfg.backend || "auto", batch: cfg.batch || null, link: cfg.link || null,
    reconnect: cfg.reconnect || null,
    wgsl_suffix: cfg.gpuTest === "bad-wgsl" ? "\nfn broken( {" : "",
  };
  if (cfg.mode === "conformance") {
    // tests only (tests/browser/page_harness.py): the bus conformance battery drives buses here
    progress("starting the bus conformance agent", t0);
    await py.runPythonAsync("from tabcohort.runtime.conformance_agent import run_agent\nawait run_agent()");
    return;
  }
  progress("starting the rank", t0);
  py.globals.set("_tc_cfg", JSON.stringify(pycfg));
  const rc = await py.runPythonAsync(`
from tabcohort.runtime.tab import run_tab
await run_tab(_tc_cfg)
`);
  ui({ k: "exit", code: rc });
}
