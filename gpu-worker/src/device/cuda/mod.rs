//! The CUDA device: embeddings, norms, RoPE, every linear layer and the LM head run on the
//! GPU. A step no cpu-worker shares runs each layer wholly there (`layer_wholly`: attention on
//! the KV mirror, `mirror`, K/V down to the arenas once a step, greedy tokens on the GPU);
//! otherwise, as at stage A, each layer's Q/K/V come to the host, where the caller stores K/V
//! into the cpu-workers' arenas (or its own cache) and attention runs (the mirror's share on
//! the GPU, the rest on the host or the cpu-workers), and the attention output goes back up.
//! Weights stay on the GPU in their GGUF types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
//! Q6_K, F16, BF16, F32). Beyond the plain Llama block: Q/K/V biases (Qwen 2), Q/K norms
//! (Qwen 3, OLMoE), NeoX RoPE, and mixtures of experts as KTransformers runs them — the router
//! on the GPU, the routed experts on the host (`HostExperts`: in this process, or the
//! cpu-workers' expert jobs), the hot ones on the GPU with `--device-experts`, and every one a
//! batch of many rows uses streamed to the GPU (`gpu_experts`).
//!
//! Built with cudarc's dynamic loading: nothing CUDA is needed to build, and [`probe`]
//! finds out, without panicking, whether this machine can run it. Kernels are CUDA C
//! compiled by NVRTC at load (`kernels`), launched through `launch`.
//!
//! Numerics: activations are quantised to Q8_1 for the matrix-vector kernels (the CPU uses
//! Q8_0/Q8_K as ggml does) and to f16 for cuBLAS, and sums run in another order, so logits
//! match the CPU device's within a tolerance, not bit for bit; dequantisation is exact.

mod budget;
mod gpu_experts;
mod host_map;
mod kernels;
mod launch;
mod mirror;
mod mirror_pages;
#[cfg(test)]
mod mirror_twins;
mod phases;
mod probe;
#[cfg(test)]
mod twins;

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{CudaSlice, CudaStream};
use duet_model::config::{FfnAct, LlamaConfig};
use duet_model::gguf::GgufFile;
use duet_proto::pb;

pub use kernels::{compile as compile_kernel_file, nvrtc_version, KernelFile, FILES as KERNEL_FILES};
pub use budget::{set_kv_budget, set_memory_budget, usable_bytes, WORKSPACE_BYTES};
pub use gpu_experts::{room as expert_room, set_expert_slots, set_streamed_expert_rows};
pub use probe::{probe, Gpu};

use self::gpu_experts::GpuExperts;
use self::launch::{Acts, GpuWeight, Launcher, WORKSPACE_ELEMS};
use self::mirror::{KvMirror, MirrorItem, Timed};
use self::phases::{Phase, Phases};
use duet_kernels::attention::windowed;
use super::model::{check_batch, check_hidden, Ffn, ModelTensors};
use super::expert_usage::RoutedTokens;
use super::host_experts::HostExperts;
use super::{host_attention, Device, DeviceCopy, DecodeItem, KvSink, KvUploadTime, KvSource, KvStore, Partial, PrefillItem, Qkv, RemoteExperts};
use crate::error::{Result, GpuWorkerError};

pub use crate::error::CudaError;

/// The most K/V rows' bytes the whole-layer path keeps on the GPU before storing them into the
/// caller's KV (twice this at the moment they come down, within `budget`'s activation reserve): a
/// decode step of 64 rows of the 8B shape defers its 32 layers' 16 MiB whole, a 512-row
/// prefill chunk of the 1B shape comes down every 8 layers.
const DEFERRED_KV_BYTES: usize = 16 << 20;

/// The longest prompt slice of one forward pass on the CUDA device (as the CPU's: the
/// gateway's scheduling and the runner's chunks stay the same across devices).
pub const PREFILL_CHUNK: usize = 512;

/// What the CUDA device implements of [`ModelTensors::extensions`]: Q/K/V biases, Q/K norms (one weight
/// per head, or one as wide as the row), NeoX RoPE, and mixtures of experts (the router on
/// the GPU, the routed experts on the host: [`HostExperts`]).
const IMPLEMENTED: [&str; 4] = ["Q/K/V biases", "Q/K RMSNorm", "NeoX RoPE", "mixture-of-experts MLPs"];

struct GpuLayer {
    attn_norm: CudaSlice<f32>,
    wq: GpuWeight,
    wk: GpuWeight,
    wv: GpuWeight,
    wo: GpuWeight,
    /// Q/K/V biases, added after the projections (Qwen 2).
    qkv_bias: Option<[CudaSlice<f32>; 3]>,
    /// RMSNorm weights of Q and K, before RoPE (Qwen 3, OLMoE).
    qk_norm: Option<[CudaSlice<f32>; 2]>,
    ffn_norm: CudaSlice<f32>,
    ffn: GpuFfn,
}

/// A layer's MLP on the GPU.
enum GpuFfn {
    Dense { gate: GpuWeight, up: GpuWeight, down: GpuWeight },
    /// The router; the experts are the device's [`HostExperts`] or the cpu-workers'.
    Moe { router: GpuWeight },
}

