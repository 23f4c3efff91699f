//! Runtime statistics: from every step's per-phase timings, the fits ([`super::fit`]) of each
//! cost the planner needs, and the planner's prediction error.

use std::collections::VecDeque;

use duet_proto::pb;

use super::fit::{BatchFit, LinearFit, FORGET, WARM};
use super::planner::CostModel;

/// Steps whose prediction errors are kept for the median and p90.
const ERROR_WINDOW: usize = 512;

/// What the planner predicted for a step: its time, and whether the fits it came from had
/// data then ([`StepStats::warm_for`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    pub seconds: f64,
    pub warm: bool,
}

/// The cost fits of one gateway: gpu-worker linear layers, its attention, and each
/// cpu-worker's attention; plus the planner's prediction errors.
#[derive(Debug, Clone)]
pub struct StepStats {
    /// Seconds vs batch tokens of decode-only steps a cpu-worker attends a share of:
    /// everything on the gpu-worker but attention and the wait.
    pub linear: BatchFit,
    /// The same for decode-only steps no cpu-worker takes part in (the CUDA device runs their
    /// layers wholly on the GPU: a cheaper line; [`CostModel::local_linear`]).
    pub linear_local: BatchFit,
    /// The same for steps with prompt chunks (their matrix products run as tiles, far
    /// cheaper per token than decode's: a decode line put a 2 048-row chunk of the 1B shape
    /// on an H200 at 4.3 s, against 0.5 measured). One line over all sizes, not bands: a
    /// band's flat line lent to a chunk of 2 rows put it at what 2 048 cost.
    pub linear_prefill: LinearFit,
    /// Seconds vs (row, attended position) pairs of the prompt chunks' causal attention on
    /// the gpu-worker: what grows with a chunk's depth (a 2 048-row chunk of the 1B shape at
    /// ~30K: 544 ms of attention against 20 ms of linear layers on the H200).
    pub prefill_attention: LinearFit,
    /// The same for decode steps run as two interleaved sub-batches.
    pub linear_overlapped: BatchFit,
    /// Seconds vs KV positions of the gpu-worker's decode attention (decode-only steps).
    pub gpu_attention: LinearFit,
    /// Per cpu-worker: seconds busy vs KV positions attended.
    pub cpu_attention: Vec<LinearFit>,
    /// |predicted − measured| / measured of recent steps.
    errors: VecDeque<f64>,
    /// Measured over predicted time of overlapped steps, exponentially weighted.
    overlap_slowdown: f64,
    /// Copied into every cost model.
    shared_cores: bool,
}

/// Priors before measurements: all devices alike, so that the first `lp` steps split
/// evenly and every fit gets data (seconds).
const PRIOR_LINEAR: (f64, f64) = (1e-3, 1e-4);
const PRIOR_ATTENTION: (f64, f64) = (0.0, 1e-7);
/// A pair of prefill attention costs far less than a decode position (tiles of rows share
/// each K/V read): a tenth of it until measured.
const PRIOR_PREFILL_ATTENTION: (f64, f64) = (0.0, 1e-8);

/// The (row, attended position) pairs of a prompt chunk of `n` rows from position `start`,
/// each attending its causal prefix: what its attention costs grow with.
pub fn prefill_pairs(start: usize, n: usize) -> u64 {
    let (start, n) = (start as u64, n as u64);
    n * start + n * (n + 1) / 2
}

