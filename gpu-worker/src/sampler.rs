//! Token sampling: a logit bias, the repetition, frequency and presence penalties over the last
//! tokens, then greedy, or temperature with top-k, top-p and min-p filtering and a draw whose
//! random number comes from the seed and the position (the order of llama.cpp's default chain:
//! logit bias, penalties, top-k, top-p, min-p, temperature, draw).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{Result, GpuWorkerError};

/// Sampling parameters, validated by [`SamplingParams::validate`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k filter.
    pub top_k: usize,
    /// 1 means no top-p filter.
    pub top_p: f32,
    /// 0 means no min-p filter.
    pub min_p: f32,
    /// 1 means no penalty.
    pub repetition_penalty: f32,
    /// Subtracted from a logit once per time its token occurs in the last
    /// [`PENALTY_LAST_N`] tokens; 0 means none.
    pub frequency_penalty: f32,
    /// Subtracted from the logit of each token that occurs in the last [`PENALTY_LAST_N`]
    /// tokens; 0 means none.
    pub presence_penalty: f32,
    pub seed: u64,
}

/// Tokens the repetition penalty looks back over (llama.cpp's default `penalty_last_n`).
pub const PENALTY_LAST_N: usize = 64;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0, frequency_penalty: 0.0, presence_penalty: 0.0, seed: 0 }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(GpuWorkerError::InvalidRequest(format!("temperature must be a finite number >= 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(GpuWorkerError::InvalidRequest(format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        if !(self.min_p >= 0.0 && self.min_p < 1.0) {
            return Err(GpuWorkerError::InvalidRequest(format!("min_p must be in [0, 1), got {}", self.min_p)));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(GpuWorkerError::InvalidRequest(format!(
                "repetition_penalty must be a finite number > 0, got {}",
                self.repetition_penalty
            )));
        }
        for (name, v) in [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(GpuWorkerError::InvalidRequest(format!("{name} must be in [-2, 2], got {v}")));
            }
        }
        Ok(())
    }

    /// Whether a penalty changes any logit.
    fn penalises(&self) -> bool {
        self.repetition_penalty != 1.0 || self.frequency_penalty != 0.0 || self.presence_penalty != 0.0
    }
}

/// The most a logit bias may add or take away (OpenAI's range; -100 in effect bans a token).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// Index of the largest logit (the first one on ties, as llama.cpp's greedy sampler).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Draws tokens for one sequence.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    /// Added to these tokens' logits before anything else, by token id.
    logit_bias: Vec<(u32, f32)>,
}

/// The random numbers of the draw at `position` of a sequence sampled with `seed`: a function
/// of the two alone, not a stream, so that a sampler made afresh (a sequence taken up again
/// after a worker failed) draws what the one before it would have.
fn draw_rng(seed: u64, position: usize) -> StdRng {
    // SplitMix64's finaliser over the pair: nearby seeds and positions far apart.
    let mut z = seed ^ (position as u64).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    StdRng::seed_from_u64(z ^ (z >> 31))
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Sampler { params, logit_bias: Vec::new() })
    }

    /// The same sampler with `bias` added to its tokens' logits first (OpenAI's
    /// `logit_bias`); a bias outside ±[`MAX_LOGIT_BIAS`] is refused. Ids past the vocabulary
    /// change nothing (the gateway refuses them before they get here).
    pub fn with_logit_bias(mut self, bias: impl IntoIterator<Item = (u32, f32)>) -> Result<Self> {
        let mut bias: Vec<(u32, f32)> = bias.into_iter().filter(|&(_, b)| b != 0.0).collect();
        if let Some(&(id, b)) = bias.iter().find(|(_, b)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(b)) {
            return Err(GpuWorkerError::InvalidRequest(format!("logit_bias of token {id} must be in [-100, 100], got {b}")));
        }
        bias.sort_by_key(|&(id, _)| id);
        self.logit_bias = bias;
        Ok(self)
    }

    /// Whether every draw is the plain arg-max of the logits (greedy, no bias or penalty).
    pub fn is_plain_greedy(&self) -> bool {
        self.params.temperature == 0.0 && !self.params.penalises() && self.logit_bias.is_empty()
    }

    /// Draws the next token; `history` holds the sequence's tokens so far (prompt included),
    /// the last [`PENALTY_LAST_N`] of which the penalties apply to, and its length is the
    /// draw's position (which, with the seed, gives its random number).
    pub fn sample(&self, logits: &[f32], history: &[u32]) -> u32 {
        let p = self.params;
        let adjusted;
        let logits = if p.penalises() || !self.logit_bias.is_empty() {
            let mut l = logits.to_vec();
            for &(id, b) in &self.logit_bias {
                if let Some(v) = l.get_mut(id as usize) {
                    *v += b;
                }
            }
            penalise(&mut l, &history[history.len().saturating_sub(PENALTY_LAST_N)..], p);
            adjusted = l;
            &adjusted[..]
        } else {
            logits
        };
        if p.temperature == 0.0 || logits.is_empty() {
            return argmax(logits);
        }
        let kept = Kept::filter(logits, p);
        // The kept tokens' weights at the temperature, in id order.
        let (max, inv_t) = (kept.top.1, 1.0 / p.temperature);
        if !inv_t.is_finite() {
            // A temperature so small (below ~3e-39) that its inverse overflows: the limit,
            // greedy (the weights would be 0 · inf, NaN, and the draw fall through to the last
            // kept token).
            return kept.top.0;
        }
        let members: Vec<(u32, f32)> = kept.members(logits).map(|(id, l)| (id, ((l - max) * inv_t).exp())).collect();
        let z: f64 = members.iter().map(|m| m.1 as f64).sum();
        let r: f64 = draw_rng(p.seed, history.len()).random::<f64>() * z;
        let mut acc = 0.0;
        for &(id, w) in &members {
            acc += w as f64;
            if r < acc {
                return id;
            }
        }
        members.last().map_or(kept.top.0, |m| m.0)
    }
}