impl GpuFfn {
    fn weights(&self) -> Vec<&GpuWeight> {
        match self {
            GpuFfn::Dense { gate, up, down } => vec![gate, up, down],
            GpuFfn::Moe { router } => vec![router],
        }
    }
}

/// The CUDA device: the model's weights on one GPU.
pub struct CudaDevice {
    gpu: Gpu,
    k: Launcher,
    m: ModelTensors,
    token_embd: GpuWeight,
    /// The LM head; `None` when the file ties it to the embedding.
    output: Option<GpuWeight>,
    /// `None` when the device holds only the first layers (no LM head).
    output_norm: Option<CudaSlice<f32>>,
    /// Layers `0..layers.len()`: all, or the first of a model split with the CPU device.
    layers: Vec<GpuLayer>,
    /// A mixture's routed experts held on the host (all, or none when the cpu-workers serve
    /// them).
    experts: Option<HostExperts>,
    /// A mixture's experts on the GPU: the hot ones it holds (with the cpu-workers serving
    /// the experts), and the ones a batch of many rows streams there.
    gpu_experts: Option<GpuExperts>,
    weight_bytes: usize,
    /// The KV mirror and the GPU's attention on it; `None`: attention on the host.
    mirror: Option<Mutex<KvMirror>>,
    /// Where the calls' time goes.
    phases: Phases,
    /// Events around the attention of each layer computed wholly on the device, since
    /// [`Device::take_attention_ns`] last took them (or the last batch started).
    attention_events: Mutex<Vec<Timed>>,
    /// K/V rows (of one layer each) the GPU wrote into the arenas in place.
    in_place_rows: AtomicU64,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice").field("gpu", &self.gpu.name).field("config", &self.m.config).finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Checks the model, compiles the kernels and uploads the weights to `gpu`: all of them,
    /// or with `first_layers` those of the first layers and the embedding (the rest of the
    /// model then runs on the CPU device, `super::split`). A mixture's routed experts stay
    /// on the host: the device maps and computes them there with `local_experts`, else the
    /// cpu-workers serve them (a batch of many rows streams them to the GPU).
    pub fn load(gpu: Gpu, file: Arc<GgufFile>, first_layers: Option<usize>, local_experts: bool) -> Result<Self> {
        let m = ModelTensors::load(&file)?;
        let n_layer = m.config.n_layer;
        let held = 0..first_layers.unwrap_or(n_layer).min(n_layer);
        if held.is_empty() {
            return Err(GpuWorkerError::InvalidRequest("no layer on the CUDA device (--gpu-layers 0 runs the model on the CPU device)".into()));
        }
        let missing: Vec<_> = m.extensions().into_iter().filter(|e| !IMPLEMENTED.contains(e)).collect();
        if !missing.is_empty() {
            return Err(GpuWorkerError::Model(duet_model::Error::UnsupportedModel(format!(
                "architecture {:?} on the CUDA device: its {} are not implemented there yet (use --device cpu)",
                m.config.arch,
                missing.join(", ")
            ))));
        }
        // The hot experts' slots count as the weights do: a plan of them must always fit.
        let gpu_experts = GpuExperts::new(file.clone(), m.experts.clone(), local_experts, held.len());
        let reserved = gpu_experts.as_ref().map_or(0, GpuExperts::reserved);
        let need = m.weight_bytes(&file, &held) + WORKSPACE_BYTES + reserved;
        if let Some(budget) = budget::memory_budget().filter(|&b| need > b) {
            return Err(CudaError::OverBudget { need, budget }.into());
        }
        let (free, _) = gpu.ctx.mem_get_info().map_err(CudaError::from)?;
        if need > free {
            return Err(CudaError::OutOfMemory { need, free, gpu: gpu.name.clone() }.into());
        }
        // One stream does all the work, so cudarc's per-buffer events are not needed.
        // SAFETY: no other stream of this context touches the device's buffers.
        unsafe { gpu.ctx.disable_event_tracking() };
        let stream = gpu.ctx.default_stream();
        let started = std::time::Instant::now();
        let k = Launcher::new(stream.clone(), kernels::Kernels::load(&gpu.ctx, gpu.arch)?, WORKSPACE_ELEMS)?;
        tracing::info!(ms = started.elapsed().as_millis() as u64, arch = gpu.arch, "CUDA kernels ready");
        let up = |w: &super::model::Weight| -> Result<GpuWeight> {
            let t = file.tensor(&w.name).map_err(|e| GpuWorkerError::Model(e.into()))?;
            Ok(GpuWeight::upload(&stream, w, w.bytes(t.data))?)
        };
        let vec_up = |v: &[f32]| -> Result<CudaSlice<f32>> { Ok(stream.clone_htod(v).map_err(CudaError::from)?) };
        let token_embd = up(&m.token_embd)?;
        let last = held.end == n_layer;
        let output = if m.output.name == m.token_embd.name || !last { None } else { Some(up(&m.output)?) };
        let mut layers = Vec::with_capacity(held.len());
        for (i, l) in m.layers[held.clone()].iter().enumerate() {
            let ffn = match &l.ffn {
                Ffn::Dense { gate, up: up_w, down } => GpuFfn::Dense { gate: up(gate)?, up: up(up_w)?, down: up(down)? },
                Ffn::Moe { router } => GpuFfn::Moe { router: up(router)? },
            };
            let qkv_bias = match &l.qkv_bias {
                Some([bq, bk, bv]) => Some([vec_up(bq)?, vec_up(bk)?, vec_up(bv)?]),
                None => None,
            };
            let qk_norm = match &l.qk_norm {
                Some([qn, kn]) => Some([vec_up(qn)?, vec_up(kn)?]),
                None => None,
            };
            layers.push(GpuLayer {
                attn_norm: vec_up(&l.attn_norm)?,
                wq: up(&l.wq)?,
                wk: up(&l.wk)?,
                wv: up(&l.wv)?,
                wo: up(&l.wo)?,
                qkv_bias,
                qk_norm,
                ffn_norm: vec_up(&l.ffn_norm)?,
                ffn,
            });
            if (i + 1) % held.len().div_ceil(4).max(1) == 0 {
                tracing::info!("uploading weights: layer {}/{}", i + 1, held.len());
            }
        }
        let output_norm = if last { Some(vec_up(&m.output_norm)?) } else { None };
        stream.synchronize().map_err(CudaError::from)?;
        let weight_bytes = token_embd.bytes()
            + output.as_ref().map_or(0, GpuWeight::bytes)
            + layers.iter().map(|l| [&l.wq, &l.wk, &l.wv, &l.wo].into_iter().chain(l.ffn.weights()).map(GpuWeight::bytes).sum::<usize>()).sum::<usize>();
        tracing::info!(gpu = %gpu.name, mib = weight_bytes >> 20, ms = started.elapsed().as_millis() as u64, "weights on the GPU");
        let experts = match m.experts.clone() {
            Some(t) => Some(HostExperts::load(file.clone(), &m.config, t, local_experts, &held, super::cpu::repack_default())?),
            None => None,
        };
        if reserved > 0 {
            tracing::info!(mib = reserved >> 20, "room for hot experts on the GPU");
        }
        let mirror = budget::mirror_within_budget(&gpu, &stream, &m.config, layers.len(), weight_bytes + WORKSPACE_BYTES, reserved)?;
        budget::keep_activation_memory(&gpu);
        Ok(CudaDevice {
            gpu,
            k,
            m,
            token_embd,
            output,
            output_norm,
            layers,
            experts,
            gpu_experts,
            weight_bytes,
            mirror,
            phases: Phases::default(),
            attention_events: Mutex::default(),
            in_place_rows: AtomicU64::new(0),
        })
    }

