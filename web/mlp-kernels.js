// The MLP's forward and backward passes for a tab's worker, in two backends that the Python
// worker (tabcohort.model.backend_js) drives through Pyodide's JS interface:
//
// - CpuMLP ("js"): plain JavaScript over typed arrays, float64 arithmetic rounded to float32 once
//   (as the numpy and pure-Python backends do, so the three agree to float32 rounding).
// - GpuMLP ("webgpu"): WGSL compute kernels; parameters and data stay on the GPU, a bucket is one
//   queue submission and one readback (gradient and loss in one buffer); float32 arithmetic.
//
// Model (tabcohort.model.mlp): parameters are one flat float32 vector, layer by layer, W_l of shape
// (n_in, n_out) row-major then b_l (n_out); hidden layers ReLU or tanh; softmax cross-entropy.
// Sample k of a bucket at offset o is training row (o + k) % n_train. Both classes capture the
// parameters when a bucket starts (docs/PROTOCOL.md, "Worker contract"): a later setParams does not
// change a bucket in flight.

/** Multiply-adds of forward + backward work per CpuJob.step() (a few ms of JS). */
export const SLICE_MACS = 2_000_000;

function layout(layers) {
  const out = [];
  let off = 0;
  for (let k = 0; k + 1 < layers.length; k++) {
    const nIn = layers[k], nOut = layers[k + 1];
    out.push({ w: off, b: off + nIn * nOut, nIn, nOut });
    off += nIn * nOut + nOut;
  }
  return { layers: out, bucketLen: off };
}

function checkLayers(layers) {
  if (!Array.isArray(layers) || layers.length < 2 || !layers.every((n) => Number.isInteger(n) && n >= 1)) {
    throw new Error(`layers must be >= 2 positive integers, got ${JSON.stringify(layers)}`);
  }
}

export class CpuMLP {
  /**
   * @param {number[]} layers widths (n_features, ...hidden, n_classes)
   * @param {string} activation "relu" | "tanh"
   * @param {Float32Array} x training features, n_train * n_features, row-major
   * @param {Int32Array} y training labels, n_train
   * @param {Float32Array} xTest held-out features
   * @param {Int32Array} yTest held-out labels
   */
  constructor(layers, activation, x, y, xTest, yTest) {
    checkLayers(layers);
    const L = layout(layers);
    this.widths = layers.slice();
    this.layers = L.layers;
    this.bucketLen = L.bucketLen;
    this.tanh = activation === "tanh";
    this.x = x; this.y = y; this.xTest = xTest; this.yTest = yTest;
    this.nTrain = y.length;
    const macs = this.layers.reduce((s, l) => s + l.nIn * l.nOut, 0);
    this.sliceSamples = Math.max(1, Math.floor(SLICE_MACS / (3 * macs)));
    this.p = new Float64Array(this.bucketLen);
    this.held = false;   // a job holds this.p: the next setParams allocates a new one
    this.scratch = null;
  }

  /** Replace the parameters (any typed array of bucketLen values; float32 expected). */
  setParams(src) {
    if (src.length !== this.bucketLen) throw new Error(`params length ${src.length} != ${this.bucketLen}`);
    if (this.held) { this.p = new Float64Array(this.bucketLen); this.held = false; }
    this.p.set(src);
  }

  /** One SGD step, float32(params - lr * avg) computed in float64; returns the new float32 params. */
  apply(avg, lr) {
    const p = this.p, out = new Float32Array(this.bucketLen);
    for (let i = 0; i < out.length; i++) out[i] = p[i] - lr * avg[i];
    this.setParams(out);
    return out;
  }

  _buffers(m) {
    if (!this.scratch || this.scratch.m < m) {
      this.scratch = { m, A: this.widths.map((w) => new Float64Array(m * w)), D: this.widths.map((w) => new Float64Array(m * w)) };
    }
    return this.scratch;
  }

  _forward(p, A, m) {
    const last = this.layers.length - 1;
    for (let k = 0; k <= last; k++) {
      const { w, b, nIn, nOut } = this.layers[k];
      const H = A[k], Z = A[k + 1];
      for (let r = 0; r < m; r++) {
        const zo = r * nOut, ho = r * nIn;
        for (let j = 0; j < nOut; j++) Z[zo + j] = p[b + j];
        for (let i = 0; i < nIn; i++) {
          const a = H[ho + i];
          if (a === 0) continue;
          const wo = w + i * nOut;
          for (let j = 0; j < nOut; j++) Z[zo + j] += a * p[wo + j];
        }
        if (k < last) {
          if (this.tanh) for (let j = 0; j < nOut; j++) Z[zo + j] = Math.tanh(Z[zo + j]);
          else for (let j = 0; j < nOut; j++) if (Z[zo + j] < 0) Z[zo + j] = 0;
        }
      }
    }
  }

