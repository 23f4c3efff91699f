//! The simulator (`duet simulate`): derives the balancer's cost model analytically
//! for a machine we do not have (a GPU with one or more CPU sockets) and a model shape, then
//! replays the planner on a uniform decode batch and reports step time, tokens/s and the
//! largest context and batch each attention policy fits.
//!
//! Assumptions (all in [`Assumptions`], printed with `--json`):
//!
//! - Decode steady state only: every sequence of the batch has the same context and adds one
//!   token per step; prefill, admission and sampling differences are not modelled.
//! - GPU linear layers (all projections, MLP, LM head) per step:
//!   `overhead + max(weight bytes / (bandwidth · 0.8), 2 · params · batch / (FLOP/s · 0.6))`,
//!   overhead = 0.3 ms per step + 20 µs per layer (launches, norms, sampling). Weight-only
//!   quantisation streams fewer bytes but multiplies in fp16. Up to 8 rows (the CUDA device's
//!   `MV_PASS_ROWS`) the matrix-vector kernels read the quantised weights; from 9 to 64 rows
//!   (`MQ_TOK`), on GPUs of compute capability 8.0 and later, the `mmq_*` kernels multiply
//!   them on the integer tensor cores, each weight read once, priced by the same roofline (not
//!   yet measured on a GPU: see `Assumptions::mmq_max_rows`); otherwise a quantised weight
//!   is dequantised to f16 for cuBLAS on every step: its bytes read, and 2 bytes a parameter
//!   written and read again, at the same bandwidth.
//! - GPU attention per KV position = KV bytes per position / min(bandwidth · 0.8, 7 GB/s per
//!   multiprocessor): Duet's decode-attention kernel on the mirror as an H200 measured it; the GPU only
//!   attends KV in its own memory (the `gpu` policy's whole KV, or the mirrored prefix of
//!   `ratio`/`lp`); reading host memory over PCIe would be 10–50x slower and is never chosen.
//! - CPU attention per position and socket = max(KV bytes / (socket bandwidth · 0.8),
//!   4 · heads · head_dim · layers FLOPs / (cores · per-core FLOP/s)); a sequence's KV blocks
//!   alternate between the sockets' arenas (the KV pool fills the emptiest worker first).
//!   Contexts within one 2048-position chunk take ggml's exact two passes (what keeps Duet's
//!   logits llama.cpp's), which reach 0.5 of the bandwidth, not 0.8.
//! - Host link, which the planner's cost model has no term for: per decode token with CPU
//!   attention, q and the new K/V rows (f16) go to the host and the partial output and its
//!   log-sum-exp (f32) come back, every layer; the batch's bytes over the link bandwidth,
//!   plus 10 µs per layer of synchronisation (post, wake, wait), are added to each
//!   cpu-worker's fixed cost (`cpu_fixed`) — the link is shared, so each worker waits for
//!   all of it.
//! - Memory: GPU usable = memory · 0.9 (vLLM's default utilisation); GPU KV = usable −
//!   weights − workspace (0.5 GiB CUDA context + activations of a 2048-token step + logits
//!   of 256 rows); host KV = the per-socket arena allowance. KV is f16, in 16-token blocks.
//! - `lp`: the planner's LP, with the GPU allowed the prefix of each sequence that its spare
//!   memory can mirror (`gpu_max` = GPU KV / batch); `ratio:R` needs R of every context in
//!   that mirror to fit.
//! - Overlap column (NEO/APEX style): the batch is split into two sub-batches so the GPU runs
//!   one's linear layers while the CPUs attend the other's; the GPU then runs every layer
//!   twice per step (twice the weight reads when memory-bound), so
//!   `step ≈ max(linear(b/2) + linear(b/2) + gpu attention, cpu attention)`. It is replayed
//!   through the same planner by moving the linear time into the CPU side's fixed cost.

pub mod machines;
mod nodes;
mod report;

use serde::Serialize;

