//! The simulator's reports: one machine and workload as a table of policies, and the sweep
//! of T4, A10 and H100 (fp16 and int8 weights) as Markdown tables.

use serde::Serialize;

use super::machines::{GpuPreset, WeightDtype};
use super::{Capacity, Outcome, Policy, Setup, GIB};
use crate::args::SimulateArgs;

/// The planner's cost model at the report's batch, in seconds.
#[derive(Debug, Clone, Serialize)]
pub struct CostSummary {
    /// The linear layers of a step wholly on the GPU.
    pub linear_s: f64,
    /// What a cpu-worker's share adds to them: every layer's round trip to the host.
    pub round_trips_s: f64,
    pub gpu_attn_per_pos_s: f64,
    pub cpu_attn_per_pos_s: f64,
    pub cpu_fixed_s: f64,
}

/// Largest context (at the batch) or batch (at the context) each side's memory holds.
#[derive(Debug, Clone, Serialize)]
pub struct Largest {
    pub at: usize,
    pub gpu_only: usize,
    pub hybrid: usize,
}

/// One machine, model and workload.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub setup: Setup,
    pub capacity: Capacity,
    pub batch: usize,
    pub context: usize,
    pub cost: CostSummary,
    pub weights_problem: Option<String>,
    /// gpu, cpu, ratio:R, lp.
    pub policies: Vec<Outcome>,
    /// GPU-only at the largest batch (≤ `batch`) whose KV fits, when `batch` does not.
    pub gpu_at_fitting_batch: Option<Outcome>,
    /// No GPU at all (seed 000's "CPU decode"): tokens/s.
    pub no_gpu_tokens_per_s: f64,
    /// Largest context at `batch`.
    pub largest_context: Largest,
    /// Largest batch at `context`.
    pub largest_batch: Largest,
}

impl Report {
    pub fn new(setup: &Setup, batch: usize, context: usize, ratio: f64) -> Report {
        let batch = batch.max(1);
        let cost = setup.cost_model(batch, context);
        let local = cost.local_linear.unwrap_or((cost.linear_fixed, cost.linear_per_token));
        let policies: Vec<Outcome> = [Policy::Gpu, Policy::Cpu, Policy::Ratio(ratio), Policy::Lp].iter().map(|p| setup.evaluate(*p, batch, context)).collect();
        let (gpu_b, hybrid_b) = setup.largest_batch(context);
        let gpu_at_fitting_batch = (!policies[0].fits && gpu_b >= 1 && gpu_b < batch).then(|| setup.evaluate(Policy::Gpu, gpu_b, context));
        let (gpu_c, hybrid_c) = setup.largest_context(batch);
        Report {
            setup: setup.clone(),
            capacity: setup.capacity(),
            batch,
            context,
            cost: CostSummary {
                linear_s: local.0 + local.1 * batch as f64,
                round_trips_s: cost.linear_fixed + cost.linear_per_token * batch as f64 - (local.0 + local.1 * batch as f64),
                gpu_attn_per_pos_s: cost.gpu_attn_per_pos,
                cpu_attn_per_pos_s: cost.cpu_attn_per_pos[0],
                cpu_fixed_s: cost.cpu_fixed[0],
            },
            weights_problem: setup.weights_problem(),
            policies,
            gpu_at_fitting_batch,
            no_gpu_tokens_per_s: batch as f64 / setup.cpu_only_step_s(batch, context),
            largest_context: Largest { at: batch, gpu_only: gpu_c, hybrid: hybrid_c },
            largest_batch: Largest { at: context, gpu_only: gpu_b, hybrid: hybrid_b },
        }
    }

    fn gpu(&self) -> &Outcome {
        &self.policies[0]
    }

    fn lp(&self) -> &Outcome {
        &self.policies[3]
    }

    /// GPU-only throughput a server could really get: at this batch, else at the largest
    /// batch that fits; none when nothing fits.
    pub fn best_gpu_only(&self) -> Option<&Outcome> {
        if self.gpu().fits {
            Some(self.gpu())
        } else {
            self.gpu_at_fitting_batch.as_ref().filter(|o| o.fits)
        }
    }