    /// The GPU's attention of `items` over the mirror: per item its output and per-head
    /// log-sum-exp, `None` where the mirror cannot hold the item's sequence (or there is no
    /// mirror, or `kv` names no sequences).
    fn mirror_attend(&self, layer: usize, qkv: &Qkv, items: &[MirrorItem], kv: &dyn KvSource) -> Result<Vec<Option<Partial>>> {
        match &self.mirror {
            Some(m) if !items.is_empty() => {
                let g = self.gpu_qkv(qkv)?;
                let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
                m.attend(&self.k, layer, &g.q, items, kv, &self.phases)
            }
            _ => Ok(vec![None; items.len()]),
        }
    }

    /// Bytes of GPU memory the weights take.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.k.stream
    }

    /// How many K/V rows (a row of one layer each) the GPU has written into arenas in place
    /// (`host_map`), where they would otherwise come down for the host to write.
    pub fn rows_written_in_place(&self) -> u64 {
        self.in_place_rows.load(Ordering::Relaxed)
    }

    /// Layer `l`'s weights, or why the device has none.
    fn layer(&self, l: usize) -> Result<&GpuLayer> {
        self.layers.get(l).ok_or_else(|| GpuWorkerError::InvalidRequest(format!("layer {l} is not on the CUDA device (it holds layers 0..{})", self.layers.len())))
    }

    /// A batch of hidden rows `x` at `positions`.
    fn batch(&self, n: usize, x: CudaSlice<f32>, positions: &[usize], logit_rows: &[usize]) -> Result<CudaBatch> {
        let tables: Vec<f32> = positions.iter().flat_map(|&p| self.m.rope.table(p)).flat_map(|(c, s)| [c, s]).collect();
        let tables = self.stream().clone_htod(&tables).map_err(CudaError::from)?;
        Ok(CudaBatch { n, x, tables, logit_rows: logit_rows.to_vec(), deferred_kv: Vec::new() })
    }

    fn download(&self, x: &CudaSlice<f32>) -> Result<Vec<f32>> {
        let v = self.stream().clone_dtoh(x).map_err(CudaError::from)?;
        self.stream().synchronize().map_err(CudaError::from)?;
        Ok(v)
    }

    /// The logits of the batch's logit rows, `[row][vocab]` on the GPU (`None`: no rows).
    fn gpu_logits(&self, b: &CudaBatch) -> Result<Option<CudaSlice<f32>>> {
        let c = &self.m.config;
        let Some(output_norm) = &self.output_norm else {
            return Err(GpuWorkerError::InvalidRequest(format!("logits from the CUDA device, which holds only layers 0..{}", self.layers.len())));
        };
        if b.logit_rows.is_empty() {
            return Ok(None);
        }
        let picked = self.k.gather_rows(&b.x, &b.logit_rows, c.n_embd)?;
        let normed = self.k.rms_norm(&picked, output_norm, b.logit_rows.len(), c.rms_eps)?;
        let head = self.output.as_ref().unwrap_or(&self.token_embd);
        Ok(Some(self.k.linear(head, &mut Acts::new(&normed, b.logit_rows.len(), c.n_embd))?))
    }
}