use duet_gateway::balancer::planner::{realise, solve, CostModel, Plan, SeqDemand};
use crate::args::SimulateArgs;
use machines::{CpuSpec, GpuPreset, GpuSpec, ModelShape, WeightDtype};

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The constants of the cost model (see the module documentation).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Assumptions {
    /// Fraction of peak GPU bandwidth that weight streaming reaches.
    pub gpu_bandwidth_fraction: f64,
    /// K/V bytes a second one multiprocessor reads in Duet's decode attention on the KV
    /// mirror (`attn_partial`), up to `gpu_bandwidth_fraction` of the GPU's bandwidth.
    /// Measured on an H200 (132 multiprocessors; 2026-11-28 evening, GPU-only steps served
    /// under a 16 GB cap, docs/cuda-device.md, "fourth run"): the Llama-3.2-1B shape's 57
    /// sessions at depth 8 192 read 15.3 GB of K/V in 13.1 ms (1.17 TB/s), 16 sessions 4.3 GB
    /// in 5.2 ms (0.83 TB/s); the Llama-3.1-8B shape's 10 at 8 192 10.8 GB in 11.9 ms
    /// (0.91 TB/s), 2 at 32 768 8.6 GB in 6.2 ms (1.40 TB/s). 7 GB/s a multiprocessor (0.92
    /// TB/s) puts those steps and the ones of 16–64 rows at depth 1 024 within −12..+19 %. An
    /// earlier run's 5.6 (20.6 ms for the 57 sessions) had the mirror evicting the step's own
    /// sequences; 80 % of the bandwidth, assumed first, put the attention of GPU-only steps at
    /// a fifth of its measured time. The kernel, not the memory, sets this
    /// (each thread reads its own K row), so it scales with the multiprocessors: a GPU with less
    /// bandwidth for each (a T4: 8 GB/s, against the H200's 36) loses less of it.
    pub gpu_attention_bytes_per_sm: f64,
    /// Fraction of peak fp16 tensor FLOP/s that the linear layers reach.
    pub gpu_flops_fraction: f64,
    /// The most rows a quantised weight multiplies without being dequantised (the CUDA
    /// device's `MV_PASS_ROWS`). Measured on the H200 (2026-11-28, the 1B shape): a step's
    /// linear layers 1.84 ms at one row, 3.23 at 16 and 3.63 at 64, the dequantisation's
    /// bytes (5.6 GB a step) at 80 % of the bandwidth being 1.5 ms.
    pub matvec_max_rows: usize,
    /// The most rows a quantised weight multiplies on the integer tensor cores (`mmq_*`, the
    /// CUDA device's `MQ_TOK`) on GPUs that have them ([`GpuSpec::int8_mma`]), without being
    /// dequantised. Priced as the matrix-vector rows are (the roofline: weights read once);
    /// the kernels have not yet run on a GPU, so the next GPU run checks this price (the
    /// `serve-bench-*-no-mmq` steps of `scripts/gpu-check-run.sh` time the cuBLAS path beside it).
    pub mmq_max_rows: usize,
    /// Fraction of GPU memory the server may use (vLLM's `gpu_memory_utilization`).
    pub gpu_memory_utilization: f64,
    /// CUDA context, cuBLAS workspace and allocator slack, bytes.
    pub gpu_context_bytes: f64,
    /// Tokens of the largest step whose activations the GPU reserves.
    pub workspace_step_tokens: usize,
    /// Rows of logits the GPU reserves (f32).
    pub workspace_logit_rows: usize,
    /// Per step on the GPU whatever the model: scheduling, sampling, plan upload, seconds.
    pub step_overhead_s: f64,
    /// Per layer and step on the GPU beyond streaming its weights, for a step run wholly on
    /// the GPU (kernel launches, norms, RoPE, the mirror's attention launches), seconds.
    /// Measured on an H200 (2026-11-27, afternoon): the Llama-3.2-1B shape's batch-1 step
    /// under the `gpu` policy spent 1.85 ms in its linear layers, 85 µs a layer beyond the
    /// step's and the weights' share (docs/cuda-device.md).
    pub layer_overhead_s: f64,
    /// Per layer and step when a cpu-worker shares the step's attention: the layer's round
    /// trip to the host (Q/K/V down, the attention output up), which a step wholly on the GPU
    /// does not make, seconds. The same run: 3.12 ms under the `cpu` policy, 80 µs a layer
    /// more (at stage A, where every step made it, a layer cost ~310 µs in all).
    pub layer_round_trip_s: f64,
    /// Fraction of a socket's peak bandwidth that attention reaches.
    pub cpu_bandwidth_fraction: f64,
    /// The same for contexts of at most `exact_attention_max_context` positions, which the
    /// CPU kernels attend with ggml's exact two passes (`duet_kernels::decode_batch::DECODE_CHUNK`).
    /// Measured on the H200's 16-core host (2026-11-28, the 1B shape at depth 1 024 under the
    /// `cpu` policy, docs/cuda-device.md): 0.46 of its 75 GB/s at 64 sessions, 0.51 at 16,
    /// where 8K and 32K reached 0.78–0.87; on the 2-core VM 0.56–0.64 against 0.74–0.89 for the
    /// one-pass kernel on the same job (docs/kernels.md).
    pub cpu_exact_bandwidth_fraction: f64,
    /// The longest context the exact two passes take.
    pub exact_attention_max_context: usize,
    /// Per layer and step with cpu-worker attention: post the job, wake, wait, seconds.
    pub layer_sync_s: f64,
    /// KV element size, bytes (f16).
    pub kv_dtype_bytes: f64,
    /// KV block size, tokens.
    pub block_size: usize,
}

