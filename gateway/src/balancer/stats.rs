//! Runtime statistics: from every step's per-phase timings, an online fit of each cost the
//! planner needs (a + b·x, exponentially weighted least squares so that the model follows a
//! machine whose load changes, with outliers clipped), and the planner's prediction error.

use std::collections::VecDeque;

use duet_proto::pb;

use super::planner::CostModel;

/// Weight of the past per new sample (an effective memory of ~50 samples).
const FORGET: f64 = 0.98;
/// Samples before a fit is trusted over its prior, and before outliers are clipped.
const WARM: u32 = 8;
/// A sample further than this many mean absolute residuals from the fit is clipped there.
const CLIP: f64 = 4.0;
/// Least squares separates intercept from slope only when the recent x spread (standard
/// deviation over mean) reaches this.
const MIN_SPREAD: f64 = 0.2;
/// Steps whose prediction errors are kept for the median and p90.
const ERROR_WINDOW: usize = 512;
/// Samples in a row beyond the clip band, all on one side, that mark a level shift (the
/// machine's speed changed: a VM's phase, another process's load) rather than outliers: the
/// fit then restarts from them. Clipped, they would move it by a band a step, and its
/// memory of ~50 steps held the old level for dozens of steps: the 8B shape's batch-1
/// steps fell from 110 to 85 ms in one run and were predicted 5–25 % slow for 40 steps.
const SHIFT_RUN: usize = 4;

/// An online fit of y = a + b·x.
#[derive(Debug, Clone)]
pub struct LinearFit {
    prior: (f64, f64),
    sw: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    /// Mean absolute residual (exponentially weighted).
    mad: f64,
    n: u32,
    /// The first samples, kept until the fit is warm to measure their residuals.
    first: Vec<(f64, f64)>,
    /// The intercept of the last least-squares fit, used while x does not spread.
    anchor: Option<f64>,
    /// The latest samples, unclipped, while each fell beyond the band on the same side
    /// (`true`: above it).
    shift: Vec<(f64, f64, bool)>,
}

impl LinearFit {
    /// A fit that answers `prior_a + prior_b·x` until it has data.
    pub fn new(prior_a: f64, prior_b: f64) -> Self {
        LinearFit {
            prior: (prior_a, prior_b),
            sw: 0.0,
            sx: 0.0,
            sy: 0.0,
            sxx: 0.0,
            sxy: 0.0,
            mad: 0.0,
            n: 0,
            first: Vec::new(),
            anchor: None,
            shift: Vec::new(),
        }
    }

    pub fn samples(&self) -> u32 {
        self.n
    }

    /// Intercept and slope: the prior before [`WARM`] samples; least squares while the
    /// recent x spread enough to tell intercept from slope; otherwise the intercept of the
    /// last such fit (or the prior's) and the slope through the recent mean. Both kept
    /// non-negative (a cost never falls with more work).
    pub fn coefficients(&self) -> (f64, f64) {
        if self.n < WARM || self.sw <= 0.0 {
            return self.prior;
        }
        let ((mx, var), my) = (self.x_mean_var(), self.sy / self.sw);
        if self.identified() {
            let b = ((self.sxy / self.sw - mx * my) / var).max(0.0);
            return ((my - b * mx).max(0.0), b);
        }
        let a = self.anchor.unwrap_or(self.prior.0).min(my).max(0.0);
        let b = if mx > 0.0 { ((my - a) / mx).max(0.0) } else { self.prior.1 };
        (a, b)
    }

    pub fn predict(&self, x: f64) -> f64 {
        let (a, b) = self.coefficients();
        a + b * x
    }

    /// The recent samples' mean x and its variance (exponentially weighted).
    fn x_mean_var(&self) -> (f64, f64) {
        let mx = self.sx / self.sw;
        (mx, (self.sxx / self.sw - mx * mx).max(0.0))
    }

    /// Whether the recent samples spread enough in x to tell the intercept from the slope
    /// (else [`coefficients`](Self::coefficients) splits their mean by its priors).
    fn identified(&self) -> bool {
        let (mx, var) = self.x_mean_var();
        self.sw > 0.0 && mx.abs() > 0.0 && var.sqrt() >= MIN_SPREAD * mx.abs()
    }

    /// The recent samples' mean cost.
    fn mean_y(&self) -> f64 {
        if self.sw > 0.0 { self.sy / self.sw } else { self.prior.0 }
    }

    /// Whether `x` lies among the recent samples' x (within three standard deviations of
    /// their mean, or [`MIN_SPREAD`] of it when they barely spread): there the fit has
    /// seen the cost, beyond it the fit only extrapolates.
    fn seen(&self, x: f64) -> bool {
        let (mx, var) = self.x_mean_var();
        (x - mx).abs() <= (3.0 * var.sqrt()).max(MIN_SPREAD * mx.abs())
    }