  _gather(A0, xs, f, rows) {
    for (let r = 0; r < rows.length; r++) {
      const so = rows[r] * f, d = r * f;
      for (let i = 0; i < f; i++) A0[d + i] = xs[so + i];
    }
  }

  /** Start a bucket of n samples at offset (captures the current parameters). */
  begin(offset, n) {
    if (!Number.isInteger(n) || n < 1) throw new Error(`samples must be >= 1, got ${n}`);
    this.held = true;
    return new CpuJob(this, this.p, ((offset % this.nTrain) + this.nTrain) % this.nTrain, n);
  }

  /** Run a whole bucket without yielding: {loss, g} (g float32, bucketLen). */
  gradsSync(offset, n) {
    const job = this.begin(offset, n);
    while (!job.step()) { /* all slices */ }
    return job.finish();
  }

  _accumulate(p, rows, g) {
    const m = rows.length, f = this.widths[0], C = this.widths[this.widths.length - 1];
    const { A, D } = this._buffers(m);
    this._gather(A[0], this.x, f, rows);
    this._forward(p, A, m);
    const last = this.layers.length - 1, Z = A[last + 1], DL = D[last + 1];
    let loss = 0;
    for (let r = 0; r < m; r++) {
      const o = r * C, label = this.y[rows[r]];
      let mx = -Infinity;
      for (let j = 0; j < C; j++) if (Z[o + j] > mx) mx = Z[o + j];
      let s = 0;
      for (let j = 0; j < C; j++) { const e = Math.exp(Z[o + j] - mx); DL[o + j] = e; s += e; }
      loss += Math.log(s) - (Z[o + label] - mx);
      for (let j = 0; j < C; j++) DL[o + j] /= s;
      DL[o + label] -= 1;
    }
    for (let k = last; k >= 0; k--) {
      const { w, b, nIn, nOut } = this.layers[k];
      const H = A[k], Dk = D[k + 1], Dp = D[k];
      for (let r = 0; r < m; r++) {
        const dOff = r * nOut, hOff = r * nIn;
        for (let j = 0; j < nOut; j++) g[b + j] += Dk[dOff + j];
        for (let i = 0; i < nIn; i++) {
          const a = H[hOff + i];
          if (a !== 0) {
            const go = w + i * nOut;
            for (let j = 0; j < nOut; j++) g[go + j] += a * Dk[dOff + j];
          }
          if (k > 0) {
            if (a === 0 && !this.tanh) { Dp[hOff + i] = 0; continue; }
            const wo = w + i * nOut;
            let acc = 0;
            for (let j = 0; j < nOut; j++) acc += p[wo + j] * Dk[dOff + j];
            Dp[hOff + i] = this.tanh ? acc * (1 - a * a) : acc;
          }
        }
      }
    }
    return loss;
  }

  _logits(split) {
    const xs = split === "test" ? this.xTest : this.x;
    const ys = split === "test" ? this.yTest : this.y;
    const n = ys.length, f = this.widths[0], C = this.widths[this.widths.length - 1];
    const step = Math.max(1, Math.min(n, this.sliceSamples));
    const out = new Float64Array(n * C);
    const { A } = this._buffers(step);
    for (let lo = 0; lo < n; lo += step) {
      const m = Math.min(step, n - lo);
      const rows = new Int32Array(m);
      for (let r = 0; r < m; r++) rows[r] = lo + r;
      this._gather(A[0], xs, f, rows);
      this._forward(this.p, A, m);
      out.set(A[A.length - 1].subarray(0, m * C), lo * C);
    }
    return { out, ys, C };
  }

  /** Held-out accuracy (argmax, first maximum on ties) and mean cross-entropy: [acc, loss]. */
  evaluate() {
    const { out, ys, C } = this._logits("test");
    let correct = 0, loss = 0;
    for (let r = 0; r < ys.length; r++) {
      const o = r * C;
      let best = 0, mx = out[o];
      for (let j = 1; j < C; j++) if (out[o + j] > mx) { mx = out[o + j]; best = j; }
      if (best === ys[r]) correct++;
      let s = 0;
      for (let j = 0; j < C; j++) s += Math.exp(out[o + j] - mx);
      loss += Math.log(s) - (out[o + ys[r]] - mx);
    }
    return [correct / ys.length, loss / ys.length];
  }
}