impl Default for Assumptions {
    fn default() -> Self {
        Assumptions {
            gpu_bandwidth_fraction: 0.8,
            gpu_attention_bytes_per_sm: 7e9,
            gpu_flops_fraction: 0.6,
            matvec_max_rows: 8,
            mmq_max_rows: 64,
            gpu_memory_utilization: 0.9,
            gpu_context_bytes: 0.5 * GIB,
            workspace_step_tokens: 2048,
            workspace_logit_rows: 256,
            step_overhead_s: 0.3e-3,
            layer_overhead_s: 85e-6,
            layer_round_trip_s: 80e-6,
            cpu_bandwidth_fraction: 0.8,
            cpu_exact_bandwidth_fraction: 0.5,
            exact_attention_max_context: duet_kernels::decode_batch::DECODE_CHUNK,
            layer_sync_s: 10e-6,
            kv_dtype_bytes: 2.0,
            block_size: duet_kv::layout::DEFAULT_BLOCK_SIZE as usize,
        }
    }
}

/// A machine, a model and the assumptions: everything a cost model is derived from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Setup {
    pub gpu: GpuSpec,
    pub cpu: CpuSpec,
    pub model: ModelShape,
    pub weights: WeightDtype,
    pub assumptions: Assumptions,
}

/// Memory capacities of a setup.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Capacity {
    pub weight_bytes: f64,
    pub gpu_usable_bytes: f64,
    pub workspace_bytes: f64,
    /// Usable − weights − workspace; negative when the weights do not fit.
    pub gpu_kv_bytes: f64,
    pub gpu_kv_blocks: usize,
    pub host_kv_blocks: usize,
}

/// An attention policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// All attention on the GPU; the whole KV in GPU memory.
    Gpu,
    /// All decode attention on the cpu-workers holding the KV.
    Cpu,
    /// This fraction of each context (a prefix, mirrored in GPU memory) on the GPU.
    Ratio(f64),
    /// The planner's LP, the GPU limited to the prefix its spare memory mirrors.
    Lp,
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Policy::Gpu => f.write_str("gpu"),
            Policy::Cpu => f.write_str("cpu"),
            Policy::Ratio(r) => write!(f, "ratio:{r}"),
            Policy::Lp => f.write_str("lp"),
        }
    }
}

/// One policy's predicted decode step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    pub policy: String,
    pub batch: usize,
    /// Whether the batch's KV (and the weights) fit where the policy needs them.
    pub fits: bool,
    /// Why not, when it does not fit.
    pub why_not: Option<String>,
    /// Step time = per-token latency of every sequence, seconds.
    pub step_s: f64,
    pub tokens_per_s: f64,
    /// Share of the attended KV positions the GPU attends.
    pub gpu_share: f64,
    /// The same with two overlapped sub-batches (NEO/APEX style); none for `gpu` and batch 1.
    pub overlap_step_s: Option<f64>,
    pub overlap_tokens_per_s: Option<f64>,
}

fn blocks(n: usize, block_size: usize) -> usize {
    n.div_ceil(block_size)
}

impl Setup {
    pub fn kv_bytes_per_pos(&self) -> f64 {
        self.model.kv_bytes_per_pos(self.assumptions.kv_dtype_bytes)
    }

    pub fn capacity(&self) -> Capacity {
        let a = &self.assumptions;
        let m = &self.model;
        let weight_bytes = m.total_params() * self.weights.bytes_per_param();
        let gpu_usable_bytes = self.gpu.mem_bytes * a.gpu_memory_utilization;
        let activations = (a.workspace_step_tokens * (4 * m.hidden + 2 * m.ffn)) as f64 * 2.0;
        let logits = (a.workspace_logit_rows * m.vocab) as f64 * 4.0;
        let workspace_bytes = a.gpu_context_bytes + activations + logits;
        let gpu_kv_bytes = gpu_usable_bytes - weight_bytes - workspace_bytes;
        let block_bytes = self.kv_bytes_per_pos() * a.block_size as f64;
        let gpu_kv_blocks = (gpu_kv_bytes.max(0.0) / block_bytes).floor() as usize;
        let host_kv_blocks = (self.cpu.kv_bytes / block_bytes).floor() as usize * self.cpu.sockets as usize;
        Capacity { weight_bytes, gpu_usable_bytes, workspace_bytes, gpu_kv_bytes, gpu_kv_blocks, host_kv_blocks }
    }

    /// Why nothing can run, when the weights do not fit the GPU.
    pub fn weights_problem(&self) -> Option<String> {
        let c = self.capacity();
        (c.gpu_kv_bytes <= 0.0).then(|| {
            let hint = match self.weights {
                WeightDtype::Fp16 => "; try --weights int8 or int4",
                WeightDtype::Int8 => "; try --weights int4",
                WeightDtype::Int4 => "",
            };
            format!(
                "the {} weights of {} ({:.1} GiB) plus {:.1} GiB of workspace do not fit the {}'s {:.1} GiB usable memory: no policy can run{hint}",
                self.weights.name(),
                self.model.name,
                c.weight_bytes / GIB,
                c.workspace_bytes / GIB,
                self.gpu.name,
                c.gpu_usable_bytes / GIB,
            )
        })
    }