    /// Adds a sample; one far from the fit (after warm-up) is clipped to the fit's band,
    /// unless its x lies beyond the x seen so far: an extrapolation's miss is news, not an
    /// outlier (a fit learnt on batches of 1 would otherwise clip every sample of the
    /// batches of 16 that follow, and go on mispredicting them). [`SHIFT_RUN`] samples in a
    /// row beyond the band on one side are a level shift: the fit forgets its past and
    /// restarts from them, unclipped.
    pub fn add(&mut self, x: f64, y: f64) {
        if !(x.is_finite() && y.is_finite()) {
            return;
        }
        let mut y = y;
        if self.n >= WARM {
            let p = self.predict(x);
            // Never narrower than 2% of the prediction: timer noise is not an outlier.
            let band = CLIP * self.mad.max(0.02 * p.abs()).max(1e-12);
            if self.seen(x) {
                let above = y > p + band;
                if !(above || y < p - band) {
                    self.shift.clear();
                } else {
                    if self.shift.last().is_some_and(|&(_, _, was_above)| was_above != above) {
                        self.shift.clear();
                    }
                    self.shift.push((x, y, above));
                }
                if self.shift.len() >= SHIFT_RUN {
                    self.restart_from_shift();
                    return;
                }
                y = y.clamp(p - band, p + band);
            } else {
                self.shift.clear();
            }
            // An unclipped miss still moves the residual scale by at most the band.
            self.mad = FORGET * self.mad + (1.0 - FORGET) * (y - p).abs().min(band);
        } else {
            self.first.push((x, y));
        }
        self.push(x, y);
    }

    /// A level shift: the sums restart from the run of samples beyond the band (the
    /// residual scale and the intercept anchor stay: the noise and the line's shape are
    /// the machine's, only its level moved).
    fn restart_from_shift(&mut self) {
        let run = std::mem::take(&mut self.shift);
        // All but the last of the run were counted already (clipped).
        let n = self.n.saturating_add(1);
        (self.sw, self.sx, self.sy, self.sxx, self.sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for (x, y, _) in run {
            self.push(x, y);
        }
        self.n = n;
    }

    /// Folds a sample into the exponentially weighted sums.
    fn push(&mut self, x: f64, y: f64) {
        self.sw = FORGET * self.sw + 1.0;
        self.sx = FORGET * self.sx + x;
        self.sy = FORGET * self.sy + y;
        self.sxx = FORGET * self.sxx + x * x;
        self.sxy = FORGET * self.sxy + x * y;
        self.n = self.n.saturating_add(1);
        if self.n >= WARM && self.identified() {
            self.anchor = Some(self.coefficients().0);
        }
        if self.n == WARM {
            // Warm: the spread of the first samples around their own fit. The median
            // residual, so that an outlier among them does not widen the band.
            let mut r: Vec<f64> = self.first.iter().map(|&(x, y)| (y - self.predict(x)).abs()).collect();
            r.sort_by(f64::total_cmp);
            self.mad = r[r.len() / 2];
            self.first = Vec::new();
        }
    }
}

/// What the planner predicted for a step: its time, and whether the fits it came from had
/// data then ([`StepStats::warm_for`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    pub seconds: f64,
    pub warm: bool,
}

/// A cost over batch sizes that is not one line: the linear layers of a real model stream
/// their weights at small batches (a near-constant time) and compute at large ones, so one
/// line through batches of 1 and 64 mispredicts both (a 1B-shape model: 26 ms at 1, 90 at
/// 16, and a line through 16..64 put batch 1 at 8 ms). One [`LinearFit`] per power-of-two
/// band of x (1, 2–3, 4–7, ...) answers for its band once warm; a band not yet seen borrows
/// the nearest warm band's line, else the fit over every sample.
#[derive(Debug, Clone)]
pub struct BatchFit {
    bands: Vec<LinearFit>,
    all: LinearFit,
}

impl BatchFit {
    pub fn new(prior_a: f64, prior_b: f64) -> Self {
        BatchFit { bands: Vec::new(), all: LinearFit::new(prior_a, prior_b) }
    }

    fn band(x: f64) -> usize {
        (x.max(1.0) as u64).ilog2() as usize
    }

    pub fn add(&mut self, x: f64, y: f64) {
        let b = Self::band(x);
        if self.bands.len() <= b {
            let prior = self.all.prior;
            self.bands.resize_with(b + 1, || LinearFit::new(prior.0, prior.1));
        }
        self.bands[b].add(x, y);
        self.all.add(x, y);
    }

    /// Whether some band has its own line.
    pub fn any_warm(&self) -> bool {
        self.bands.iter().any(|f| f.samples() >= WARM)
    }