/// Each row of prefill `items` (with their sequences' identities) as an item of the mirror's
/// attention over its causal prefix, within the layer's sliding `window`, in row order.
fn prefill_rows<'a>(items: impl Iterator<Item = (&'a PrefillItem, u64)>, window: Option<usize>) -> Vec<MirrorItem> {
    items
        .flat_map(|(it, key)| (0..it.n).map(move |i| MirrorItem { row: it.row0 + i, range: windowed(0..it.start + i + 1, it.start + i + 1, window), seq: it.seq, key }))
        .collect()
}

/// A layer's queries, keys and values as the CUDA device computed them, on the GPU
/// ([`Qkv::on_device`]).
struct GpuQkv {
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
}

impl CudaDevice {
    /// `qkv`'s GPU copy: its own when this device made it, else `qkv` uploaded.
    fn gpu_qkv(&self, qkv: &Qkv) -> Result<Arc<GpuQkv>> {
        if let Some(g) = qkv.on_device.as_ref().and_then(|d| d.0.clone().downcast::<GpuQkv>().ok()) {
            return Ok(g);
        }
        let up = |x: &[f32]| self.stream().clone_htod(x).map_err(CudaError::from);
        Ok(Arc::new(GpuQkv { q: up(&qkv.q)?, k: up(&qkv.k)?, v: up(&qkv.v)? }))
    }

    /// Layer `l` up to attention, on the GPU: the rows' queries, keys and values.
    fn qkv_on_gpu(&self, l: usize, b: &mut CudaBatch) -> Result<GpuQkv> {
        let c = &self.m.config;
        let layer = self.layer(l)?;
        // The norm and, for the matrix-vector kernels, its Q8_1 units in one launch.
        let q8 = self.k.takes_q8(&layer.wq, b.n);
        let (xn, units) = self.k.norm_fused(&mut b.x, None, &layer.attn_norm, b.n, c.rms_eps, q8)?;
        let mut acts = Acts::with_q8(&xn, b.n, c.n_embd, units);
        let [mut q, mut k, mut v] = self.k.linear_group([&layer.wq, &layer.wk, &layer.wv], &mut acts)?;
        if let Some([bq, bk, bv]) = &layer.qkv_bias {
            self.k.add_bias(&mut q, bq)?;
            self.k.add_bias(&mut k, bk)?;
            self.k.add_bias(&mut v, bv)?;
        }
        if let Some([qn, kn]) = &layer.qk_norm {
            // Rows of the weight's width: each head, or the whole row (OLMoE).
            q = self.k.rms_norm(&q, qn, b.n * c.q_dim() / qn.len(), c.rms_eps)?;
            k = self.k.rms_norm(&k, kn, b.n * c.kv_dim() / kn.len(), c.rms_eps)?;
        }
        self.k.rope(&mut q, &mut k, &b.tables, b.n, c.n_head, c.n_kv_head, c.head_dim, c.n_rot, c.rope_neox)?;
        Ok(GpuQkv { q, k, v })
    }

    /// Layer `l` after attention, from the attention output `a` on the GPU.
    fn finish_on_gpu(&self, l: usize, b: &mut CudaBatch, a: &CudaSlice<f32>, remote: &mut dyn RemoteExperts) -> Result<()> {
        let c = &self.m.config;
        let layer = self.layer(l)?;
        let t = Instant::now();
        let o = self.k.linear(&layer.wo, &mut Acts::new(a, b.n, c.q_dim()))?;
        // The residual add, the norm and its Q8_1 units (for a dense MLP's matrix-vector
        // kernels) in one launch.
        let q8 = matches!(&layer.ffn, GpuFfn::Dense { gate, .. } if self.k.takes_q8(gate, b.n));
        let (xn, units) = self.k.norm_fused(&mut b.x, Some(&o), &layer.ffn_norm, b.n, c.rms_eps, q8)?;
        let mut acts = Acts::with_q8(&xn, b.n, c.n_embd, units);
        let down = match &layer.ffn {
            GpuFfn::Dense { gate, up, down } => self.k.silu_mlp(gate, up, down, &mut acts, c.n_ff)?,
            GpuFfn::Moe { router } => {
                // The router on the GPU; the normed rows and its logits cross to the host,
                // which routes them and runs the experts held there or on the cpu-workers, and
                // the mixture's rows come back; the hot experts the GPU holds (`--device-experts`)
                // then add their outputs here, on the rows routed to them. A batch of many rows
                // (a prompt's chunk) has the GPU compute every expert, uploading those it does
                // not hold (`gpu_experts::set_streamed_expert_rows`).
                let logits = self.download(&self.k.linear(router, &mut acts)?)?;
                let experts = self.experts.as_ref().expect("a mixture loads its host experts");
                let streamed = c.ffn_act == FfnAct::Silu && self.gpu_experts.as_ref().is_some_and(|g| g.streams(l, b.n));
                let on_gpu = |e: usize| streamed || self.gpu_experts.as_ref().is_some_and(|g| g.holds(l, e));
                let (y, routed) = experts.moe(l, logits, &self.download(&xn)?, remote, &on_gpu)?;
                let mut y = self.stream().clone_htod(&y).map_err(CudaError::from)?;
                if let Some(g) = self.gpu_experts.as_ref().filter(|_| !routed.is_empty()) {
                    g.add_outputs(&self.k, l, &xn, &routed, &mut y, streamed)?;
                }
                y
            }
        };
        self.k.add_assign(&mut b.x, &down)?;
        self.phases.add(Phase::FinishLaunch, t);
        Ok(())
    }