impl StepStats {
    /// `shared_cores`: the gpu-worker computes on the cpu-workers' cores (see
    /// [`CostModel::shared_cores`]).
    pub fn new(n_workers: usize, shared_cores: bool) -> Self {
        StepStats {
            shared_cores,
            linear: BatchFit::new(PRIOR_LINEAR.0, PRIOR_LINEAR.1),
            linear_local: BatchFit::new(PRIOR_LINEAR.0, PRIOR_LINEAR.1),
            linear_prefill: LinearFit::new(PRIOR_LINEAR.0, PRIOR_LINEAR.1),
            prefill_attention: LinearFit::new(PRIOR_PREFILL_ATTENTION.0, PRIOR_PREFILL_ATTENTION.1),
            linear_overlapped: BatchFit::new(2.0 * PRIOR_LINEAR.0, PRIOR_LINEAR.1),
            gpu_attention: LinearFit::new(PRIOR_ATTENTION.0, PRIOR_ATTENTION.1),
            cpu_attention: vec![LinearFit::new(PRIOR_ATTENTION.0, PRIOR_ATTENTION.1); n_workers],
            errors: VecDeque::new(),
            overlap_slowdown: 1.0,
        }
    }

    /// The planner's view of the costs now, for a step of `tokens` batch tokens (the linear
    /// layers' line is the one of that batch size) whose prompt chunks attend `prefill_pairs`
    /// (row, position) pairs ([`prefill_pairs`]; 0 for a decode-only step). With prompt
    /// chunks the linear layers' line is the prefill steps' own, and their attention is part
    /// of the step's fixed cost: the decode shares of such a step are planned beside it.
    pub fn cost_model(&self, tokens: usize, prefill_pairs: u64) -> CostModel {
        let x = tokens as f64;
        // Each line from its own steps once it has seen this batch size, else from the
        // other's where that has (a step is a step until measured otherwise), or has seen
        // any batch size where this one has seen none (its prior knows nothing).
        let line = |own: &BatchFit, other: &BatchFit| {
            let borrow = (own.samples_at(x) < WARM && other.samples_at(x) >= WARM) || (!own.any_warm() && other.any_warm());
            if borrow { other.coefficients_at(x) } else { own.coefficients_at(x) }
        };
        let ((lf, lt), local) = if prefill_pairs > 0 {
            let (pf, pt) = self.linear_prefill.coefficients();
            ((pf + self.prefill_attention.predict(prefill_pairs as f64).max(0.0), pt), None)
        } else {
            (line(&self.linear, &self.linear_local), Some(line(&self.linear_local, &self.linear)))
        };
        let (_, ga) = self.gpu_attention.coefficients();
        let (cpu_fixed, mut cpu_attn_per_pos): (Vec<f64>, Vec<f64>) = self.cpu_attention.iter().map(LinearFit::coefficients).unzip();
        if self.shared_cores {
            // The same attention kernel on the same cores: a position costs a cpu-worker at
            // least what it costs the gpu-worker (on top of its fixed cost); a lower estimate is
            // the noise of two fits. Taken at face value it once sent a 4K-token decode to the
            // cpu-worker after an idle minute had doubled the gpu-worker's estimate: 6 -> 9.9 ms
            // a step.
            cpu_attn_per_pos.iter_mut().for_each(|c| *c = c.max(ga));
        }
        // Until overlapped steps have been measured: the fixed cost paid twice.
        let (of, ot) = if self.linear_overlapped.samples_at(x) >= WARM { self.linear_overlapped.coefficients_at(x) } else { (2.0 * lf, lt) };
        CostModel {
            linear_fixed: lf,
            linear_per_token: lt,
            gpu_attn_per_pos: ga,
            cpu_fixed,
            cpu_attn_per_pos,
            overlapped_fixed: of,
            overlapped_per_token: ot,
            overlap_slowdown: self.overlap_slowdown,
            shared_cores: self.shared_cores,
            local_linear: local,
        }
    }