    /// The GPU's linear layers for one step of `tokens` tokens run wholly on the GPU
    /// (no cpu-worker sharing its attention), seconds.
    pub fn linear_s(&self, tokens: usize) -> f64 {
        let a = &self.assumptions;
        let m = &self.model;
        let overhead = a.step_overhead_s + a.layer_overhead_s * m.n_layer as f64;
        let memory = m.linear_params() * self.weights.bytes_per_param() / (self.gpu.bandwidth * a.gpu_bandwidth_fraction);
        let compute = 2.0 * m.linear_params() * tokens as f64 / (self.gpu.flops * a.gpu_flops_fraction);
        let on_quantised = tokens <= a.matvec_max_rows || (self.gpu.int8_mma && tokens <= a.mmq_max_rows);
        let dequantise = if self.weights != WeightDtype::Fp16 && !on_quantised {
            m.linear_params() * (self.weights.bytes_per_param() + 4.0) / (self.gpu.bandwidth * a.gpu_bandwidth_fraction)
        } else {
            0.0
        };
        overhead + memory.max(compute) + dequantise
    }

    /// The planner's cost model for a decode batch of `batch` sequences of `context`
    /// positions. The roofline of the linear layers is not linear in tokens, so the model is
    /// exact at this batch: the weight streaming is the fixed part and any compute beyond it
    /// the per-token part.
    pub fn cost_model(&self, batch: usize, context: usize) -> CostModel {
        let a = &self.assumptions;
        let m = &self.model;
        let batch = batch.max(1);
        let memory_bound = self.linear_s(0);
        let linear_per_token = (self.linear_s(batch) - memory_bound) / batch as f64;
        let kv = self.kv_bytes_per_pos();
        let gpu_attn_per_pos = kv / (self.gpu.bandwidth * a.gpu_bandwidth_fraction).min(self.gpu.sms as f64 * a.gpu_attention_bytes_per_sm);
        let exact = context <= a.exact_attention_max_context;
        let cpu_bw = self.cpu.socket_bandwidth * if exact { a.cpu_exact_bandwidth_fraction } else { a.cpu_bandwidth_fraction };
        let cpu_compute = self.cpu.cores as f64 * self.cpu.core_flops;
        let cpu_attn = (kv / cpu_bw).max(m.attn_flops_per_pos() / cpu_compute);
        let link = batch as f64 * m.host_link_bytes_per_token() / self.gpu.pcie;
        let cpu_fixed = a.layer_sync_s * m.n_layer as f64 + link;
        let n = self.cpu.sockets as usize;
        // A step a cpu-worker shares makes every layer's round trip to the host.
        let round_trip = a.layer_round_trip_s * m.n_layer as f64;
        CostModel {
            linear_fixed: memory_bound + round_trip,
            linear_per_token,
            gpu_attn_per_pos,
            cpu_fixed: vec![cpu_fixed; n],
            cpu_attn_per_pos: vec![cpu_attn; n],
            // Two sub-batches: the linear layers once per half (the weights read twice), each
            // with its round trips.
            overlapped_fixed: self.linear_s(batch / 2) + self.linear_s(batch - batch / 2) + 2.0 * round_trip,
            overlapped_per_token: 0.0,
            overlap_slowdown: 1.0,
            shared_cores: false,
            // A step wholly on the GPU.
            local_linear: Some((memory_bound, linear_per_token)),
        }
    }

    /// `batch` sequences of `context` positions, each one's blocks alternating between the
    /// cpu-workers in chunks (whole blocks, at most ~128 chunks a sequence), the GPU allowed
    /// the prefix `0..gpu_max`.
    fn demands(&self, batch: usize, context: usize, gpu_max: usize) -> Vec<SeqDemand> {
        let bs = self.assumptions.block_size;
        let chunk = bs * blocks(context, bs * 128).max(1);
        let n_workers = self.cpu.sockets.max(1);
        let held: Vec<_> = (0..context).step_by(chunk).enumerate().map(|(i, start)| ((i as u32) % n_workers, start..(start + chunk).min(context))).collect();
        vec![SeqDemand { n_ctx: context, held, gpu_max: gpu_max.min(context) }; batch]
    }

    /// The prefix of each sequence the GPU's spare memory can mirror, whole blocks.
    fn mirror_per_seq(&self, batch: usize) -> usize {
        (self.capacity().gpu_kv_blocks / batch.max(1)) * self.assumptions.block_size
    }