    /// Samples in the band of `x`.
    pub fn samples_at(&self, x: f64) -> u32 {
        self.bands.get(Self::band(x)).map_or(0, LinearFit::samples)
    }

    /// Intercept and slope of the line that predicts batches of `x`. A band not yet warm
    /// borrows: above every warm band, the secant through the two highest warm bands (a new,
    /// larger batch costs more than the largest seen: the 8B shape's batch of 64 took 2.2 s
    /// where the flat line of 16 said 0.6); else the warm band nearest in log x (a batch of
    /// 63 beside warm bands of 16 and 64 costs what 64 costs, one of 2 what 1 costs). A
    /// borrowed band whose own x did not spread (batches of one size) lends a flat line at
    /// its mean: it knows what its batches cost, not how the cost grows.
    pub fn coefficients_at(&self, x: f64) -> (f64, f64) {
        let b = Self::band(x);
        let warm: Vec<(usize, &LinearFit)> = self.bands.iter().enumerate().filter(|(_, f)| f.samples() >= WARM).collect();
        if let Some((_, own)) = warm.iter().find(|&&(i, _)| i == b) {
            return own.coefficients();
        }
        let lend = |f: &LinearFit| if f.identified() { f.coefficients() } else { (f.mean_y(), 0.0) };
        match warm.as_slice() {
            [] => self.all.coefficients(),
            [.., (_, lo), (top, hi)] if b > *top => {
                let ((x1, y1), (x2, y2)) = ((lo.x_mean_var().0, lo.mean_y()), (hi.x_mean_var().0, hi.mean_y()));
                let slope = if x2 > x1 { ((y2 - y1) / (x2 - x1)).max(0.0) } else { 0.0 };
                ((y2 - slope * x2).max(0.0), slope)
            }
            _ => {
                let distance = |f: &LinearFit| (x.max(1.0).ln() - f.x_mean_var().0.max(1.0).ln()).abs();
                let nearest = warm.iter().map(|&(_, f)| f).min_by(|f, g| distance(f).total_cmp(&distance(g))).expect("one warm band");
                lend(nearest)
            }
        }
    }

    pub fn predict(&self, x: f64) -> f64 {
        let (a, b) = self.coefficients_at(x);
        a + b * x
    }
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
    fn a_fit_recovers_a_line_and_shrugs_off_outliers() {
        let mut f = LinearFit::new(0.0, 1.0);
        assert_eq!(f.predict(10.0), 10.0, "the prior before data");
        for i in 0..200 {
            let x = (i % 17) as f64 * 100.0;
            let y = 0.002 + 3e-6 * x + if i % 2 == 0 { 1e-5 } else { -1e-5 };
            // One wild sample in fifty (a preempted step).
            let y = if i % 50 == 49 { y * 20.0 } else { y };
            f.add(x, y);
        }
        let (a, b) = f.coefficients();
        assert!((a - 0.002).abs() < 1e-4 && (b - 3e-6).abs() < 1e-7, "a = {a}, b = {b}");
    }

    #[test]
    fn a_level_shift_is_followed_within_a_few_steps_and_outliers_are_not_one() {
        // As the 8B shape's batch-1 steps on the VM: ~110 ms, then ~85 ms from one step on.
        let noise = |i: usize| [0.01, -0.015, 0.02, -0.005, 0.0, -0.02, 0.015][i % 7];
        let mut f = LinearFit::new(1e-3, 1e-4);
        for i in 0..60 {
            f.add(1.0, 0.110 * (1.0 + noise(i)));
        }
        assert!((f.predict(1.0) - 0.110).abs() < 0.01 * 0.110, "{}", f.predict(1.0));
        let mut followed = None;
        for i in 0..60 {
            f.add(1.0, 0.085 * (1.0 + noise(i)));
            if followed.is_none() && (f.predict(1.0) - 0.085).abs() < 0.03 * 0.085 {
                followed = Some(i + 1);
            }
        }
        assert_eq!(followed, Some(SHIFT_RUN), "steps at the new level before it is predicted within 3 %");
        assert!((f.predict(1.0) - 0.085).abs() < 0.01 * 0.085, "{}", f.predict(1.0));
        // Outliers that do not persist (fewer than SHIFT_RUN in a row on one side, or
        // alternating sides) are clipped, not taken for a new level.
        for i in 0..200 {
            let wild = match i % 40 {
                5..=7 | 21 | 23 | 25 => 1.5,
                22 | 24 | 26 => 0.5,
                _ => 1.0,
            };
            f.add(1.0, 0.085 * (1.0 + noise(i)) * wild);
            assert!((f.predict(1.0) - 0.085).abs() < 0.03 * 0.085, "after sample {i}: {}", f.predict(1.0));
        }
    }

