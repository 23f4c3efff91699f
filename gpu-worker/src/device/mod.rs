//! The devices a model runs on, behind one interface. [`Device`] is everything the executor
//! (worker mode) and the runner (single process) ask of a device, per batch and layer:
//!
//! 1. [`Device::start_batch`] embeds the batch's tokens (the hidden rows stay on the device);
//! 2. per layer, [`Device::qkv`] gives the rows' queries, keys and values (RoPE applied),
//!    [`Device::store_kv`] writes the new K/V rows into the KV slots the caller names (the
//!    cpu-workers' arenas, or the runner's own cache), [`Device::prefill_attention`] and
//!    [`Device::decode_attention`] compute the device's own share of attention over the KV
//!    the caller hands in (prefill chunks, and decode ranges whose partial results the
//!    caller merges by log-sum-exp with the cpu-workers'), and [`Device::finish_layer`]
//!    takes the merged attention output through the output projection and the MLP;
//! 3. [`Device::logits`] gives the logits of the rows that need them.
//!
//! Posting attention jobs to the cpu-workers, waiting for them and merging stay outside the
//! device (`worker::step_attention`); one layer loop (`crate::forward`) drives any device,
//! for the plain step and for two sub-batches whose layers interleave.
//!
//! Loading the weights is each device's own constructor (`CpuDevice::load`,
//! `CudaDevice::load`, both over the checked tensors of [`model`]), called by [`open`] for
//! the device `--device` picks; [`AnyDevice`] holds either, or a model split by layers between
//! either and the CPU device (`--gpu-layers`, [`split`]), so the runner, executor and service
//! are built once. The CPU device ([`cpu`]) runs everywhere; the CUDA device
//! ([`cuda`]) wherever its probe finds a usable GPU (the binary itself needs no CUDA to
//! build or start). `--device auto` picks CUDA when it can and says in one log line which
//! device it chose and why; `--device cuda` fails with the probe's reason.

mod any;
pub mod cpu;
pub mod cuda;
pub mod expert_usage;
mod host_attention;
pub mod host_experts;
pub mod model;
mod page_in;
pub mod split;

pub use any::{AnyBatch, AnyDevice};

use std::ops::Range;
use std::sync::Arc;

use duet_kernels::attention::{AttnShape, KvRun};
pub use duet_kernels::decode_batch::Partial;
use duet_model::config::LlamaConfig;
use duet_model::gguf::GgufFile;
use duet_proto::pb;

use crate::error::{Result, GpuWorkerError};

/// The device a `--device` flag asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DeviceChoice {
    /// CUDA where a usable GPU is found, else the CPU (saying why in the log).
    #[default]
    Auto,
    /// The CPU device (every machine).
    Cpu,
    /// The CUDA device; fails if it cannot be used.
    Cuda,
}

/// Where the model's weights go: the device `--device` names, and with `--gpu-layers` only
/// the first layers there and the rest on the CPU device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Placement {
    pub choice: DeviceChoice,
    /// Layers on the device (the rest on the CPU device); `None`: all of them.
    pub gpu_layers: Option<GpuLayers>,
}

/// How many of the first layers go on the GPU (`--gpu-layers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuLayers {
    /// This many.
    Count(usize),
    /// As many as the GPU memory the device may use holds (`auto`).
    Fit,
}

impl std::str::FromStr for GpuLayers {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(GpuLayers::Fit),
            n => n.parse().map(GpuLayers::Count).map_err(|_| format!("--gpu-layers takes a layer count or auto, got {n:?}")),
        }
    }
}

impl From<DeviceChoice> for Placement {
    fn from(choice: DeviceChoice) -> Self {
        Placement { choice, gpu_layers: None }
    }
}

