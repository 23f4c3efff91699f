//! The balancer's online cost fits: a line y = a + b·x fitted by exponentially weighted least
//! squares (following a machine whose speed changes, outliers clipped, level shifts followed),
//! and a fit over batch sizes made of one line per power-of-two band.

/// Weight of the past per new sample (an effective memory of ~50 samples).
pub const FORGET: f64 = 0.98;
/// Samples before a fit is trusted over its prior, and before outliers are clipped.
pub const WARM: u32 = 8;
/// A sample further than this many mean absolute residuals from the fit is clipped there.
const CLIP: f64 = 4.0;
/// Least squares separates intercept from slope only when the recent x spread (standard
/// deviation over mean) reaches this.
const MIN_SPREAD: f64 = 0.2;
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