    /// [`Device::layer_on_device`]: Q/K/V computed and kept on the GPU, K/V into the mirror,
    /// attention on the mirror, its output straight into the rest of the layer. The layer's
    /// K/V stay on the GPU for `kv` until the batch's last layer here, where every layer's
    /// come down together ([`CudaDevice::store_deferred_kv`]): the step waits for the GPU
    /// once there, not once a layer. Declines, before computing anything, without a mirror
    /// or when the mirror cannot hold every sequence of the batch (storing what it deferred
    /// first, since the layer then goes the usual way).
    ///
    /// Deferring is sound because a step's callers put every layer of it on this path or
    /// none (whether they do depends on the step, not the layer) and nothing reads the new
    /// rows from `kv` during the step: no cpu-worker shares the step, and the mirror stores
    /// them from the GPU after a whole prefix (`KvMirror::fill_prefixes` first uploads what
    /// it lost of the earlier rows), so its attention finds every position it needs mirrored.
    fn layer_wholly(&self, l: usize, b: &mut CudaBatch, items: &[PrefillItem], kv: &mut dyn KvStore, remote: &mut dyn RemoteExperts) -> Result<bool> {
        let Some(mirror) = &self.mirror else { return Ok(false) };
        let Some(keys) = items.iter().map(|it| kv.seq_key(it.seq)).collect::<Option<Vec<u64>>>() else { return Ok(false) };
        let ends: Vec<(u64, usize)> = keys.iter().zip(items).map(|(&key, it)| (key, it.start + it.n)).collect();
        if !mirror.lock().unwrap_or_else(|p| p.into_inner()).reserve_all(&ends) {
            self.store_deferred_kv(b, &mut *kv)?;
            return Ok(false);
        }
        let c = &self.m.config;
        let t = Instant::now();
        let g = self.qkv_on_gpu(l, b)?;
        let t = self.phases.add(Phase::QkvLaunch, t);
        let window = c.window(l);
        let rows = prefill_rows(items.iter().zip(keys.iter().copied()), window);
        let prefixes: Vec<(u64, usize, usize)> = keys.iter().zip(items).map(|(&key, it)| (key, it.seq, it.start)).collect();
        // Whether this layer's K/V are in `kv` already.
        let mut stored = false;
        let out = {
            let mut m = mirror.lock().unwrap_or_else(|p| p.into_inner());
            // The new rows follow a whole prefix (uploaded where the mirror lost it), so the
            // attention's upload never reads this step's rows from `kv`, where they are not
            // yet; should a sequence not fit after all, they go to `kv` first.
            if !m.fill_prefixes(&self.k, l, &prefixes, &*kv)? {
                let copy = |x: &CudaSlice<f32>| x.try_clone().map_err(CudaError::from);
                b.deferred_kv.push((l, copy(&g.k)?, copy(&g.v)?));
                self.store_deferred_kv(b, &mut *kv)?;
                stored = true;
            }
            m.store(&self.k, l, &g.k, &g.v, &*kv)?;
            let out = m.attend_rows(&self.k, l, &g.q, &rows, &*kv)?;
            out.map(|(out, timed)| {
                self.attention_events.lock().unwrap_or_else(|p| p.into_inner()).push(timed);
                out
            })
        };
        self.phases.add(Phase::AttendPrepare, t);
        let GpuQkv { q, k, v } = g;
        if !stored {
            b.deferred_kv.push((l, k, v));
        }
        let out = match out {
            Some(out) => out,
            None => {
                // A sequence left the mirror after all (it cannot, having been reserved, but
                // the host attends it rather than fail): the K/V into `kv` now, and the
                // layer's attention on the host.
                self.store_deferred_kv(b, &mut *kv)?;
                let t = Instant::now();
                let q = self.download(&q)?;
                let mut out = vec![0f32; q.len()];
                host_attention::prefill(c, l, &q, items, &*kv, &mut out)?;
                self.phases.add(Phase::AttendHost, t);
                self.stream().clone_htod(&out).map_err(CudaError::from)?
            }
        };
        self.finish_on_gpu(l, b, &out, remote)?;
        let deferred: usize = b.deferred_kv.iter().map(|(_, k, v)| 4 * (k.len() + v.len())).sum();
        if l + 1 == self.layers.len() || deferred >= DEFERRED_KV_BYTES {
            self.store_deferred_kv(b, &mut *kv)?;
        }
        Ok(true)
    }