/// Loads the model's weights where `placement` says. `auto` takes the GPU when the probe
/// finds one and the model loads onto it, else the CPU, logging which and why; a model that
/// cannot load at all fails either way. `--gpu-layers N` below the model's layer count puts
/// layers `N..` on the CPU device (`split`; `auto`: as many layers on the GPU as its memory
/// budget holds); with `--device cpu` both parts are CPU devices, which compute what one
/// does (a check of the hand-off; `auto` there means all), and with `auto` and no GPU the
/// whole model runs on one CPU device.
/// `local_experts`: whether the device holds a mixture's routed experts itself (else the
/// cpu-workers do, and the device loads none of them).
pub fn open(placement: impl Into<Placement>, file: Arc<GgufFile>, local_experts: bool) -> Result<AnyDevice> {
    let Placement { choice, gpu_layers } = placement.into();
    let n_layer = LlamaConfig::from_gguf(&file).map_err(GpuWorkerError::Model)?.n_layer;
    let repack = cpu::repack_default();
    let cpu_part = |file: &Arc<GgufFile>, layers: Range<usize>| cpu::CpuDevice::load_layers(file.clone(), repack, local_experts, layers);
    let with_tail = |head: AnyDevice, file: &Arc<GgufFile>| -> Result<AnyDevice> {
        let n = head.layers().end;
        let tail = cpu_part(file, n..n_layer)?;
        tracing::info!("layers 0..{n} on {}, layers {n}..{n_layer} on the CPU device (--gpu-layers {n})", head.describe());
        Ok(AnyDevice::Split(Box::new(split::SplitDevice::new(head, tail)?)))
    };
    let cpu = |file: Arc<GgufFile>| -> Result<AnyDevice> {
        match gpu_layers {
            Some(GpuLayers::Count(n)) if n > 0 && n < n_layer && choice == DeviceChoice::Cpu => with_tail(AnyDevice::Cpu(cpu_part(&file, 0..n)?), &file),
            _ => {
                if gpu_layers.is_some() && choice != DeviceChoice::Cpu {
                    tracing::info!("--gpu-layers without the GPU: every layer on the CPU device");
                }
                Ok(AnyDevice::Cpu(cpu_part(&file, 0..n_layer)?))
            }
        }
    };
    let cuda = |gpu: cuda::Gpu, file: Arc<GgufFile>| -> Result<AnyDevice> {
        let n = match gpu_layers {
            None => n_layer,
            Some(GpuLayers::Count(n)) => n.min(n_layer),
            Some(GpuLayers::Fit) => {
                let budget = cuda::usable_bytes(&gpu)?;
                let m = model::ModelTensors::load(&file)?;
                let experts = |n: usize| cuda::expert_room(m.experts.as_ref(), local_experts, n);
                let n = m.first_layers_within(&file, budget, cuda::WORKSPACE_BYTES, experts);
                let kept = experts(n);
                let with = if kept > 0 { format!(" beside {} MiB kept for hot experts (--device-experts)", kept >> 20) } else { String::new() };
                tracing::info!("--gpu-layers auto: {n} of {n_layer} layers fit in the {} MiB the device may use{with}", budget >> 20);
                n
            }
        };
        match n {
            0 => {
                tracing::info!("no layer on the GPU (--gpu-layers): every layer on the CPU device");
                Ok(AnyDevice::Cpu(cpu_part(&file, 0..n_layer)?))
            }
            n if n < n_layer => with_tail(AnyDevice::Cuda(cuda::CudaDevice::load(gpu, file.clone(), Some(n), local_experts)?), &file),
            _ => Ok(AnyDevice::Cuda(cuda::CudaDevice::load(gpu, file, None, local_experts)?)),
        }
    };
    match choice {
        DeviceChoice::Cpu => cpu(file),
        DeviceChoice::Cuda => {
            let gpu = cuda::probe(0).map_err(|why| GpuWorkerError::DeviceUnavailable { device: "cuda", why: format!("{why}; use --device cpu or auto") })?;
            cuda(gpu, file)
        }
        DeviceChoice::Auto => match cuda::probe(0) {
            Err(why) => {
                tracing::info!("device auto: the CPU device ({why})");
                cpu(file)
            }
            Ok(gpu) => {
                let name = gpu.name.clone();
                match cuda(gpu, file.clone()) {
                    Ok(d) => {
                        tracing::info!("device auto: the CUDA device on {name}");
                        Ok(d)
                    }
                    Err(GpuWorkerError::Cuda(e)) => {
                        tracing::warn!("device auto: the CPU device (the model did not load onto {name}: {e})");
                        cpu(file)
                    }
                    Err(e) => Err(e),
                }
            }
        },
    }
}