    /// Whether a step planned now — `tokens` batch tokens, in two sub-batches if `overlap`,
    /// the gpu-worker attending `gpu_positions` and cpu-worker `i` `cpu_positions[i]` — is
    /// predicted by fits that have data: only such steps' errors count (the steady state).
    /// Judged when the step is planned, not when its timings come back: the scheduler keeps
    /// two steps in flight, so the step before it may not be folded in yet, and judged at
    /// the end the step that warmed a batch size's band counted with the borrowed line it
    /// was predicted by (errors of 16–20 % at the start of the 8B shape's batches of 63).
    /// A step with prompt chunks (`prefill_pairs` > 0) needs the prefill fits' data.
    pub fn warm_for(&self, tokens: usize, overlap: bool, gpu_positions: usize, cpu_positions: &[usize], prefill_pairs: u64) -> bool {
        let local = cpu_positions.iter().all(|&p| p == 0);
        let linear_warm = match (overlap, local) {
            _ if prefill_pairs > 0 => self.linear_prefill.samples() >= WARM && self.prefill_attention.samples() >= WARM,
            (true, _) => self.linear_overlapped.samples_at(tokens as f64) >= WARM,
            (_, true) => self.linear_local.samples_at(tokens as f64) >= WARM,
            _ => self.linear.samples_at(tokens as f64) >= WARM,
        };
        linear_warm
            && (gpu_positions == 0 || self.gpu_attention.samples() >= WARM)
            && cpu_positions.iter().enumerate().all(|(w, &p)| p == 0 || self.cpu_attention.get(w).is_none_or(|f| f.samples() >= WARM))
    }

    /// Folds a step's timings in, with what the planner predicted for it and the (row,
    /// position) pairs its prompt chunks attended.
    pub fn observe(&mut self, t: &pb::StepTimings, predicted: Option<Prediction>, prefill_pairs: u64) {
        let s = |ns: u64| ns as f64 * 1e-9;
        let tokens = (t.prefill_tokens + t.decode_tokens) as f64;
        let local = t.cpu_workers.iter().all(|w| w.positions == 0);
        let linear = s(t.linear_ns + t.kv_write_ns + t.merge_ns + t.sample_ns);
        if t.prefill_tokens > 0 {
            self.linear_prefill.add(tokens, linear);
            if prefill_pairs > 0 {
                // The gpu-worker's attention less what its decode rows' share took.
                let decode = if t.gpu_attention_positions > 0 { self.gpu_attention.predict(t.gpu_attention_positions as f64).max(0.0) } else { 0.0 };
                self.prefill_attention.add(prefill_pairs as f64, (s(t.attention_gpu_ns) - decode).max(0.0));
            }
        } else if t.sub_batches == 2 {
            self.linear_overlapped.add(tokens, linear);
        } else if local {
            self.linear_local.add(tokens, linear);
        } else {
            self.linear.add(tokens, linear);
        }
        if t.prefill_tokens == 0 && t.gpu_attention_positions > 0 {
            self.gpu_attention.add(t.gpu_attention_positions as f64, s(t.attention_gpu_ns));
        }
        // What a step pays for a cpu-worker's share is its jobs' latency as the gpu-worker
        // sees it: the worker's busy time plus the hand-over (posting, waking it, reading the
        // results back). When one worker ran unoverlapped decode jobs and the gpu-worker had
        // to wait for them, that latency is the gpu-worker's own share plus the wait; the
        // busy time alone would make small shares look free.
        let handover = t.prefill_tokens == 0 && t.sub_batches <= 1 && t.cpu_workers.len() == 1 && t.attention_wait_ns > 0;
        for w in &t.cpu_workers {
            if let Some(fit) = self.cpu_attention.get_mut(w.worker as usize) {
                if w.positions > 0 {
                    // (The gpu-worker's own share as it ran, its KV mirror's uploads included.)
                    let latency = if handover { w.busy_ns.max(t.attention_gpu_ns + t.gpu_kv_upload_ns + t.attention_wait_ns) } else { w.busy_ns };
                    fit.add(w.positions as f64, s(latency));
                }
            }
        }
        if let Some(Prediction { seconds: p, warm }) = predicted {
            let measured = s(t.total_ns);
            if t.sub_batches == 2 && p > 0.0 && measured > 0.0 {
                // `p` includes the slowdown it was predicted with: the ratio corrects it.
                let seen = (self.overlap_slowdown * measured / p).clamp(1.0, 2.0);
                self.overlap_slowdown = FORGET * self.overlap_slowdown + (1.0 - FORGET) * seen;
            }
            if warm && t.prefill_tokens == 0 && measured > 0.0 {
                if self.errors.len() == ERROR_WINDOW {
                    self.errors.pop_front();
                }
                self.errors.push_back((p - measured).abs() / measured);
            }
        }
    }