    /// The text report.
    pub fn render(&self) -> String {
        let s = &self.setup;
        let c = &self.capacity;
        let a = &s.assumptions;
        let kvpp = s.kv_bytes_per_pos();
        let mut out = String::new();
        let mut line = |t: String| {
            out.push_str(&t);
            out.push('\n');
        };
        line(format!(
            "machine: {} ({:.1} GiB, {:.0} GB/s, {:.0} TFLOP/s fp16, host link {:.0} GB/s) + {} socket(s) x ({:.0} GB/s, {} cores, {:.0} GiB KV)",
            s.gpu.name,
            s.gpu.mem_bytes / GIB,
            s.gpu.bandwidth / 1e9,
            s.gpu.flops / 1e12,
            s.gpu.pcie / 1e9,
            s.cpu.sockets,
            s.cpu.socket_bandwidth / 1e9,
            s.cpu.cores,
            s.cpu.kv_bytes / GIB,
        ));
        line(format!(
            "model: {}, {} weights {:.1} GiB; KV {:.0} KiB per position (f16, all layers)",
            s.model.name,
            s.weights.name(),
            c.weight_bytes / GIB,
            kvpp / 1024.0
        ));
        line(format!(
            "GPU memory: {:.1} GiB usable ({:.0}%) - {:.1} GiB weights - {:.1} GiB workspace = {:.1} GiB KV ({} positions); host KV {:.0} GiB ({} positions)",
            c.gpu_usable_bytes / GIB,
            a.gpu_memory_utilization * 100.0,
            c.weight_bytes / GIB,
            c.workspace_bytes / GIB,
            c.gpu_kv_bytes / GIB,
            c.gpu_kv_blocks * a.block_size,
            s.cpu.kv_bytes * s.cpu.sockets as f64 / GIB,
            c.host_kv_blocks * a.block_size,
        ));
        line(format!(
            "workload: batch {} x context {} = {} KV positions ({:.1} GiB)",
            self.batch,
            self.context,
            self.batch * self.context,
            (self.batch * self.context) as f64 * kvpp / GIB
        ));
        line(format!(
            "cost model at this batch: linear {:.2} ms/step (+{:.2} ms of round trips to the host with a cpu-worker's share); attention per position: GPU {:.3} us, each cpu-worker {:.3} us; cpu-worker fixed {:.3} ms/step (sync + host link)",
            self.cost.linear_s * 1e3,
            self.cost.round_trips_s * 1e3,
            self.cost.gpu_attn_per_pos_s * 1e6,
            self.cost.cpu_attn_per_pos_s * 1e6,
            self.cost.cpu_fixed_s * 1e3,
        ));
        if let Some(p) = &self.weights_problem {
            line(format!("NOTE: {p}"));
        }
        line(String::new());
        line(format!(
            "{:<10} {:>5} {:>9} {:>9} {:>10} {:>13} | {:>11} {:>11}",
            "policy", "batch", "GPU share", "step ms", "tokens/s", "ms/token/seq", "overlap ms", "overlap t/s"
        ));
        let rows = self.policies.iter().chain(self.gpu_at_fitting_batch.iter());
        for o in rows {
            let (om, ot) = match (o.overlap_step_s, o.overlap_tokens_per_s) {
                (Some(m), Some(t)) => (format!("{:.2}", m * 1e3), format!("{t:.1}")),
                _ => ("-".into(), "-".into()),
            };
            let fit = match &o.why_not {
                None => "fits".to_string(),
                Some(w) => format!("does not fit: {w}"),
            };
            line(format!(
                "{:<10} {:>5} {:>8.1}% {:>9.2} {:>10.1} {:>13.2} | {:>11} {:>11}  {fit}",
                o.policy,
                o.batch,
                o.gpu_share * 100.0,
                o.step_s * 1e3,
                o.tokens_per_s,
                o.step_s * 1e3,
                om,
                ot
            ));
        }
        line(format!(
            "no GPU at all (weights and KV from host memory, seed 000's \"CPU decode\"): {:.1} tokens/s",
            self.no_gpu_tokens_per_s
        ));
        line(String::new());
        let max_ctx = s.model.max_context;
        line(format!(
            "largest context at batch {} that fits: gpu-only {}, hybrid {} (the model is trained for {max_ctx})",
            self.largest_context.at, self.largest_context.gpu_only, self.largest_context.hybrid
        ));
        line(format!(
            "largest batch at context {} that fits: gpu-only {}, hybrid {}",
            self.largest_batch.at, self.largest_batch.gpu_only, self.largest_batch.hybrid
        ));
        if let Some(best) = self.best_gpu_only() {
            line(format!(
                "lp vs the best gpu-only that fits (batch {}): {:+.0}% tokens/s; with overlap {}",
                best.batch,
                (self.lp().tokens_per_s / best.tokens_per_s - 1.0) * 100.0,
                self.lp().overlap_tokens_per_s.map_or("-".to_string(), |t| format!("{:+.0}%", (t / best.tokens_per_s - 1.0) * 100.0)),
            ));
        }
        line("per-token latency = step time: every running sequence gets one token per step. Overlap: two sub-batches (NEO/APEX), step ~ max(linear of both halves + GPU attention, CPU attention).".into());
        out.trim_end().to_string()
    }
}