/// The attention heads of a model: the rows of Q and of the attention output are
/// `n_head · head_dim` wide, those of K and V `n_kv_head · head_dim`.
pub fn attn_shape(c: &LlamaConfig) -> AttnShape {
    AttnShape { n_head: c.n_head, n_kv_head: c.n_kv_head, head_dim: c.head_dim, softcap: c.attn_logit_softcap }
}

/// A batch's queries, keys and values for one layer, RoPE applied, on the host:
/// `q` is `[row][n_head][head_dim]`, `k` and `v` are `[row][n_kv_head][head_dim]`; and the
/// device's own copies, if it keeps them (the CUDA device's on the GPU, which its KV mirror
/// and attention then read without uploading them again).
#[derive(Debug, Clone, Default)]
pub struct Qkv {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub on_device: Option<DeviceCopy>,
}

/// A device's own copy of a [`Qkv`], opaque to the callers.
#[derive(Clone)]
pub struct DeviceCopy(pub Arc<dyn std::any::Any + Send + Sync>);

impl std::fmt::Debug for DeviceCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceCopy")
    }
}

/// Where a batch's new K/V rows go (the slots the gateway allocated in the cpu-workers'
/// arenas, or the runner's own cache), addressed by layer and batch row.
pub trait KvSink {
    /// Stores one row's K and V (`[n_kv_head][head_dim]` each, rounded to the cache's f16).
    fn write(&mut self, layer: usize, row: usize, k: &[f32], v: &[f32]) -> Result<(), KvAccessError>;
    /// Stores a batch's rows of `layer` (`k`, `v`: `[row][kv_dim]`, row r batch row r):
    /// [`KvSink::write`] for each in turn, unless the sink stores them otherwise (the arenas:
    /// in parallel, each row's slots its own).
    fn write_rows(&mut self, layer: usize, kv_dim: usize, k: &[f32], v: &[f32]) -> Result<(), KvAccessError> {
        for (row, (k, v)) in k.chunks_exact(kv_dim).zip(v.chunks_exact(kv_dim)).enumerate() {
            self.write(layer, row, k, v)?;
        }
        Ok(())
    }
    /// Where batch row `row`'s K and V lie in host memory the device mapped
    /// ([`Device::map_host`]), for a device that stores them there itself, as
    /// [`KvSink::write`] would; `None` (the default): only through [`KvSink::write`].
    fn in_place(&self, _row: usize) -> Option<InPlaceRow> {
        None
    }
    /// Which sequence (its [`KvSource::seq_key`]) and position batch row `row` is, for a
    /// device that keeps a copy of the KV of its own (the CUDA device's GPU mirror); `None`
    /// where the caller's KV has no identity that outlives the call.
    fn position_of(&self, _row: usize) -> Option<(u64, usize)> {
        None
    }
}

/// A batch row's slot in a KV arena the device maps ([`Device::map_host`]): `addr` is, as
/// the device addresses it, the row's place in the arena's first run (layer 0, K, KV head
/// 0); the runs of every layer, K and V and KV head follow each other `stride` bytes apart,
/// in the arena's `[layer][K, V][kv_head]` order (`duet_kv::ArenaLayout`); `q8`: the arena
/// holds Q8_0 blocks, else f16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InPlaceRow {
    pub addr: u64,
    pub stride: u64,
    pub q8: bool,
}

/// Host memory a device writes in place ([`Device::map_host`]): `addr` is its start as the
/// device addresses it; dropping the mapping ends it (before the memory may be unmapped).
pub struct HostMapping {
    pub addr: u64,
    _release: Box<dyn std::any::Any + Send + Sync>,
}

impl HostMapping {
    /// A mapping at device address `addr` that `release` ends when dropped.
    pub fn new(addr: u64, release: impl std::any::Any + Send + Sync) -> Self {
        HostMapping { addr, _release: Box::new(release) }
    }
}

impl std::fmt::Debug for HostMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostMapping({:#x})", self.addr)
    }
}