    /// Predicts one decode step of `batch` sequences of `context` positions under `policy`.
    pub fn evaluate(&self, policy: Policy, batch: usize, context: usize) -> Outcome {
        let bs = self.assumptions.block_size;
        let cap = self.capacity();
        let cost = self.cost_model(batch, context);
        let need = batch * blocks(context, bs);
        let kv_gib = |n_blocks: usize| n_blocks as f64 * bs as f64 * self.kv_bytes_per_pos() / GIB;
        let host_fits = need <= cap.host_kv_blocks;
        let host_why = format!("KV {:.1} GiB > host {:.1} GiB", kv_gib(need), kv_gib(cap.host_kv_blocks));
        let mirror = self.mirror_per_seq(batch);
        let (prefix, gpu_max, fits, why) = match policy {
            Policy::Gpu => {
                let fits = need <= cap.gpu_kv_blocks;
                (context, context, fits, format!("KV {:.1} GiB > GPU {:.1} GiB", kv_gib(need), kv_gib(cap.gpu_kv_blocks)))
            }
            Policy::Cpu => (0, 0, host_fits, host_why),
            Policy::Ratio(r) => {
                let p = (((r * context as f64) / bs as f64).round() as usize * bs).min(context);
                let gpu_need = batch * blocks(p, bs);
                let why = if host_fits { format!("GPU share {:.1} GiB > GPU {:.1} GiB", kv_gib(gpu_need), kv_gib(cap.gpu_kv_blocks)) } else { host_why };
                (p, p, host_fits && gpu_need <= cap.gpu_kv_blocks, why)
            }
            Policy::Lp => (0, mirror, host_fits, host_why),
        };
        let seqs = self.demands(batch, context, gpu_max);
        let lp = |overlap: bool| solve(&cost, batch, &seqs, bs, overlap).map_err(|e| e.to_string());
        let plan: Result<Plan, String> = match policy {
            Policy::Lp => lp(false),
            _ => Ok(realise(&cost, batch, &seqs, &vec![prefix; batch], false)),
        };
        let overlapped: Option<Result<Plan, String>> = (policy != Policy::Gpu && batch >= 2).then(|| match policy {
            Policy::Lp => lp(true),
            _ => Ok(realise(&cost, batch, &seqs, &vec![prefix; batch], true)),
        });
        let weights = self.weights_problem().map(|_| format!("weights {:.1} GiB > GPU", cap.weight_bytes / GIB));
        let (fits, why_not) = match (weights, fits) {
            (Some(w), _) => (false, Some(w)),
            (None, true) => (true, None),
            (None, false) => (false, Some(why)),
        };
        let tps = |s: f64| batch as f64 / s;
        match plan {
            Ok(plan) => {
                let total = plan.gpu_positions + plan.cpu_positions.iter().sum::<usize>();
                let over = overlapped.and_then(Result::ok).map(|p| p.predicted_s);
                Outcome {
                    policy: policy.to_string(),
                    batch,
                    fits,
                    why_not,
                    step_s: plan.predicted_s,
                    tokens_per_s: tps(plan.predicted_s),
                    gpu_share: if total == 0 { 0.0 } else { plan.gpu_positions as f64 / total as f64 },
                    overlap_step_s: over,
                    overlap_tokens_per_s: over.map(tps),
                }
            }
            Err(e) => Outcome {
                policy: policy.to_string(),
                batch,
                fits: false,
                why_not: Some(e),
                step_s: f64::NAN,
                tokens_per_s: f64::NAN,
                gpu_share: f64::NAN,
                overlap_step_s: None,
                overlap_tokens_per_s: None,
            },
        }
    }

    /// No GPU at all: weights and KV streamed from host memory by every socket (seed 000's
    /// "CPU decode", for comparison), seconds per step.
    pub fn cpu_only_step_s(&self, batch: usize, context: usize) -> f64 {
        let a = &self.assumptions;
        let m = &self.model;
        let sockets = self.cpu.sockets as f64;
        let bytes = m.linear_params() * self.weights.bytes_per_param() + (batch * context) as f64 * self.kv_bytes_per_pos();
        let bw = self.cpu.socket_bandwidth * a.cpu_bandwidth_fraction * sockets;
        let flops = 2.0 * m.linear_params() * batch as f64 + m.attn_flops_per_pos() * (batch * context) as f64;
        let compute = self.cpu.cores as f64 * self.cpu.core_flops * sockets;
        (bytes / bw).max(flops / compute) + a.step_overhead_s
    }

    /// Largest context (whole blocks) at `batch` that the GPU, and the host, hold.
    pub fn largest_context(&self, batch: usize) -> (usize, usize) {
        let c = self.capacity();
        let bs = self.assumptions.block_size;
        let b = batch.max(1);
        if self.weights_problem().is_some() {
            return (0, 0);
        }
        (c.gpu_kv_blocks / b * bs, c.host_kv_blocks / b * bs)
    }

    /// Largest batch at `context` that the GPU, and the host, hold.
    pub fn largest_batch(&self, context: usize) -> (usize, usize) {
        let c = self.capacity();
        let per_seq = blocks(context.max(1), self.assumptions.block_size);
        if self.weights_problem().is_some() {
            return (0, 0);
        }
        (c.gpu_kv_blocks / per_seq, c.host_kv_blocks / per_seq)
    }
}