    #[test]
    fn a_fit_learns_a_batch_size_it_has_not_seen() {
        // Batch-1 steps only (x = 1, 30 ms: weights streamed), then batches of 16 (90 ms):
        // the first fit extrapolates badly, and its misses must teach it, not be clipped.
        let mut f = LinearFit::new(1e-3, 1e-4);
        for i in 0..100 {
            f.add(1.0, 0.030 + if i % 2 == 0 { 3e-4 } else { -3e-4 });
        }
        for i in 0..20 {
            f.add(16.0, 0.090 + if i % 2 == 0 { 9e-4 } else { -9e-4 });
        }
        let p = f.predict(16.0);
        assert!((p - 0.090).abs() < 0.05 * 0.090, "after 20 batches of 16: {p} s predicted, 0.090 measured");
        assert!((f.predict(1.0) - 0.030).abs() < 0.1 * 0.030, "batch 1 still known: {}", f.predict(1.0));
    }

    #[test]
    fn each_batch_size_band_keeps_its_own_line() {
        // Weights streamed below 8 tokens (26 ms), compute above (a steeper line).
        let cost = |x: f64| if x < 8.0 { 0.026 } else { 0.026 + 0.004 * (x - 4.0) };
        let mut f = BatchFit::new(1e-3, 1e-4);
        for i in 0..600 {
            let x = [1.0, 16.0, 24.0, 64.0, 96.0][i % 5];
            f.add(x, cost(x));
        }
        for x in [1.0, 16.0, 24.0, 64.0, 96.0] {
            assert!((f.predict(x) - cost(x)).abs() < 0.02 * cost(x), "batch {x}: {} predicted, {} measured", f.predict(x), cost(x));
        }
        // A band never seen borrows the nearest warm band's line.
        assert!((f.predict(2.0) - 0.026).abs() < 0.002, "{}", f.predict(2.0));
    }

    #[test]
    fn a_new_batch_size_borrows_from_the_bands_around_it() {
        let cost = |x: f64| if x < 8.0 { 0.026 } else { 0.026 + 0.004 * (x - 4.0) };
        let mut f = BatchFit::new(1e-3, 1e-4);
        for i in 0..40 {
            let x = [1.0, 16.0][i % 2];
            f.add(x, cost(x));
        }
        // Larger than any batch seen: the secant through the two largest (0.228 for 0.266;
        // the flat line of 16 would say 0.074).
        let p = f.predict(64.0);
        assert!(p > cost(16.0) && (p - cost(64.0)).abs() < 0.2 * cost(64.0), "batch 64: {p} predicted, {} measured", cost(64.0));
        for _ in 0..20 {
            f.add(64.0, cost(64.0));
        }
        // Between warm bands: the nearest in log x (64, not 16).
        let p = f.predict(63.0);
        assert!((p - cost(63.0)).abs() < 0.05 * cost(63.0), "batch 63: {p} predicted, {} measured", cost(63.0));
        let p = f.predict(3.0);
        assert!((p - cost(3.0)).abs() < 0.01 * cost(3.0), "batch 3: {p} predicted");
    }

    #[test]
    fn a_fit_of_one_x_keeps_a_sane_slope() {
        // x barely moves (a long run of one policy): the slope goes through the mean from
        // the intercept learnt while x varied.
        let mut f = LinearFit::new(0.0, 1e-7);
        for i in 0..60 {
            let x = [1000.0, 4000.0, 8000.0][i % 3];
            f.add(x, 0.01 + 1e-5 * x);
        }
        for i in 0..500 {
            let x = 33000.0 + i as f64;
            f.add(x, 0.01 + 1e-5 * x + if i % 2 == 0 { 1e-3 } else { -1e-3 });
        }
        let (a, b) = f.coefficients();
        assert!((a - 0.01).abs() < 2e-3 && (b - 1e-5).abs() < 1e-7, "a = {a}, b = {b}");
        // Then the machine slows down by a fifth at that one x: the fit follows.
        for i in 0..300 {
            let x = 33500.0 + i as f64;
            f.add(x, 1.2 * (0.01 + 1e-5 * x));
        }
        let want = 1.2 * (0.01 + 1e-5 * 33800.0);
        assert!((f.predict(33800.0) - want).abs() < 0.01 * want, "{} vs {want}", f.predict(33800.0));
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
    fn a_fit_follows_a_change() {
        let mut f = LinearFit::new(0.0, 1.0);
        for i in 0..100 {
            f.add((i % 10) as f64, 1.0 + (i % 10) as f64);
        }
        for i in 0..300 {
            f.add((i % 10) as f64, 1.0 + 2.0 * (i % 10) as f64);
        }
        assert!((f.coefficients().1 - 2.0).abs() < 0.05, "{:?}", f.coefficients());
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