/// The KV a device attends over, addressed by the caller's sequence index.
pub trait KvSource {
    /// The f16 K/V rows of positions `range` of sequence `seq`'s context for one KV head of
    /// `layer`, in place, in position order (one run per block of a paged cache).
    fn runs(&self, seq: usize, layer: usize, kv_head: usize, range: Range<usize>) -> Result<Vec<KvRun<'_>>, KvAccessError>;
    /// An identity of sequence `seq` that outlives the call (the gateway's sequence id), under
    /// which a device may keep a copy of its KV: every later change of its positions reaches
    /// the device through [`KvSink::write`] under the same identity. `None`: no such identity.
    fn seq_key(&self, _seq: usize) -> Option<u64> {
        None
    }
    /// Where position `pos` of sequence `seq` lies in an arena the device maps
    /// ([`Device::map_host`]), as [`KvSink::in_place`] says it of a batch row: a device with a
    /// KV copy of its own reads what it lacks from there. `None`: not in mapped memory.
    fn in_place_at(&self, _seq: usize, _pos: usize) -> Option<InPlaceRow> {
        None
    }
}

/// A step's KV seen both ways: where the new rows go and what is attended.
pub trait KvStore: KvSink + KvSource {}

impl<T: KvSink + KvSource> KvStore for T {}

/// The time a device spent bringing rows into its own KV copy ([`Device::take_kv_upload_time`]),
/// in nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvUploadTime {
    /// All of it.
    pub total_ns: u64,
    /// The part spent inside [`Device::decode_attention`] and [`Device::prefill_attention`]
    /// calls, which the executor times on the host as the device's attention; the rest came
    /// in layers the device computed wholly ([`Device::layer_on_device`]), where it falls in
    /// the linear layers' remainder.
    pub in_attention_calls_ns: u64,
}

pub use crate::error::KvAccessError;
pub use duet_kv::shm::expert_job::ExpertItem;

/// Where the routed experts a device does not hold are computed (the cpu-workers serving
/// expert jobs), for one MoE layer at a time: [`RemoteExperts::start`] hands the items over
/// so they run while the device computes its own experts, [`RemoteExperts::finish`] waits.
pub trait RemoteExperts {
    /// Starts `items` of `layer` over rows `x` (`[row][n_embd]`, the layer's normed rows).
    fn start(&mut self, layer: usize, x: &[f32], items: &[ExpertItem]) -> Result<()>;
    /// The started items' outputs times their weights, `[item][n_embd]`, in their order.
    fn finish(&mut self) -> Result<Vec<f32>>;
}

/// No experts elsewhere: a device that does not hold an expert it is routed to fails.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoRemoteExperts;

impl RemoteExperts for NoRemoteExperts {
    fn start(&mut self, layer: usize, _: &[f32], items: &[ExpertItem]) -> Result<()> {
        let expert = items.first().map_or(0, |i| i.expert);
        Err(GpuWorkerError::RemoteExperts { worker: None, what: format!("expert {expert} of layer {layer} is not on this device and no cpu-worker serves experts") })
    }

    fn finish(&mut self) -> Result<Vec<f32>> {
        Ok(Vec::new())
    }
}

/// Prefill attention of one sequence's rows `row0..row0 + n` (positions `start..start + n`),
/// each over its causal prefix of the sequence's context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillItem {
    pub seq: usize,
    pub row0: usize,
    pub n: usize,
    pub start: usize,
}

/// Decode attention of one batch row (a sequence's single new token) over positions `range`
/// of its context of `n_ctx` positions: the whole context, or the device's share of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeItem {
    pub seq: usize,
    pub row: usize,
    pub range: Range<usize>,
    pub n_ctx: usize,
}

/// What a device must do to run a Llama-family forward pass (see the module documentation
/// for the order of the calls). Rows are the batch's tokens in the order given to
/// [`Device::start_batch`]; every row is computed on its own in the linear layers, so a row's
/// result does not depend on the batch it rides in.
pub trait Device: Send + Sync {
    /// A batch on its way through the layers: its hidden rows and whatever else the device
    /// keeps per batch, where the device computes.
    type Batch: Send;