/// Builds the setup the flags describe for `gpu` and `weights`.
fn setup(args: &SimulateArgs, gpu: GpuPreset, weights: WeightDtype) -> Setup {
    let mut g = gpu.spec();
    if let Some(v) = args.gpu_mem_gib {
        g.mem_bytes = v * GIB;
    }
    if let Some(v) = args.gpu_bandwidth_gbs {
        g.bandwidth = v * 1e9;
    }
    if let Some(v) = args.gpu_tflops {
        g.flops = v * 1e12;
    }
    if let Some(v) = args.pcie_gbs {
        g.pcie = v * 1e9;
    }
    Setup {
        gpu: g,
        cpu: CpuSpec::new(args.sockets, args.socket_bandwidth_gbs, args.cores, args.core_gflops, args.host_kv_gib),
        model: args.model.shape(),
        weights,
        assumptions: Assumptions::default(),
    }
}

fn check(args: &SimulateArgs) -> anyhow::Result<()> {
    let positive = [
        ("--socket-bandwidth-gbs", Some(args.socket_bandwidth_gbs)),
        ("--core-gflops", Some(args.core_gflops)),
        ("--host-kv-gib", Some(args.host_kv_gib)),
        ("--gpu-mem-gib", args.gpu_mem_gib),
        ("--gpu-bandwidth-gbs", args.gpu_bandwidth_gbs),
        ("--gpu-tflops", args.gpu_tflops),
        ("--pcie-gbs", args.pcie_gbs),
        ("--session-tokens-per-s", Some(args.session_tokens_per_s)),
    ];
    for (flag, v) in positive {
        if let Some(v) = v {
            anyhow::ensure!(v.is_finite() && v > 0.0, "{flag} must be a positive number, not {v}");
        }
    }
    anyhow::ensure!((0.0..=1.0).contains(&args.ratio), "--ratio must be within 0..1, not {}", args.ratio);
    anyhow::ensure!(args.cores > 0, "--cores must be at least 1");
    Ok(())
}