class CpuJob {
  constructor(model, p, start, n) {
    this.model = model; this.p = p; this.start = start; this.n = n; this.done = 0;
    this.g = new Float64Array(model.bucketLen); this.loss = 0;
  }

  /** One slice of at most model.sliceSamples samples; true when the bucket is complete. */
  step() {
    const M = this.model, m = Math.min(M.sliceSamples, this.n - this.done);
    const rows = new Int32Array(m);
    for (let r = 0; r < m; r++) rows[r] = (this.start + this.done + r) % M.nTrain;
    this.loss += M._accumulate(this.p, rows, this.g);
    this.done += m;
    return this.done >= this.n;
  }

  /** {loss: mean (float64), g: mean gradient as Float32Array(bucketLen)}. */
  finish() {
    const g32 = new Float32Array(this.g.length), n = this.n;
    for (let i = 0; i < g32.length; i++) g32[i] = this.g[i] / n;
    return { loss: this.loss / n, g: g32 };
  }
}

// ---------------------------------------------------------------------------------------- WebGPU

const WG = 64;          // workgroup size of every kernel
const MAX_GROUPS = 65535;

/** The kernels (one module, one explicit bind group layout shared by every entry point). */
export const WGSL = /* wgsl */ `
struct U {
  n: u32, start: u32, n_train: u32, n_in: u32,
  n_out: u32, w_off: u32, flags: u32, bucket_len: u32,
  inv_n: f32, p0: u32, p1: u32, p2: u32,
};
// flags: 1 = the layer's input is the dataset (gather rows), 2 = apply the hidden activation,
// 4 = the network's activation is tanh (else ReLU)
@group(0) @binding(0) var<uniform> u: U;
@group(0) @binding(1) var<storage, read> P: array<f32>;
@group(0) @binding(2) var<storage, read> Y: array<u32>;
@group(0) @binding(3) var<storage, read> src: array<f32>;
@group(0) @binding(4) var<storage, read_write> dst: array<f32>;
@group(0) @binding(5) var<storage, read_write> delta: array<f32>;
@group(0) @binding(6) var<storage, read_write> G: array<f32>;
@group(0) @binding(7) var<storage, read_write> lossv: array<f32>;

fn src_row(r: u32) -> u32 {
  if ((u.flags & 1u) != 0u) { return (u.start + r) % u.n_train; }
  return r;
}
fn index(gid: vec3<u32>, nwg: vec3<u32>) -> u32 { return gid.x + gid.y * nwg.x * ${WG}u; }

@compute @workgroup_size(${WG}) fn fwd(@builtin(global_invocation_id) gid: vec3<u32>,
                                    @builtin(num_workgroups) nwg: vec3<u32>) {
  let idx = index(gid, nwg);
  if (idx >= u.n * u.n_out) { return; }
  let r = idx / u.n_out;
  let j = idx % u.n_out;
  let base = src_row(r) * u.n_in;
  var z = P[u.w_off + u.n_in * u.n_out + j];
  for (var i = 0u; i < u.n_in; i++) { z += src[base + i] * P[u.w_off + i * u.n_out + j]; }
  if ((u.flags & 2u) != 0u) {
    if ((u.flags & 4u) != 0u) { z = tanh(z); } else { z = max(z, 0.0); }
  }
  dst[idx] = z;
}

@compute @workgroup_size(${WG}) fn xent(@builtin(global_invocation_id) gid: vec3<u32>,
                                     @builtin(num_workgroups) nwg: vec3<u32>) {
  let r = index(gid, nwg);
  if (r >= u.n) { return; }
  let C = u.n_out;
  let o = r * C;
  var m = src[o];
  for (var j = 1u; j < C; j++) { m = max(m, src[o + j]); }
  var s = 0.0;
  for (var j = 0u; j < C; j++) { s += exp(src[o + j] - m); }
  let y = Y[(u.start + r) % u.n_train];
  lossv[r] = log(s) - (src[o + y] - m);
  for (var j = 0u; j < C; j++) { delta[o + j] = exp(src[o + j] - m) / s - select(0.0, 1.0, j == y); }
}

@compute @workgroup_size(${WG}) fn gw(@builtin(global_invocation_id) gid: vec3<u32>,
                                   @builtin(num_workgroups) nwg: vec3<u32>) {
  let idx = index(gid, nwg);
  let nw = u.n_in * u.n_out;
  if (idx >= nw + u.n_out) { return; }
  var acc = 0.0;
  if (idx < nw) {
    let i = idx / u.n_out;
    let j = idx % u.n_out;
    for (var r = 0u; r < u.n; r++) { acc += src[src_row(r) * u.n_in + i] * delta[r * u.n_out + j]; }
  } else {
    let j = idx - nw;
    for (var r = 0u; r < u.n; r++) { acc += delta[r * u.n_out + j]; }
  }
  G[u.w_off + idx] = acc * u.inv_n;
}

@compute @workgroup_size(${WG}) fn gh(@builtin(global_invocation_id) gid: vec3<u32>,
                                   @builtin(num_workgroups) nwg: vec3<u32>) {
  let idx = index(gid, nwg);
  if (idx >= u.n * u.n_in) { return; }
  let r = idx / u.n_in;
  let i = idx % u.n_in;
  let h = src[idx];
  var acc = 0.0;
  if ((u.flags & 4u) != 0u || h > 0.0) {
    for (var j = 0u; j < u.n_out; j++) { acc += delta[r * u.n_out + j] * P[u.w_off + i * u.n_out + j]; }
    if ((u.flags & 4u) != 0u) { acc = acc * (1.0 - h * h); }
  }
  dst[idx] = acc;
}

@compute @workgroup_size(1) fn lossr() {
  var s = 0.0;
  for (var r = 0u; r < u.n; r++) { s += lossv[r]; }
  G[u.bucket_len] = s * u.inv_n;
}
`;