/// The ranking of candidates: logit descending, the lower id first on ties (a total order).
fn rank_order(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The candidates the filters keep: those ranked no lower than `last` (top-k, top-p and
/// min-p each keep a head of the ranking), found by selection rather than by sorting the
/// vocabulary (which took 4 ms a row for 128K tokens). The draw then walks the kept tokens
/// in id order: a fixed order, so a seed repeats its draws.
struct Kept {
    top: (u32, f32),
    /// The lowest-ranked kept token; `None`: every token is kept (no filter).
    last: Option<(u32, f32)>,
}

impl Kept {
    fn filter(logits: &[f32], p: SamplingParams) -> Kept {
        let all = || logits.iter().enumerate().map(|(i, &l)| (i as u32, l));
        let top = all().min_by(rank_order).expect("a vocabulary is not empty");
        let top_k = p.top_k > 0 && p.top_k < logits.len();
        if !top_k && p.top_p >= 1.0 && p.min_p <= 0.0 {
            return Kept { top, last: None };
        }
        let mut cand: Vec<(u32, f32)> = all().collect();
        if top_k {
            cand.select_nth_unstable_by(p.top_k - 1, rank_order);
            cand.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            // The smallest head whose probabilities (temperature 1, over the candidates)
            // reach top_p.
            let mut weighted: Vec<Weighted> = cand.iter().map(|&(id, l)| Weighted { id, logit: l, w: (l - top.1).exp() }).collect();
            let z: f64 = weighted.iter().map(|c| c.w as f64).sum();
            let n = nucleus(&mut weighted, p.top_p as f64 * z);
            cand = weighted[..n].iter().map(|c| (c.id, c.logit)).collect();
        }
        if p.min_p > 0.0 {
            // Keep tokens with probability >= min_p * the top one's: logit >= top + ln(min_p).
            let floor = top.1 + p.min_p.ln();
            cand.retain(|c| c.1 >= floor || *c == top);
        }
        let last = cand.into_iter().max_by(rank_order).expect("the top is kept");
        Kept { top, last: Some(last) }
    }

    /// The kept tokens in id order, with their logits.
    fn members<'a>(&'a self, logits: &'a [f32]) -> impl Iterator<Item = (u32, f32)> + 'a {
        logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).filter(move |c| self.last.is_none_or(|last| rank_order(c, &last) != std::cmp::Ordering::Greater))
    }
}

/// A candidate with its weight at temperature 1 (`exp(logit - top)`).
#[derive(Clone, Copy)]
struct Weighted {
    id: u32,
    logit: f32,
    w: f32,
}

fn weighted_order(a: &Weighted, b: &Weighted) -> std::cmp::Ordering {
    rank_order(&(a.id, a.logit), &(b.id, b.logit))
}

/// How many of the highest-ranked `cand` make the smallest head whose weights sum to
/// `mass` (all of them if none does), found by repeated selection (linear time on average);
/// leaves that head at the front of `cand`.
fn nucleus(cand: &mut [Weighted], mass: f64) -> usize {
    let (mut lo, mut hi, mut above) = (0, cand.len(), 0.0);
    while hi - lo > 64 {
        let mid = (hi - lo) / 2;
        cand[lo..hi].select_nth_unstable_by(mid, weighted_order);
        let upper: f64 = cand[lo..lo + mid + 1].iter().map(|c| c.w as f64).sum();
        if above + upper >= mass {
            hi = lo + mid + 1;
        } else {
            above += upper;
            lo += mid + 1;
        }
    }
    cand[lo..hi].sort_unstable_by(weighted_order);
    for (i, c) in cand[lo..hi].iter().enumerate() {
        above += c.w as f64;
        if above >= mass {
            return lo + i + 1;
        }
    }
    hi
}

/// llama.cpp's penalties over the tokens of `recent`, each distinct token once: a positive
/// logit divided by the repetition penalty, a negative one multiplied, then the frequency
/// penalty taken off once per occurrence and the presence penalty once.
fn penalise(logits: &mut [f32], recent: &[u32], p: SamplingParams) {
    let mut counts = std::collections::HashMap::new();
    for &t in recent {
        *counts.entry(t).or_insert(0u32) += 1;
    }
    for (t, n) in counts {
        if let Some(l) = logits.get_mut(t as usize) {
            if p.repetition_penalty != 1.0 && l.is_finite() {
                // Kept finite, as it was: an extreme penalty would make a logit infinite (and
                // the softmax's inf − inf NaN). A token a grammar forbids stays at −inf.
                *l = if *l > 0.0 { (*l / p.repetition_penalty).min(f32::MAX) } else { (*l * p.repetition_penalty).max(-f32::MAX) };
            }
            *l -= n as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sampler's filters as the whole vocabulary sorted gives them (llama.cpp's chain),
    /// then the draw over the kept tokens in id order: the twin of the selections.
    fn sample_by_full_sort(p: SamplingParams, rng: &mut StdRng, logits: &[f32]) -> u32 {
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        if p.top_k > 0 {
            cand.truncate(p.top_k.max(1));
        }
        if p.top_p < 1.0 {
            let top = cand[0].1;
            let w: Vec<f64> = cand.iter().map(|c| (c.1 - top).exp() as f64).collect();
            let z: f64 = w.iter().sum();
            let mut acc = 0.0;
            let keep = w.iter().position(|&q| {
                acc += q;
                acc >= p.top_p as f64 * z
            });
            cand.truncate(keep.map_or(cand.len(), |i| i + 1));
        }
        if p.min_p > 0.0 {
            let floor = cand[0].1 + p.min_p.ln();
            let keep = cand.iter().take_while(|c| c.1 >= floor).count().max(1);
            cand.truncate(keep);
        }
        // The kept set drawn from in id order.
        let top = cand[0].1;
        cand.sort_by_key(|c| c.0);
        let e: Vec<f64> = cand.iter().map(|c| ((c.1 - top) * (1.0 / p.temperature)).exp() as f64).collect();
        let z: f64 = e.iter().sum();
        let r: f64 = rng.random::<f64>() * z;
        let mut acc = 0.0;
        for (c, q) in cand.iter().zip(&e) {
            acc += q;
            if r < acc {
                return c.0;
            }
        }
        cand.last().map_or(0, |c| c.0)
    }

    #[test]
    fn selection_keeps_what_sorting_the_whole_vocabulary_keeps() {
        let mut rng = StdRng::seed_from_u64(5);
        // A flat random row (the worst case: the nucleus is most of the vocabulary), a peaked
        // one, and ties.
        let flat: Vec<f32> = (0..5000).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let peaked: Vec<f32> = (0..5000).map(|i| if i % 97 == 0 { 8.0 + (i % 7) as f32 } else { rng.random_range(-4.0f32..1.0) }).collect();
        let ties: Vec<f32> = (0..300).map(|i| (i % 5) as f32).collect();
        for logits in [&flat, &peaked, &ties] {
            for (t, k, tp, mp) in [(1.0, 0, 1.0, 0.0), (0.8, 0, 0.95, 0.0), (0.7, 40, 0.9, 0.0), (1.2, 0, 1.0, 0.05), (0.6, 3, 1.0, 0.0), (1.0, 0, 0.5, 0.2), (1.0, 100000, 0.99, 0.0)] {
                let p = SamplingParams { temperature: t, top_k: k, top_p: tp, min_p: mp, seed: 9, ..Default::default() };
                let s = Sampler::new(p).unwrap();
                for draw in 0..200 {
                    let history = vec![0; draw];
                    assert_eq!(s.sample(logits, &history), sample_by_full_sort(p, &mut draw_rng(9, draw), logits), "{p:?}, draw {draw}");
                }
            }
        }
    }

    #[test]
    fn greedy_picks_first_maximum() {
        assert_eq!(argmax(&[0.5, 2.0, 2.0, -1.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_is_reproducible() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 100) as f32 / 10.0).collect();
        let s = Sampler::new(SamplingParams { temperature: 1.0, top_k: 1, seed: 7, ..Default::default() }).unwrap();
        assert_eq!(s.sample(&logits, &[]), argmax(&logits));
        let params = SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.9, seed: 42, ..Default::default() };
        let draw = |p, from: usize| {
            let s = Sampler::new(p).unwrap();
            (from..20).map(|pos| s.sample(&logits, &vec![0; pos])).collect::<Vec<_>>()
        };
        assert_eq!(draw(params, 0), draw(params, 0));
        assert_ne!(draw(params, 0), draw(SamplingParams { seed: 43, ..params }, 0));
        // A sampler made afresh at position 12 (a sequence taken up again) draws what the
        // first drew from there; and the draws vary along the sequence.
        assert_eq!(draw(params, 12), draw(params, 0)[12..]);
        let all = draw(params, 0);
        assert!(all.iter().any(|&t| t != all[0]), "{all:?}");
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // One token holds almost all the mass: top_p 0.5 must always return it.
        let mut logits = vec![0.0f32; 50];
        logits[17] = 20.0;
        let s = Sampler::new(SamplingParams { temperature: 5.0, top_p: 0.5, seed: 1, ..Default::default() }).unwrap();
        assert!((0..50).all(|pos| s.sample(&logits, &vec![0; pos]) == 17));
    }

    #[test]
    fn invalid_parameters_are_refused() {
        for p in [
            SamplingParams { temperature: -1.0, ..Default::default() },
            SamplingParams { temperature: f32::NAN, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { top_p: 1.5, ..Default::default() },
            SamplingParams { min_p: 1.0, ..Default::default() },
            SamplingParams { min_p: -0.1, ..Default::default() },
            SamplingParams { repetition_penalty: 0.0, ..Default::default() },
            SamplingParams { repetition_penalty: f32::INFINITY, ..Default::default() },
            SamplingParams { frequency_penalty: 2.5, ..Default::default() },
            SamplingParams { presence_penalty: -2.1, ..Default::default() },
            SamplingParams { presence_penalty: f32::NAN, ..Default::default() },
        ] {
            assert!(matches!(Sampler::new(p), Err(GpuWorkerError::InvalidRequest(_))), "{p:?}");
        }
    }

    #[test]
    fn extreme_valid_parameters_still_draw_a_likely_token() {
        // The last token is the least likely: a NaN weight made every draw fall through to it.
        let logits = [1.0f32, 3.0, 2.0, -5.0];
        for t in [1e-40f32, f32::MIN_POSITIVE, 1e-30] {
            let s = Sampler::new(SamplingParams { temperature: t, seed: 1, ..Default::default() }).unwrap();
            assert!((0..20).all(|pos| s.sample(&logits, &vec![0; pos]) == 1), "temperature {t}: the limit is greedy");
        }
        // A tiny repetition penalty makes a seen positive logit the largest finite one.
        let mut l = logits;
        penalise(&mut l, &[2], SamplingParams { repetition_penalty: 1e-39, ..Default::default() });
        assert_eq!(l[2], f32::MAX);
        let s = Sampler::new(SamplingParams { temperature: 1.0, repetition_penalty: 1e-39, seed: 1, ..Default::default() }).unwrap();
        assert!((0..20).all(|pos| s.sample(&logits, &[2]) == 2 && s.sample(&logits, &vec![2; pos + 1]) == 2));
        // A huge one makes a seen negative logit the smallest finite one; a forbidden token
        // (a grammar's mask: −inf) stays forbidden under either.
        l[1] = f32::NEG_INFINITY;
        penalise(&mut l, &[1, 3], SamplingParams { repetition_penalty: 1e38, ..Default::default() });
        assert_eq!((l[1], l[3]), (f32::NEG_INFINITY, -f32::MAX));
        penalise(&mut l, &[1], SamplingParams { repetition_penalty: 1e-39, ..Default::default() });
        assert_eq!(l[1], f32::NEG_INFINITY);
        // Every allowed token seen and saturated: greedy still picks an allowed one.
        let masked = [f32::NEG_INFINITY, -1.0, f32::NEG_INFINITY, -2.0];
        let s = Sampler::new(SamplingParams { repetition_penalty: f32::MAX, ..Default::default() }).unwrap();
        assert_eq!(s.sample(&masked, &[0, 1, 2, 3]), 1, "tokens 1 and 3 tie at the smallest finite logit; 0 and 2 stay forbidden");
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        // Token 3 is 20x likelier than the others: with min_p 0.1 only it survives.
        let mut logits = vec![0.0f32; 10];
        logits[3] = 20f32.ln();
        let s = Sampler::new(SamplingParams { temperature: 1.0, min_p: 0.1, seed: 3, ..Default::default() }).unwrap();
        assert!((0..50).all(|pos| s.sample(&logits, &vec![0; pos]) == 3));
    }

    #[test]
    fn repetition_penalty_applies_to_recent_tokens_only() {
        let logits = [2.0f32, 1.9, -1.0];
        let s = Sampler::new(SamplingParams { repetition_penalty: 1.5, ..Default::default() }).unwrap();
        // Token 0 was seen: 2.0 / 1.5 < 1.9, so greedy picks token 1.
        assert_eq!(s.sample(&logits, &[0]), 1);
        // Seen long ago (more than PENALTY_LAST_N tokens back): no penalty.
        let mut old = vec![0u32];
        old.extend(std::iter::repeat_n(2, PENALTY_LAST_N));
        assert_eq!(s.sample(&logits, &old), 0);
        let mut l = logits;
        penalise(&mut l, &[2, 2], SamplingParams { repetition_penalty: 1.5, ..Default::default() });
        assert_eq!(l, [2.0, 1.9, -1.5]);
    }

    #[test]
    fn frequency_and_presence_penalties_count_recent_occurrences() {
        // llama.cpp's arithmetic: logit - count * frequency - presence, for each recent token.
        let p = SamplingParams { frequency_penalty: 0.5, presence_penalty: 0.25, ..Default::default() };
        let mut l = [3.0f32, 3.0, 3.0, -1.0];
        penalise(&mut l, &[0, 0, 0, 1, 3], p);
        assert_eq!(l, [3.0 - 1.5 - 0.25, 3.0 - 0.5 - 0.25, 3.0, -1.0 - 0.5 - 0.25]);
        // Greedy: token 0 leads, but repeated three times it falls below the unseen token 2.
        let s = Sampler::new(p).unwrap();
        assert!(!s.is_plain_greedy());
        assert_eq!(s.sample(&[3.5, 1.0, 2.0], &[0, 0, 0]), 2);
        // A negative presence penalty favours what was seen.
        let s = Sampler::new(SamplingParams { presence_penalty: -2.0, ..Default::default() }).unwrap();
        assert_eq!(s.sample(&[2.5, 1.0, 2.0], &[1]), 1, "1 + 2 > 2.5");
    }

    #[test]
    fn logit_bias_is_added_first_and_minus_100_bans_a_token() {
        let logits = [5.0f32, 4.0, 1.0];
        let s = Sampler::new(SamplingParams::default()).unwrap().with_logit_bias([(0, -100.0), (7, 50.0)]).unwrap();
        assert!(!s.is_plain_greedy());
        assert_eq!(s.sample(&logits, &[]), 1, "token 0 banned; an id past the vocabulary changes nothing");
        let s = Sampler::new(SamplingParams { temperature: 1.0, seed: 3, ..Default::default() }).unwrap().with_logit_bias([(2, 100.0)]).unwrap();
        assert!((0..50).all(|pos| s.sample(&logits, &vec![0; pos]) == 2), "+100 makes token 2 all but certain");
        // The bias comes before the penalties: a biased token that was seen is still penalised.
        let p = SamplingParams { presence_penalty: 2.0, ..Default::default() };
        let s = Sampler::new(p).unwrap().with_logit_bias([(1, 1.5)]).unwrap();
        assert_eq!(s.sample(&logits, &[1]), 0, "4 + 1.5 - 2 < 5");
        assert!(Sampler::new(SamplingParams::default()).unwrap().with_logit_bias([(0, 0.0)]).unwrap().is_plain_greedy(), "a zero bias is none");
        for bad in [100.5, -101.0, f32::NAN, f32::INFINITY] {
            assert!(matches!(Sampler::new(SamplingParams::default()).unwrap().with_logit_bias([(0, bad)]), Err(GpuWorkerError::InvalidRequest(_))), "{bad}");
        }
    }
}