    /// The kind of device, as `Info` reports it.
    fn kind(&self) -> pb::DeviceKind;
    /// One line for logs and `Info`, e.g. "cpu (avx512)".
    fn describe(&self) -> String;
    /// The model's hyper-parameters.
    fn config(&self) -> &LlamaConfig;
    /// The longest prompt slice one forward pass takes: the runner chunks prompts by it and
    /// the gateway (told by `Info`) schedules prefill chunks of it, so both compute the same.
    fn prefill_chunk(&self) -> usize;

    /// The layers the device computes: all of them (the default), or its part of a model
    /// split across devices (`split`).
    fn layers(&self) -> Range<usize> {
        0..self.config().n_layer
    }

    /// How many of its layers run on the host's cores (all of a CPU device's).
    fn host_layers(&self) -> usize {
        if self.kind() == pb::DeviceKind::Cpu { self.layers().len() } else { 0 }
    }

    /// Where the device's time went since the last call, per phase of its calls, in
    /// nanoseconds (the CUDA device's; empty for the others).
    fn phase_times(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }

    /// GPU time of the device's own attention in the layers it computed wholly
    /// ([`Device::layer_on_device`]) since the last call, in nanoseconds, from events on the
    /// GPU (the CUDA device: those layers' attention runs between their linear layers with
    /// no wait for the host to time it by); `None` where there was none. Taken after the
    /// step's logits or greedy tokens, when the GPU has done the step; a batch started
    /// drops what was not taken.
    fn take_attention_ns(&self) -> Result<Option<u64>> {
        Ok(None)
    }

    /// Time the device spent since the last call filling its own KV copy with rows it lacked
    /// (the CUDA device's mirror: a sequence it trimmed or evicted, a share that grew; read
    /// by the GPU from the arenas it maps, timed by events, or uploaded by the host, timed by
    /// the host); zero where there was none. Taken when [`Device::take_attention_ns`] is; a
    /// batch started drops what was not taken. The executor reports it apart
    /// ([`pb::StepTimings::gpu_kv_upload_ns`]), so that the balancer's per-position attention
    /// cost does not take it in.
    fn take_kv_upload_time(&self) -> Result<KvUploadTime> {
        Ok(KvUploadTime::default())
    }

    /// Positions of KV the device keeps on the GPU for its own attention (the CUDA device's
    /// mirror; 0 where it attends on the host).
    fn gpu_kv_positions(&self) -> usize {
        0
    }

    /// A step begins: `step` names its sequences (by the key `KvSource::seq_key` gives) and
    /// how far the device may attend each (positions `0..end`; 0 where the cpu-workers attend
    /// it all). A device that keeps KV of its own (the CUDA device's mirror) makes room for
    /// the step there before its first layer and keeps it for the whole step.
    fn begin_step(&self, _step: &[(u64, usize)]) {}

    /// Sequences gone (the gateway released them, or a failed step lost them): a device
    /// that keeps KV of its own forgets theirs.
    fn release(&self, _keys: &[u64]) {}