    /// Forgets the prediction errors (the fits stay): after a policy change.
    pub fn reset_errors(&mut self) {
        self.errors.clear();
    }

    /// Median and 90th percentile of the recent relative prediction errors.
    pub fn prediction_error(&self) -> Option<(f64, f64)> {
        if self.errors.is_empty() {
            return None;
        }
        let mut v: Vec<f64> = self.errors.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
        Some((q(0.5), q(0.9)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `seconds` predicted for the step `t` is, judged warm or not as the planner would
    /// have judged it just before (with every earlier step folded in).
    fn prediction(st: &StepStats, t: &pb::StepTimings, seconds: f64) -> Option<Prediction> {
        let mut cpu = Vec::new();
        for w in &t.cpu_workers {
            cpu.resize(cpu.len().max(w.worker as usize + 1), 0);
            cpu[w.worker as usize] = w.positions as usize;
        }
        let tokens = (t.prefill_tokens + t.decode_tokens) as usize;
        Some(Prediction { seconds, warm: st.warm_for(tokens, t.sub_batches == 2, t.gpu_attention_positions as usize, &cpu, 0) })
    }

    #[test]
    fn on_shared_cores_a_cpu_worker_position_costs_at_least_a_gpu_worker_one() {
        let timings = |gpu_positions: u64, gpu_ns: u64, cpu_positions: u64, cpu_ns: u64| pb::StepTimings {
            decode_tokens: 1,
            linear_ns: 1_000_000,
            gpu_attention_positions: gpu_positions,
            attention_gpu_ns: gpu_ns,
            cpu_workers: vec![pb::CpuWorkerTiming { worker: 0, positions: cpu_positions, busy_ns: cpu_ns, ..Default::default() }],
            ..Default::default()
        };
        for shared in [false, true] {
            let mut stats = StepStats::new(1, shared);
            // Measured: the cpu-worker at half the gpu-worker's cost per position.
            for i in 0..200u64 {
                let n = 1000 + 100 * (i % 10);
                stats.observe(&timings(n, 2000 * n, n, 1000 * n), None, 0);
            }
            let c = stats.cost_model(1, 0);
            assert!(c.gpu_attn_per_pos > 1.5e-6, "{c:?}");
            if shared {
                assert_eq!(c.cpu_attn_per_pos[0], c.gpu_attn_per_pos, "{c:?}");
            } else {
                assert!(c.cpu_attn_per_pos[0] < 0.7 * c.gpu_attn_per_pos, "side by side the measured costs stand: {c:?}");
            }
        }
    }

    #[test]
    fn steps_without_a_cpu_worker_learn_their_own_line() {
        // As the CUDA device on the H200 (1B shape, batch 1): 1.9 ms of linear layers for a
        // step wholly on the GPU, 3.3 ms when a cpu-worker attends a share.
        let step = |cpu_positions: u64, linear_s: f64| pb::StepTimings {
            decode_tokens: 1,
            linear_ns: (linear_s * 1e9) as u64,
            total_ns: (linear_s * 1e9) as u64 + 500_000,
            gpu_attention_positions: 1000,
            attention_gpu_ns: 500_000,
            cpu_workers: if cpu_positions > 0 {
                vec![pb::CpuWorkerTiming { worker: 0, positions: cpu_positions, busy_ns: 100_000, ..Default::default() }]
            } else {
                Vec::new()
            },
            ..Default::default()
        };
        let lines = |st: &StepStats| {
            let c = st.cost_model(1, 0);
            let (f, t) = c.local_linear.expect("the stats give a local line");
            (c.linear_fixed + c.linear_per_token, f + t)
        };
        let mut st = StepStats::new(1, false);
        // Local steps only: the split line borrows theirs.
        for _ in 0..20 {
            st.observe(&step(0, 0.0019), None, 0);
        }
        let (split, local) = lines(&st);
        assert!((local - 0.0019).abs() < 1e-6 && (split - local).abs() < 1e-12, "{split} {local}");
        // At a batch size neither has seen, the split line is the local one's too, not the prior.
        let c = st.cost_model(16, 0);
        assert_eq!(c.local_linear, Some((c.linear_fixed, c.linear_per_token)), "{c:?}");
        // Then steps with a share: each line its own.
        for _ in 0..20 {
            st.observe(&step(200, 0.0033), None, 0);
        }
        let (split, local) = lines(&st);
        assert!((local - 0.0019).abs() < 1e-6 && (split - 0.0033).abs() < 1e-6, "{split} {local}");
        // The step times it predicts: each on its line.
        let c = st.cost_model(1, 0);
        assert!((c.step_time(1, 1000, &[0], false) - (0.0019 + 1000.0 * c.gpu_attn_per_pos)).abs() < 1e-6);
        assert!(c.step_time(1, 800, &[200], false) > 0.0033);
    }

    #[test]
    fn steps_with_prompt_chunks_are_predicted_by_their_own_line_and_their_depth() {
        // As the 1B shape on the H200 (2026-11-29): a chunk's linear layers ~2 ms + 8 µs a
        // row; its attention 12 ns a (row, position) pair; a batch-1 decode step 2.4 ms.
        let (linear, attention) = (|rows: f64| 0.002 + 8e-6 * rows, |pairs: u64| 1.2e-8 * pairs as f64);
        let prefill = |start: usize, rows: usize| pb::StepTimings {
            prefill_tokens: rows as u32,
            linear_ns: (linear(rows as f64) * 1e9) as u64,
            attention_gpu_ns: (attention(prefill_pairs(start, rows)) * 1e9) as u64,
            ..Default::default()
        };
        let decode = pb::StepTimings { decode_tokens: 1, linear_ns: 2_400_000, gpu_attention_positions: 100, attention_gpu_ns: 10_000, ..Default::default() };
        let mut st = StepStats::new(1, false);
        // One lone prompt of 8K in chunks of 512, and 16 prompts of 8K in chunks of 2 048, with
        // decode steps between them.
        for (rows, prompts) in [(512, 1), (2048, 16)] {
            for _ in 0..prompts {
                for start in (0..8192).step_by(rows) {
                    st.observe(&prefill(start, rows), None, prefill_pairs(start, rows));
                    st.observe(&decode, None, 0);
                }
            }
        }
        // A chunk at a depth no chunk reached (32K): its line and its depth.
        let (start, rows) = (30_720, 2048);
        let pairs = prefill_pairs(start, rows);
        assert!(st.warm_for(rows, false, 0, &[0], pairs));
        let got = st.cost_model(rows, pairs).step_time(rows, 0, &[0], false);
        let want = linear(rows as f64) + attention(pairs);
        assert!((got - want).abs() < 0.05 * want, "{got} s predicted, {want} measured");
        // A decode step keeps its own line (a decode line at 2 048 rows said 4.3 s for ~0.5).
        let decode_time = st.cost_model(1, 0).step_time(1, 100, &[0], false);
        assert!((decode_time - 0.00241).abs() < 1e-4, "{decode_time}");
        assert_eq!(prefill_pairs(0, 4), 10);
        assert_eq!(prefill_pairs(6, 2), 7 + 8);
    }

    #[test]
    fn overlapped_steps_learn_their_slowdown() {
        let mut st = StepStats::new(1, false);
        for _ in 0..300 {
            // Every overlapped step takes 12% longer than the plain model says.
            let predicted = st.cost_model(16, 0).overlap_slowdown * 0.1;
            let t = pb::StepTimings { total_ns: 112_000_000, decode_tokens: 16, sub_batches: 2, ..Default::default() };
            st.observe(&t, prediction(&st, &t, predicted), 0);
        }
        let s = st.cost_model(16, 0).overlap_slowdown;
        assert!((s - 1.12).abs() < 0.01, "{s}");
    }

    /// A step predicted before its batch size's band had data (a borrowed line) does not
    /// count, the one that warms the band included; the steps after it do.
    #[test]
    fn only_steps_predicted_by_warm_fits_count_as_errors() {
        let mut st = StepStats::new(1, false);
        let step = |tokens: u32, secs: f64| pb::StepTimings { total_ns: (secs * 1e9) as u64, linear_ns: (secs * 1e9) as u64, decode_tokens: tokens, ..Default::default() };
        for _ in 0..20 {
            st.observe(&step(1, 0.2), prediction(&st, &step(1, 0.2), 0.2), 0);
        }
        for _ in 0..WARM {
            // Four times too fast: the band of 64 borrows the line of 1.
            st.observe(&step(64, 2.0), prediction(&st, &step(64, 2.0), 0.5), 0);
        }
        assert!(st.errors.len() == 20 - WARM as usize && st.errors.iter().all(|&e| e < 1e-9), "{:?}", st.errors);
        st.observe(&step(64, 2.0), prediction(&st, &step(64, 2.0), 0.5), 0);
        assert_eq!(st.errors.back().copied(), Some(0.75));
        // Two steps in flight: the next step is planned before the one before it is folded
        // in. Planned while its band had WARM - 1 samples, it does not count, although the
        // band is warm by the time its own timings come back.
        let mut st = StepStats::new(1, false);
        for _ in 0..20 {
            st.observe(&step(1, 0.2), prediction(&st, &step(1, 0.2), 0.2), 0);
        }
        let mut planned = prediction(&st, &step(64, 2.0), 0.5);
        for _ in 0..WARM + 4 {
            let next = prediction(&st, &step(64, 2.0), 0.5);
            st.observe(&step(64, 2.0), planned, 0);
            planned = next;
        }
        assert_eq!(st.errors.len(), 20 - WARM as usize + 3, "the steps planned once the band had WARM samples: {:?}", st.errors);
    }

    #[test]
    fn stats_fit_each_device_and_report_errors() {
        let mut st = StepStats::new(1, false);
        for i in 0..100u64 {
            let (gpu_pos, cpu_pos, tokens) = (1000 + 370 * (i % 13), 500 + 400 * (i % 11), 1 + (i % 16) as u32);
            let linear = 0.002 + 1e-4 * tokens as f64;
            let (ga, ca) = (2e-7 * gpu_pos as f64, 1e-4 + 1e-7 * cpu_pos as f64);
            let t = pb::StepTimings {
                total_ns: ((linear + ga.max(ca)) * 1e9) as u64,
                linear_ns: (linear * 1e9) as u64,
                attention_gpu_ns: (ga * 1e9) as u64,
                decode_tokens: tokens,
                gpu_attention_positions: gpu_pos,
                cpu_attention_positions: cpu_pos,
                cpu_workers: vec![pb::CpuWorkerTiming { worker: 0, busy_ns: (ca * 1e9) as u64, positions: cpu_pos, ..Default::default() }],
                ..Default::default()
            };
            let predicted = st.cost_model(tokens as usize, 0).step_time(tokens as usize, gpu_pos as usize, &[cpu_pos as usize], false);
            st.observe(&t, prediction(&st, &t, predicted), 0);
        }
        let c = st.cost_model(12, 0);
        assert!((c.linear_per_token - 1e-4).abs() < 1e-6 && (c.gpu_attn_per_pos - 2e-7).abs() < 1e-9, "{c:?}");
        assert!((c.cpu_attn_per_pos[0] - 1e-7).abs() < 1e-9 && (c.cpu_fixed[0] - 1e-4).abs() < 1e-5, "{c:?}");
        let (p50, p90) = st.prediction_error().unwrap();
        assert!(p50 < 0.01 && p90 < 0.02, "{p50} {p90}");
    }
}