    /// The K/V rows [`CudaDevice::layer_wholly`] kept on the GPU, into `kv`: written by the
    /// GPU in place where `kv` lies in arenas it maps ([`host_map`]), else gathered into one
    /// buffer on the GPU and downloaded with one wait.
    fn store_deferred_kv(&self, b: &mut CudaBatch, kv: &mut dyn KvSink) -> Result<()> {
        let pending = std::mem::take(&mut b.deferred_kv);
        let Some(each) = pending.first().map(|(_, k, _)| k.len()) else { return Ok(()) };
        let t = Instant::now();
        let c = &self.m.config;
        let rows = each / c.kv_dim();
        if let Some(places) = (0..rows).map(|r| kv.in_place(r)).collect::<Option<Vec<_>>>() {
            host_map::store_in_place(&self.k, &pending, &places, c.n_kv_head, c.head_dim)?;
            self.in_place_rows.fetch_add((rows * pending.len()) as u64, Ordering::Relaxed);
            self.phases.add(Phase::StoreInPlace, t);
            return Ok(());
        }
        let s = self.stream();
        let mut all = self.k.alloc(2 * each * pending.len())?;
        for (i, (_, k, v)) in pending.iter().enumerate() {
            s.memcpy_dtod(k, &mut all.slice_mut(2 * i * each..(2 * i + 1) * each)).map_err(CudaError::from)?;
            s.memcpy_dtod(v, &mut all.slice_mut((2 * i + 1) * each..(2 * i + 2) * each)).map_err(CudaError::from)?;
        }
        let host = self.download(&all)?;
        let t = self.phases.add(Phase::QkvDownload, t);
        for ((l, _, _), kv_rows) in pending.iter().zip(host.chunks_exact(2 * each)) {
            let (k, v) = kv_rows.split_at(each);
            host_attention::store(&self.m.config, *l, k, v, &mut *kv)?;
        }
        self.phases.add(Phase::StoreArena, t);
        Ok(())
    }

    /// Fails where `b` still holds K/V rows for the caller's KV: a call that ends or leaves
    /// the whole-layer path without storing them would lose them.
    fn no_deferred_kv(b: &CudaBatch, what: &str) -> Result<()> {
        match b.deferred_kv.first() {
            None => Ok(()),
            Some((l, _, _)) => Err(GpuWorkerError::InvalidRequest(format!(
                "{what} while the K/V rows of layer {l} onwards are still on the GPU (a caller put only some of a step's layers wholly on the device)"
            ))),
        }
    }
}

/// A batch on its way through the CUDA device's layers: the hidden rows and the rows' RoPE
/// tables on the GPU, and the rows whose logits are wanted.
pub struct CudaBatch {
    n: usize,
    x: CudaSlice<f32>,
    tables: CudaSlice<f32>,
    logit_rows: Vec<usize>,
    /// Layers' K/V rows (`[row][kv_dim]` each) kept on the GPU until the last layer on the
    /// whole-layer path stores them ([`CudaDevice::layer_wholly`]).
    deferred_kv: Vec<(usize, CudaSlice<f32>, CudaSlice<f32>)>,
}

impl Device for CudaDevice {
    type Batch = CudaBatch;

    fn kind(&self) -> pb::DeviceKind {
        pb::DeviceKind::Cuda
    }

    fn describe(&self) -> String {
        format!("cuda ({}, sm_{}, {} MiB of weights)", self.gpu.name, self.gpu.arch, self.weight_bytes >> 20)
    }

    fn config(&self) -> &LlamaConfig {
        &self.m.config
    }

    fn prefill_chunk(&self) -> usize {
        PREFILL_CHUNK
    }

    /// The host holds them all, or the GPU does (every expert placed there: a step then needs
    /// no expert job and may run each layer wholly on the GPU).
    fn holds_all_experts(&self) -> bool {
        self.experts.as_ref().is_none_or(HostExperts::holds_all) || self.gpu_experts.as_ref().is_some_and(GpuExperts::holds_all)
    }

    fn take_expert_usage(&self) -> Vec<RoutedTokens> {
        self.experts.as_ref().map_or_else(Vec::new, HostExperts::take_usage)
    }

    /// Hot experts on the GPU: the plan's experts of the device's layers, uploaded within the
    /// room `--device-experts` reserved.
    fn place_experts(&mut self, held: &[Vec<usize>]) -> Result<usize> {
        let stream = self.stream().clone();
        let act = self.m.config.ffn_act;
        let placed = match &mut self.gpu_experts {
            Some(g) => g.place(&stream, act, held),
            None => return Err(GpuWorkerError::InvalidRequest("placing routed experts on the GPU needs a mixture with its experts on the cpu-workers, of types the GPU has kernels for".into())),
        };
        // What the pool holds for good changed (a failed placement may have freed some):
        // keep activations on top of the new amount.
        budget::keep_activation_memory(&self.gpu);
        placed
    }