    /// Checks a batch — `tokens[i]` at position `positions[i]` — and embeds its tokens;
    /// [`Device::logits`] will give the logits of `logit_rows`.
    fn start_batch(&self, tokens: &[u32], positions: &[usize], logit_rows: &[usize]) -> Result<Self::Batch>;
    /// The batch's hidden rows (`[row][n_embd]`) on the host, after the layers it has been
    /// through: what a split model hands to the device of its next layers.
    fn hidden(&self, batch: &Self::Batch) -> Result<Vec<f32>>;
    /// A batch that goes on from `hidden` (another device's [`Device::hidden`], rows at
    /// `positions`) through this device's layers, from the first it holds.
    fn resume_batch(&self, hidden: Vec<f32>, positions: &[usize], logit_rows: &[usize]) -> Result<Self::Batch>;
    /// Layer `layer` up to attention: the rows' queries, keys and values.
    fn qkv(&self, layer: usize, batch: &mut Self::Batch) -> Result<Qkv>;
    /// Stores the rows' new keys and values of `layer` (from `qkv`) where `kv` says.
    fn store_kv(&self, layer: usize, qkv: &Qkv, kv: &mut dyn KvSink) -> Result<()>;
    /// Prefill attention of `items` (rows of `qkv`'s queries) over their contexts in `kv`
    /// (their new rows stored already): writes their rows of `out` (`[row][n_head][head_dim]`,
    /// like `q`).
    fn prefill_attention(&self, layer: usize, qkv: &Qkv, items: &[PrefillItem], kv: &dyn KvSource, out: &mut [f32]) -> Result<()>;
    /// Decode attention of `items`, one row each, over their ranges in `kv`: each item's
    /// output (`[n_head][head_dim]`) and per-head log-sum-exp, for the caller to use whole or
    /// merge with other devices' partial results.
    fn decode_attention(&self, layer: usize, qkv: &Qkv, items: &[DecodeItem], kv: &dyn KvSource) -> Result<Vec<Partial>>;
    /// Maps `len` bytes of host memory at `ptr` (a cpu-worker's KV arena) for the device to
    /// store K/V rows into in place ([`KvSink::in_place`]; the CUDA device: registered with
    /// `cuMemHostRegister`); `None` where the device does not (the default) or the mapping
    /// failed (logged), and rows then reach the memory through [`KvSink::write`].
    ///
    /// # Safety
    /// The memory must stay mapped, and keep its pages, until the mapping is dropped.
    unsafe fn map_host(&self, _ptr: *mut u8, _len: usize) -> Option<HostMapping> {
        None
    }
    /// Layer `layer` wholly on the device, when no other device shares its attention: `items`
    /// are the batch's sequences in row order (a prefill chunk, or a decode token over its
    /// whole context), `kv` their KV. What [`Device::qkv`], [`Device::store_kv`], the
    /// attention calls and [`Device::finish_layer`] would do, without handing Q/K/V or the
    /// attention output over (the CUDA device: they stay on the GPU, K/V still go to `kv`).
    /// `false`, having done nothing, where the device does not (the default) or cannot.
    fn layer_on_device(&self, _layer: usize, _batch: &mut Self::Batch, _items: &[PrefillItem], _kv: &mut dyn KvStore, _remote: &mut dyn RemoteExperts) -> Result<bool> {
        Ok(false)
    }
    /// Layer `layer` after attention (`attn`, `[row][n_head][head_dim]`, merged): output
    /// projection, residual, MLP, residual. The routed experts of a mixture the device does
    /// not hold are computed by `remote`.
    fn finish_layer(&self, layer: usize, batch: &mut Self::Batch, attn: &[f32], remote: &mut dyn RemoteExperts) -> Result<()>;
    /// The logits of the batch's logit rows after the last layer, `[row][vocab]`.
    fn logits(&self, batch: &Self::Batch) -> Result<Vec<f32>>;
    /// The greedy token (the first arg-max, as `sampler::argmax`) of each logit row, where
    /// the device finds it without handing the logits over (the CUDA device: a 128K
    /// vocabulary's logits of 64 rows are 32 MiB to download); `None`: the caller samples
    /// from [`Device::logits`].
    fn greedy_tokens(&self, _batch: &Self::Batch) -> Result<Option<Vec<u32>>> {
        Ok(None)
    }
    /// Whether the device computes every routed expert of a mixture itself (true for a dense
    /// model), so that [`Device::finish_layer`] never calls its `remote`.
    fn holds_all_experts(&self) -> bool {
        true
    }
    /// The tokens routed to each expert of each layer since the last call (a mixture of
    /// experts; empty for a dense model), reset to zero.
    fn take_expert_usage(&self) -> Vec<expert_usage::RoutedTokens> {
        Vec::new()
    }
    /// Computes the experts `held[l]` of each layer `l` itself from now on, leaving the rest
    /// to the cpu-workers (a device that loaded a mixture with its experts remote); returns
    /// how many experts came or went.
    fn place_experts(&mut self, _held: &[Vec<usize>]) -> Result<usize> {
        Err(GpuWorkerError::InvalidRequest("this device does not place routed experts".into()))
    }
}