/// Runs `duet simulate`: prints the report (or the sweep) as text or JSON.
pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    check(&args)?;
    let text = if args.sweep {
        let reports = report::sweep(&args, &|gpu, weights| setup(&args, gpu, weights));
        if args.json {
            serde_json::to_string_pretty(&reports)?
        } else {
            report::render_sweep(&reports, &args)
        }
    } else if !args.nodes.is_empty() {
        let gpu = args.gpu.ok_or_else(|| anyhow::anyhow!("--gpu is required (or --sweep)"))?;
        let setup = setup(&args, gpu, args.weights);
        let rows = nodes::capacity_table(&setup, args.context, args.session_tokens_per_s, &args.nodes)?;
        if args.json {
            serde_json::to_string_pretty(&rows)?
        } else {
            nodes::render(&setup, args.context, args.session_tokens_per_s, &rows)
        }
    } else {
        let gpu = args.gpu.ok_or_else(|| anyhow::anyhow!("--gpu is required (or --sweep)"))?;
        let r = report::Report::new(&setup(&args, gpu, args.weights), args.batch, args.context, args.ratio);
        if args.json {
            serde_json::to_string_pretty(&r)?
        } else {
            r.render()
        }
    };
    println!("{text}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::machines::ModelPreset;
    use super::*;

    fn setup_of(gpu: GpuPreset, model: ModelPreset, weights: WeightDtype, sockets: u32) -> Setup {
        Setup {
            gpu: gpu.spec(),
            cpu: CpuSpec::new(sockets, 150.0, 32, 30.0, 96.0),
            model: model.shape(),
            weights,
            assumptions: Assumptions::default(),
        }
    }

    #[test]
    fn equal_gpu_and_cpu_costs_split_the_lp_in_half() {
        // A GPU whose bandwidth equals one socket's, no host-link or sync cost: the GPU and
        // the cpu-worker attend at the same speed, so the LP gives each half the positions.
        let mut s = setup_of(GpuPreset::A10, ModelPreset::Llama31_8b, WeightDtype::Int8, 1);
        s.gpu.bandwidth = 150e9;
        s.gpu.pcie = f64::INFINITY;
        s.assumptions.layer_sync_s = 0.0;
        s.assumptions.gpu_bandwidth_fraction = s.assumptions.cpu_bandwidth_fraction;
        s.assumptions.gpu_attention_bytes_per_sm = f64::INFINITY;
        s.gpu.mem_bytes = 1e12; // room to mirror every context
        let cost = s.cost_model(4, 4096);
        assert!((cost.gpu_attn_per_pos - cost.cpu_attn_per_pos[0]).abs() < 1e-15, "{cost:?}");
        let lp = s.evaluate(Policy::Lp, 4, 8192);
        assert!((lp.gpu_share - 0.5).abs() < 0.01, "{lp:?}");
        // And it is the best of the static splits.
        for p in [Policy::Gpu, Policy::Cpu, Policy::Ratio(0.25), Policy::Ratio(0.75)] {
            assert!(lp.step_s <= s.evaluate(p, 4, 8192).step_s + 1e-9, "{p}");
        }
        let half = s.evaluate(Policy::Ratio(0.5), 4, 8192);
        assert!((lp.step_s - half.step_s).abs() < 1e-6 * half.step_s, "{lp:?} vs {half:?}");
    }

    #[test]
    fn weights_larger_than_the_gpu_fit_nothing_with_a_clear_message() {
        let s = setup_of(GpuPreset::T4, ModelPreset::Llama31_8b, WeightDtype::Fp16, 2);
        let msg = s.weights_problem().expect("8B fp16 weights do not fit a T4");
        assert!(msg.contains("do not fit") && msg.contains("T4") && msg.contains("--weights int8"), "{msg}");
        for p in [Policy::Gpu, Policy::Cpu, Policy::Ratio(0.5), Policy::Lp] {
            let o = s.evaluate(p, 1, 1024);
            assert!(!o.fits && o.why_not.as_deref().unwrap_or("").contains("weights"), "{o:?}");
        }
        assert_eq!((s.largest_context(1), s.largest_batch(1024)), ((0, 0), (0, 0)));
        let report = report::Report::new(&s, 1, 1024, 0.5).render();
        assert!(report.contains("no policy can run"), "{report}");
        // int8 weights fit.
        let q = setup_of(GpuPreset::T4, ModelPreset::Llama31_8b, WeightDtype::Int8, 2);
        assert!(q.weights_problem().is_none());
        assert!(q.evaluate(Policy::Gpu, 1, 1024).fits);
    }

    #[test]
    fn a_bad_gpu_name_is_a_clap_error() {
        let err = crate::args::Cli::try_parse_from(["duet", "simulate", "--gpu", "v100"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::InvalidValue);
        let text = err.to_string();
        assert!(text.contains("v100") && text.contains("t4") && text.contains("h100"), "{text}");
        let err = crate::args::Cli::try_parse_from(["duet", "simulate"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
        assert!(crate::args::Cli::try_parse_from(["duet", "simulate", "--sweep"]).is_ok());
        assert!(crate::args::Cli::try_parse_from(["duet", "simulate", "--gpu", "a10", "--sockets", "1", "--model", "llama-2-7b", "--weights", "int4"]).is_ok());
    }

    #[test]
    fn linear_layers_are_memory_bound_at_batch_one_and_compute_bound_at_large_batches() {
        let s = setup_of(GpuPreset::A10, ModelPreset::Llama31_8b, WeightDtype::Fp16, 1);
        let m = &s.model;
        let overhead = 0.3e-3 + 32.0 * 85e-6;
        let weights = m.linear_params() * 2.0 / (600e9 * 0.8);
        assert!((s.linear_s(1) - overhead - weights).abs() < 1e-12);
        let big = 4096;
        let compute = 2.0 * m.linear_params() * big as f64 / (125e12 * 0.6);
        assert!(compute > weights);
        assert!((s.linear_s(big) - overhead - compute).abs() < 1e-12);
        // The cost model is exact at its batch: a step wholly on the GPU on its local line, one a
        // cpu-worker shares with every layer's round trip more.
        let c = s.cost_model(big, 4096);
        let (lf, lt) = c.local_linear.unwrap();
        assert!((lf + lt * big as f64 - s.linear_s(big)).abs() < 1e-12);
        assert!((c.linear_fixed + c.linear_per_token * big as f64 - s.linear_s(big) - 32.0 * 80e-6).abs() < 1e-12);
    }

    #[test]
    fn quantised_weights_are_dequantised_only_where_the_gpu_has_no_integer_kernel_for_the_rows() {
        let dequantise = |gpu: GpuPreset, rows: usize| {
            let s = setup_of(gpu, ModelPreset::Llama31_8b, WeightDtype::Int4, 1);
            let (m, a) = (&s.model, &s.assumptions);
            let bw = s.gpu.bandwidth * a.gpu_bandwidth_fraction;
            let overhead = a.step_overhead_s + a.layer_overhead_s * m.n_layer as f64;
            let bytes = s.weights.bytes_per_param();
            let roofline = (m.linear_params() * bytes / bw).max(2.0 * m.linear_params() * rows as f64 / (s.gpu.flops * a.gpu_flops_fraction));
            let extra = s.linear_s(rows) - overhead - roofline;
            assert!(extra.abs() < 1e-12 || (extra - m.linear_params() * (bytes + 4.0) / bw).abs() < 1e-12, "{gpu:?} {rows}: {extra}");
            extra > 0.0
        };
        // The matrix-vector kernels up to 8 rows everywhere; mmq up to 64 from sm_80 (A10,
        // H100), not on a T4; cuBLAS on dequantised weights beyond.
        for rows in [1, 8] {
            assert!(!dequantise(GpuPreset::T4, rows) && !dequantise(GpuPreset::A10, rows));
        }
        for rows in [9, 16, 64] {
            assert!(dequantise(GpuPreset::T4, rows));
            assert!(!dequantise(GpuPreset::A10, rows) && !dequantise(GpuPreset::H100Sxm, rows));
        }
        assert!(dequantise(GpuPreset::A10, 65) && dequantise(GpuPreset::H100Sxm, 512));
    }

    #[test]
    fn gpu_only_fits_exactly_up_to_its_kv_capacity() {
        let s = setup_of(GpuPreset::A10, ModelPreset::Llama31_8b, WeightDtype::Fp16, 2);
        let (gpu_ctx, host_ctx) = s.largest_context(8);
        assert!(gpu_ctx > 0 && host_ctx > 4 * gpu_ctx, "{gpu_ctx} {host_ctx}");
        assert!(s.evaluate(Policy::Gpu, 8, gpu_ctx).fits);
        assert!(!s.evaluate(Policy::Gpu, 8, gpu_ctx + 16).fits);
        assert!(s.evaluate(Policy::Lp, 8, host_ctx).fits);
        assert!(!s.evaluate(Policy::Cpu, 8, host_ctx + 16).fits);
        let (gpu_b, host_b) = s.largest_batch(4096);
        assert!(s.evaluate(Policy::Gpu, gpu_b, 4096).fits && !s.evaluate(Policy::Gpu, gpu_b + 1, 4096).fits);
        assert!(s.evaluate(Policy::Cpu, host_b, 4096).fits && !s.evaluate(Policy::Cpu, host_b + 1, 4096).fits);
    }

    #[test]
    fn contexts_within_one_chunk_attend_on_the_cpu_at_the_exact_passes_bandwidth() {
        let s = setup_of(GpuPreset::H100Sxm, ModelPreset::Llama32_1b, WeightDtype::Int4, 1);
        let a = &s.assumptions;
        let (short, long) = (s.cost_model(64, a.exact_attention_max_context), s.cost_model(64, a.exact_attention_max_context + 1));
        let ratio = short.cpu_attn_per_pos[0] / long.cpu_attn_per_pos[0];
        assert!((ratio - a.cpu_bandwidth_fraction / a.cpu_exact_bandwidth_fraction).abs() < 1e-9, "{ratio}");
        assert_eq!(short.gpu_attn_per_pos, long.gpu_attn_per_pos);
    }

    #[test]
    fn cpu_policy_step_is_linear_plus_the_cpu_side() {
        let s = setup_of(GpuPreset::T4, ModelPreset::Llama2_7b, WeightDtype::Int8, 2);
        let cost = s.cost_model(4, 2048);
        let o = s.evaluate(Policy::Cpu, 4, 2048);
        // Two sockets, each half of every sequence.
        let round_trip = s.assumptions.layer_round_trip_s * s.model.n_layer as f64;
        let expect = s.linear_s(4) + round_trip + cost.cpu_fixed[0] + cost.cpu_attn_per_pos[0] * (4 * 1024) as f64;
        assert!((o.step_s - expect).abs() < 1e-12, "{o:?} vs {expect}");
        assert_eq!(o.gpu_share, 0.0);
        // Overlap: max(two sub-batches' linear layers, the cpu side).
        let two = 2.0 * (s.linear_s(2) + round_trip);
        let over = two.max(cost.cpu_fixed[0] + cost.cpu_attn_per_pos[0] * 4096.0);
        assert!((o.overlap_step_s.unwrap() - over).abs() < 1e-12, "{o:?} vs {over}");
        assert!(s.evaluate(Policy::Gpu, 4, 2048).overlap_step_s.is_none());
        assert!(s.evaluate(Policy::Cpu, 1, 2048).overlap_step_s.is_none());
    }

    #[test]
    fn lp_uses_only_the_mirrored_prefix_and_beats_the_static_policies() {
        let s = setup_of(GpuPreset::A10, ModelPreset::Llama31_8b, WeightDtype::Fp16, 2);
        let (batch, context) = (32, 4096);
        let lp = s.evaluate(Policy::Lp, batch, context);
        let mirror = s.mirror_per_seq(batch) as f64 / context as f64;
        assert!(lp.gpu_share > 0.0 && lp.gpu_share <= mirror + 1e-9, "{lp:?} mirror {mirror}");
        assert!(lp.step_s <= s.evaluate(Policy::Cpu, batch, context).step_s);
        assert!(!s.evaluate(Policy::Ratio(0.5), batch, context).fits, "half of 32 x 4096 does not fit an A10");
    }

    #[test]
    fn the_host_link_cost_grows_with_the_batch() {
        let s = setup_of(GpuPreset::T4, ModelPreset::Llama31_8b, WeightDtype::Int4, 1);
        let per_token = s.model.host_link_bytes_per_token();
        // q 8 KiB + K,V 4 KiB (f16) + output 16 KiB + lse 128 B (f32), 32 layers.
        assert_eq!(per_token, 32.0 * (8192.0 + 4096.0 + 16384.0 + 128.0));
        let d = s.cost_model(64, 4096).cpu_fixed[0] - s.cost_model(1, 4096).cpu_fixed[0];
        assert!((d - 63.0 * per_token / 12e9).abs() < 1e-12);
    }
}