    fn begin_step(&self, step: &[(u64, usize)]) {
        if let Some(m) = &self.mirror {
            m.lock().unwrap_or_else(|p| p.into_inner()).begin_step(step);
        }
    }

    fn release(&self, keys: &[u64]) {
        if let Some(m) = &self.mirror {
            m.lock().unwrap_or_else(|p| p.into_inner()).release(keys);
        }
    }

    fn start_batch(&self, tokens: &[u32], positions: &[usize], logit_rows: &[usize]) -> Result<CudaBatch> {
        check_batch(&self.m.config, tokens, positions, logit_rows)?;
        // Events of a batch nobody took them of (the runner's, a failed step's) go.
        self.attention_events.lock().unwrap_or_else(|p| p.into_inner()).clear();
        if let Some(m) = &self.mirror {
            m.lock().unwrap_or_else(|p| p.into_inner()).forget_upload_times();
        }
        let t = Instant::now();
        let n = tokens.len();
        let ids = self.stream().clone_htod(tokens).map_err(CudaError::from)?;
        let x = self.k.get_rows(&self.token_embd, &ids, n)?;
        let batch = self.batch(n, x, positions, logit_rows)?;
        self.phases.add(Phase::Embed, t);
        Ok(batch)
    }

    fn layers(&self) -> Range<usize> {
        0..self.layers.len()
    }

    fn phase_times(&self) -> Vec<(&'static str, u64)> {
        // The mirror's uploads (a position of one layer each) since the last call: a mirror
        // that drops what the next steps attend shows here (the H200's steps over the mirror
        // spent up to 480 ms a step in `attend_prepare`).
        if let Some(m) = &self.mirror {
            let rows = m.lock().unwrap_or_else(|p| p.into_inner()).take_uploaded();
            if rows > 0 {
                tracing::debug!(rows, "KV mirror: rows uploaded from the arenas");
            }
        }
        self.phases.take()
    }

    fn take_attention_ns(&self) -> Result<Option<u64>> {
        let events = std::mem::take(&mut *self.attention_events.lock().unwrap_or_else(|p| p.into_inner()));
        if events.is_empty() {
            return Ok(None);
        }
        Ok(Some(mirror::elapsed_ns(&events)?))
    }

    fn take_kv_upload_time(&self) -> Result<KvUploadTime> {
        match &self.mirror {
            Some(m) => Ok(m.lock().unwrap_or_else(|p| p.into_inner()).take_upload_time()?),
            None => Ok(KvUploadTime::default()),
        }
    }

    fn gpu_kv_positions(&self) -> usize {
        self.mirror.as_ref().map_or(0, |m| m.lock().unwrap_or_else(|p| p.into_inner()).capacity())
    }

    fn hidden(&self, b: &CudaBatch) -> Result<Vec<f32>> {
        Self::no_deferred_kv(b, "the hidden rows handed on")?;
        self.download(&b.x)
    }

    fn resume_batch(&self, hidden: Vec<f32>, positions: &[usize], logit_rows: &[usize]) -> Result<CudaBatch> {
        check_hidden(&self.m.config, &hidden, positions, logit_rows)?;
        let x = self.stream().clone_htod(&hidden).map_err(CudaError::from)?;
        self.batch(positions.len(), x, positions, logit_rows)
    }

    fn qkv(&self, l: usize, b: &mut CudaBatch) -> Result<Qkv> {
        Self::no_deferred_kv(b, "a layer the usual way")?;
        let t = Instant::now();
        let g = self.qkv_on_gpu(l, b)?;
        // The three copies with one wait; the GPU's own stay for the mirror and attention.
        let t = self.phases.add(Phase::QkvLaunch, t);
        let s = self.stream();
        let host = (s.clone_dtoh(&g.q), s.clone_dtoh(&g.k), s.clone_dtoh(&g.v));
        s.synchronize().map_err(CudaError::from)?;
        self.phases.add(Phase::QkvDownload, t);
        let on_device = Some(DeviceCopy(Arc::new(g)));
        Ok(Qkv { q: host.0.map_err(CudaError::from)?, k: host.1.map_err(CudaError::from)?, v: host.2.map_err(CudaError::from)?, on_device })
    }

    fn store_kv(&self, layer: usize, qkv: &Qkv, kv: &mut dyn KvSink) -> Result<()> {
        let t = Instant::now();
        host_attention::store(&self.m.config, layer, &qkv.k, &qkv.v, kv)?;
        let t = self.phases.add(Phase::StoreArena, t);
        if let Some(m) = &self.mirror {
            let g = self.gpu_qkv(qkv)?;
            let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
            m.store(&self.k, layer, &g.k, &g.v, kv)?;
            self.phases.add(Phase::StoreMirror, t);
        }
        Ok(())
    }