const ENTRIES = ["fwd", "xent", "gw", "gh", "lossr"];

/** The adapter's name for reports: "google swiftshader" and the like (vendor, architecture, device). */
function adapterName(adapter) {
  const i = adapter.info || {};
  const parts = [i.vendor, i.architecture, i.device, i.description].filter((s) => typeof s === "string" && s);
  return parts.length ? [...new Set(parts)].join(" ") : "unknown adapter";
}

export class GpuMLP {
  /**
   * Build the kernels and upload the training data. Rejects (with the reason) when there is no
   * adapter, the device cannot be created, or a kernel does not compile.
   * @param {object} o {layers, activation, x: Float32Array, y: Int32Array, nMax, wgslSuffix?}
   */
  static async create(o) {
    checkLayers(o.layers);
    if (typeof navigator === "undefined" || !navigator.gpu) throw new Error("this browser exposes no WebGPU (navigator.gpu)");
    const adapter = await navigator.gpu.requestAdapter();
    if (!adapter) throw new Error("no WebGPU adapter");
    const L = layout(o.layers);
    const need = 4 * Math.max(L.bucketLen + 1, o.x.length, o.nMax * Math.max(...o.layers));
    const lim = adapter.limits;
    if (need > lim.maxStorageBufferBindingSize || need > lim.maxBufferSize) {
      throw new Error(`a buffer of ${need} bytes exceeds the adapter's limits (${lim.maxStorageBufferBindingSize})`);
    }
    const device = await adapter.requestDevice({
      requiredLimits: { maxStorageBufferBindingSize: lim.maxStorageBufferBindingSize, maxBufferSize: lim.maxBufferSize },
    });
    const g = new GpuMLP(device, adapterName(adapter), o.layers, L, o.activation === "tanh", o.y.length);
    try {
      await g._build(o);
    } catch (e) {
      device.destroy();
      throw e;
    }
    return g;
  }

  constructor(device, adapter, widths, L, tanh, nTrain) {
    this.device = device;
    this.adapter = adapter;
    this.widths = widths.slice();
    this.layers = L.layers;
    this.bucketLen = L.bucketLen;
    this.tanh = tanh;
    this.nTrain = nTrain;
    this.failed = null;   // why the device is unusable (lost, an error), or null
    this.readbacks = [];
    globalThis.tcGpu = this;   // the latest device, for tests (a lost device: tcGpu.device.destroy())
    this.lostP = device.lost;
    device.lost.then((info) => { this.failed = this.failed || `device lost (${info.reason || "unknown"}${info.message ? `: ${info.message}` : ""})`; });
    device.onuncapturederror = (ev) => { this.failed = this.failed || `GPU error: ${ev.error && ev.error.message}`; };
  }