/// The sweep: T4, A10 and H100 with fp16 and int8 weights, at the flags' batch and context
/// and at batch 1 with a 32K context (seed 000's point).
pub fn sweep(args: &SimulateArgs, setup: &dyn Fn(GpuPreset, WeightDtype) -> Setup) -> Vec<Report> {
    let mut workloads = vec![(args.batch, args.context)];
    if (args.batch, args.context) != (1, 32768) {
        workloads.push((1, 32768));
    }
    let mut out = Vec::new();
    for (batch, context) in workloads {
        for gpu in [GpuPreset::T4, GpuPreset::A10, GpuPreset::H100] {
            for weights in [WeightDtype::Fp16, WeightDtype::Int8] {
                out.push(Report::new(&setup(gpu, weights), batch, context, args.ratio));
            }
        }
    }
    out
}

fn tps(o: &Outcome) -> String {
    if o.tokens_per_s.is_nan() {
        "-".into()
    } else if o.fits {
        format!("{:.0}", o.tokens_per_s)
    } else {
        format!("{:.0}*", o.tokens_per_s)
    }
}

/// The sweep as Markdown tables, one per workload.
pub fn render_sweep(reports: &[Report], args: &SimulateArgs) -> String {
    let mut out = String::new();
    let first = &reports[0].setup;
    out.push_str(&format!(
        "{} on each GPU + {} socket(s) x ({:.0} GB/s, {} cores, {:.0} GiB KV); tokens/s (* = does not fit memory, predicted for reference); ratio = ratio:{}\n",
        first.model.name,
        first.cpu.sockets,
        first.cpu.socket_bandwidth / 1e9,
        first.cpu.cores,
        first.cpu.kv_bytes / GIB,
        args.ratio
    ));
    let mut last = None;
    for r in reports {
        if last != Some((r.batch, r.context)) {
            last = Some((r.batch, r.context));
            out.push_str(&format!("\nbatch {} x context {}:\n\n", r.batch, r.context));
            out.push_str("| GPU | weights | GPU KV positions | gpu | gpu at a batch that fits | cpu | ratio | lp | lp + overlap | lp vs gpu that fits | cpu / gpu speed | no GPU | max context @batch: gpu / hybrid | max batch @context: gpu / hybrid |\n");
            out.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        }
        let gpu_name = &r.setup.gpu.name;
        let w = r.setup.weights.name();
        if r.weights_problem.is_some() {
            out.push_str(&format!(
                "| {gpu_name} | {w} | weights {:.1} GiB > {:.1} GiB usable | - | - | - | - | - | - | - | - | {:.1} | 0 / 0 | 0 / 0 |\n",
                r.capacity.weight_bytes / GIB,
                r.capacity.gpu_usable_bytes / GIB,
                r.no_gpu_tokens_per_s,
            ));
            continue;
        }
        let [gpu, cpu, ratio, lp] = [&r.policies[0], &r.policies[1], &r.policies[2], &r.policies[3]];
        let at_fit = match &r.gpu_at_fitting_batch {
            Some(o) => format!("{} (batch {})", tps(o), o.batch),
            None if gpu.fits => "same".into(),
            None => "none fits".into(),
        };
        let overlap = lp.overlap_tokens_per_s.map_or("-".into(), |t| format!("{t:.0}"));
        let gain = match r.best_gpu_only() {
            Some(best) => {
                let g = format!("{:+.0}%", (lp.tokens_per_s / best.tokens_per_s - 1.0) * 100.0);
                match lp.overlap_tokens_per_s {
                    Some(t) => format!("{g} ({:+.0}% overlapped)", (t / best.tokens_per_s - 1.0) * 100.0),
                    None => g,
                }
            }
            None => "gpu-only cannot run".into(),
        };
        out.push_str(&format!(
            "| {gpu_name} | {w} | {} | {} | {at_fit} | {} | {} | {} | {overlap} | {gain} | {:.2} | {:.1} | {} / {} | {} / {} |\n",
            r.capacity.gpu_kv_blocks * r.setup.assumptions.block_size,
            tps(gpu),
            tps(cpu),
            tps(ratio),
            tps(lp),
            cpu.tokens_per_s / gpu.tokens_per_s,
            r.no_gpu_tokens_per_s,
            r.largest_context.gpu_only,
            r.largest_context.hybrid,
            r.largest_batch.gpu_only,
            r.largest_batch.hybrid,
        ));
    }
    out.trim_end().to_string()
}