    /// On the GPU where the mirror holds the sequences (each row of a chunk an item over its
    /// causal prefix), else on the host.
    fn prefill_attention(&self, layer: usize, qkv: &Qkv, items: &[PrefillItem], kv: &dyn KvSource, out: &mut [f32]) -> Result<()> {
        let c = &self.m.config;
        let q_dim = c.q_dim();
        let window = c.window(layer);
        let keyed: Vec<(&PrefillItem, u64)> = items.iter().filter_map(|it| Some((it, kv.seq_key(it.seq)?))).collect();
        let rows = prefill_rows(keyed.iter().copied(), window);
        let done = self.mirror_attend(layer, qkv, &rows, kv)?;
        let mut on_gpu = std::collections::HashSet::new();
        for (row, result) in rows.iter().zip(done) {
            if let Some((o, _)) = result {
                out[row.row * q_dim..(row.row + 1) * q_dim].copy_from_slice(&o);
                on_gpu.insert(row.seq);
            }
        }
        let rest: Vec<PrefillItem> = items.iter().filter(|it| !on_gpu.contains(&it.seq)).cloned().collect();
        let t = Instant::now();
        host_attention::prefill(c, layer, &qkv.q, &rest, kv, out)?;
        self.phases.add(Phase::AttendHost, t);
        Ok(())
    }

    /// On the GPU where the mirror holds the sequences, else on the host.
    fn decode_attention(&self, layer: usize, qkv: &Qkv, items: &[DecodeItem], kv: &dyn KvSource) -> Result<Vec<Partial>> {
        let c = &self.m.config;
        let window = c.window(layer);
        let keys: Vec<Option<u64>> = items.iter().map(|it| kv.seq_key(it.seq)).collect();
        let (keyed, unkeyed): (Vec<usize>, Vec<usize>) = (0..items.len()).partition(|&i| keys[i].is_some());
        let gpu_items: Vec<MirrorItem> = keyed
            .iter()
            .filter_map(|&i| {
                let it = &items[i];
                Some(MirrorItem { row: it.row, range: windowed(it.range.clone(), it.n_ctx, window), seq: it.seq, key: keys[i]? })
            })
            .collect();
        let mut results: Vec<Option<Partial>> = vec![None; items.len()];
        for (&i, r) in keyed.iter().zip(self.mirror_attend(layer, qkv, &gpu_items, kv)?) {
            results[i] = r;
        }
        let host: Vec<usize> = keyed.into_iter().filter(|&i| results[i].is_none()).chain(unkeyed).collect();
        if !host.is_empty() {
            let t = Instant::now();
            let host_items: Vec<DecodeItem> = host.iter().map(|&i| items[i].clone()).collect();
            for (&i, r) in host.iter().zip(host_attention::decode(c, layer, &qkv.q, &host_items, kv)?) {
                results[i] = Some(r);
            }
            self.phases.add(Phase::AttendHost, t);
        }
        Ok(results.into_iter().map(|r| r.expect("every item attended")).collect())
    }

    fn finish_layer(&self, l: usize, b: &mut CudaBatch, attn: &[f32], remote: &mut dyn RemoteExperts) -> Result<()> {
        let t = Instant::now();
        let a = self.stream().clone_htod(attn).map_err(CudaError::from)?;
        self.phases.add(Phase::FinishUpload, t);
        self.finish_on_gpu(l, b, &a, remote)
    }

    /// Only with a KV mirror: without one no layer runs wholly on the GPU (`layer_wholly`),
    /// and pinning the arena would only cost time.
    unsafe fn map_host(&self, ptr: *mut u8, len: usize) -> Option<super::HostMapping> {
        self.mirror.as_ref()?;
        // SAFETY: the caller's promise, passed on.
        unsafe { host_map::map(&self.gpu.ctx, ptr, len) }
    }

    fn layer_on_device(&self, l: usize, b: &mut CudaBatch, items: &[PrefillItem], kv: &mut dyn KvStore, remote: &mut dyn RemoteExperts) -> Result<bool> {
        self.layer_wholly(l, b, items, kv, remote)
    }

    fn logits(&self, b: &CudaBatch) -> Result<Vec<f32>> {
        Self::no_deferred_kv(b, "logits")?;
        let t = Instant::now();
        let logits = match self.gpu_logits(b)? {
            Some(logits) => self.download(&logits)?,
            None => Vec::new(),
        };
        self.phases.add(Phase::Logits, t);
        Ok(logits)
    }

    /// The arg-max on the GPU: only the tokens come down.
    fn greedy_tokens(&self, b: &CudaBatch) -> Result<Option<Vec<u32>>> {
        Self::no_deferred_kv(b, "greedy tokens")?;
        let t = Instant::now();
        let Some(logits) = self.gpu_logits(b)? else { return Ok(Some(Vec::new())) };
        let ids = self.k.argmax_rows(&logits, b.logit_rows.len(), self.m.config.n_vocab)?;
        let ids = self.stream().clone_dtoh(&ids).map_err(CudaError::from)?;
        self.stream().synchronize().map_err(CudaError::from)?;
        self.phases.add(Phase::Logits, t);
        Ok(Some(ids))
    }
}