  async _build(o) {
    const d = this.device;
    d.pushErrorScope("validation");
    const module = d.createShaderModule({ code: WGSL + (o.wgslSuffix || "") });
    const info = await module.getCompilationInfo();
    const errs = info.messages.filter((m) => m.type === "error");
    if (errs.length) {
      await d.popErrorScope();
      throw new Error(`WGSL does not compile: ${errs.map((m) => `${m.lineNum}:${m.linePos} ${m.message}`).join("; ").slice(0, 300)}`);
    }
    const S = (type) => ({ buffer: { type } });
    const C = GPUShaderStage.COMPUTE;
    this.bgl = d.createBindGroupLayout({
      entries: [
        { binding: 0, visibility: C, ...S("uniform") },
        { binding: 1, visibility: C, ...S("read-only-storage") },
        { binding: 2, visibility: C, ...S("read-only-storage") },
        { binding: 3, visibility: C, ...S("read-only-storage") },
        { binding: 4, visibility: C, ...S("storage") },
        { binding: 5, visibility: C, ...S("storage") },
        { binding: 6, visibility: C, ...S("storage") },
        { binding: 7, visibility: C, ...S("storage") },
      ],
    });
    const layout = d.createPipelineLayout({ bindGroupLayouts: [this.bgl] });
    this.pipes = {};
    for (const e of ENTRIES) {
      this.pipes[e] = await d.createComputePipelineAsync({ layout, compute: { module, entryPoint: e } });
    }
    const U = GPUBufferUsage;
    const buf = (size, usage) => d.createBuffer({ size: Math.max(16, Math.ceil(size / 4) * 4), usage });
    this.P = buf(4 * this.bucketLen, U.STORAGE | U.COPY_DST);
    this.X = buf(4 * o.x.length, U.STORAGE | U.COPY_DST);
    d.queue.writeBuffer(this.X, 0, o.x);
    this.Y = buf(4 * o.y.length, U.STORAGE | U.COPY_DST);
    d.queue.writeBuffer(this.Y, 0, new Uint32Array(o.y.buffer, o.y.byteOffset, o.y.length));
    this.G = buf(4 * (this.bucketLen + 1), U.STORAGE | U.COPY_SRC);
    this.dummy = buf(16, U.STORAGE);
    this.uniforms = this.layers.map(() => buf(48, U.UNIFORM | U.COPY_DST));
    this._resize(Math.max(1, o.nMax | 0));
    const err = await d.popErrorScope();
    if (err) throw new Error(`WebGPU validation: ${err.message}`);
  }

  _resize(n) {
    const d = this.device, U = GPUBufferUsage;
    const mk = (w) => d.createBuffer({ size: Math.max(16, 4 * n * w), usage: U.STORAGE });
    this.nCap = n;
    this.A = this.widths.map((w, k) => (k === 0 ? this.X : mk(w)));   // A[0] is the dataset (gathered)
    this.D = this.widths.map((w, k) => (k === 0 ? this.dummy : mk(w)));
    this.lossv = d.createBuffer({ size: Math.max(16, 4 * n), usage: U.STORAGE });
    const group = (k, srcBuf, dstBuf, deltaBuf) => d.createBindGroup({
      layout: this.bgl,
      entries: [this.uniforms[k], this.P, this.Y, srcBuf, dstBuf, deltaBuf, this.G, this.lossv]
        .map((buffer, binding) => ({ binding, resource: { buffer } })),
    });
    const last = this.layers.length - 1;
    this.groups = this.layers.map((_, k) => ({
      fwd: group(k, this.A[k], this.A[k + 1], this.D[k + 1]),
      gw: group(k, this.A[k], this.dummy, this.D[k + 1]),
      gh: k > 0 ? group(k, this.A[k], this.D[k], this.D[k + 1]) : null,
    }));
    // cross-entropy reads the logits and writes the output layer's delta
    this.groups.xent = group(last, this.A[last + 1], this.dummy, this.D[last + 1]);
  }

  /** Replace the parameters on the GPU (Float32Array, bucketLen); queued after earlier buckets. */
  setParams(p32) {
    if (p32.length !== this.bucketLen) throw new Error(`params length ${p32.length} != ${this.bucketLen}`);
    if (this.failed) return;
    this.device.queue.writeBuffer(this.P, 0, p32);
  }

  _dispatch(pass, pipe, group, threads) {
    const groups = Math.ceil(threads / WG);
    const x = Math.min(groups, MAX_GROUPS), y = Math.ceil(groups / MAX_GROUPS);
    pass.setPipeline(pipe);
    pass.setBindGroup(0, group);
    pass.dispatchWorkgroups(x, y);
  }

  /**
   * One bucket: {loss, g} with g a Float32Array(bucketLen). Everything is submitted before the
   * first await, so the parameters are those of the call (queue order); one readback.
   */
  async grads(offset, n, timeoutMs = 30000) {
    if (this.failed) throw new Error(this.failed);
    if (!Number.isInteger(n) || n < 1) throw new Error(`samples must be >= 1, got ${n}`);
    const d = this.device;
    if (n > this.nCap) this._resize(n);
    const start = ((offset % this.nTrain) + this.nTrain) % this.nTrain;
    const last = this.layers.length - 1;
    this.layers.forEach((l, k) => {
      const flags = (k === 0 ? 1 : 0) | (k < last ? 2 : 0) | (this.tanh ? 4 : 0);
      const u = new ArrayBuffer(48), u32 = new Uint32Array(u), f32 = new Float32Array(u);
      u32.set([n, start, this.nTrain, l.nIn, l.nOut, l.w, flags, this.bucketLen]);
      f32[8] = 1 / n;
      d.queue.writeBuffer(this.uniforms[k], 0, u);
    });
    const enc = d.createCommandEncoder();
    const pass = enc.beginComputePass();
    this.layers.forEach((l, k) => this._dispatch(pass, this.pipes.fwd, this.groups[k].fwd, n * l.nOut));
    this._dispatch(pass, this.pipes.xent, this.groups.xent, n);
    for (let k = last; k >= 0; k--) {
      const l = this.layers[k];
      this._dispatch(pass, this.pipes.gw, this.groups[k].gw, l.nIn * l.nOut + l.nOut);
      if (k > 0) this._dispatch(pass, this.pipes.gh, this.groups[k].gh, n * l.nIn);
    }
    pass.setPipeline(this.pipes.lossr);
    pass.setBindGroup(0, this.groups[last].gw);
    pass.dispatchWorkgroups(1);
    pass.end();
    const bytes = 4 * (this.bucketLen + 1);
    const rb = this.readbacks.pop() || d.createBuffer({ size: bytes, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
    enc.copyBufferToBuffer(this.G, 0, rb, 0, bytes);
    d.queue.submit([enc.finish()]);
    // every contender resolves (never rejects), so no promise is left unhandled after the race
    let timer;
    const watchdog = new Promise((resolve) => {
      timer = setTimeout(() => resolve(`no readback within ${timeoutMs} ms`), timeoutMs);
    });
    const mapped = rb.mapAsync(GPUMapMode.READ).then(() => "ok", (e) => `readback failed: ${e && e.message || e}`);
    const lost = this.lostP.then((info) => `device lost (${info.reason || "unknown"}${info.message ? `: ${info.message}` : ""})`);
    const r = await Promise.race([mapped, watchdog, lost]);
    clearTimeout(timer);
    if (r !== "ok") {
      // a destroyed device also fails the pending readback first: name the cause when it is known
      let t2;
      const lostSoon = await Promise.race([lost, new Promise((resolve) => { t2 = setTimeout(() => resolve(null), 200); })]);
      clearTimeout(t2);
      this.failed = this.failed || lostSoon || r;
    }
    if (this.failed) throw new Error(this.failed);
    const all = new Float32Array(rb.getMappedRange().slice(0));
    rb.unmap();
    this.readbacks.push(rb);
    return { loss: all[this.bucketLen], g: all.subarray(0, this.bucketLen) };
  }

  destroy() { this.failed = this.failed || "destroyed"; this.device.destroy(); }
}

/**
 * One bucket of n samples at offset 0 on the GPU and on the js kernels, compared:
 * {rel: ||g_gpu - g_js|| / ||g_js||, loss_gpu, loss_cpu}.
 */
export async function probeGpu(gpu, cpu, n) {
  const a = await gpu.grads(0, n);
  const b = cpu.gradsSync(0, n);
  let num = 0, den = 0;
  for (let i = 0; i < b.g.length; i++) { const d = a.g[i] - b.g[i]; num += d * d; den += b.g[i] * b.g[i]; }
  const rel = Math.sqrt(num) / (Math.sqrt(den) || 1);
  return { rel: Number.isFinite(rel) ? rel : Infinity, loss_gpu: a.loss, loss_cpu: b.loss };
}
