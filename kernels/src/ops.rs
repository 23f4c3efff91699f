//! Element-wise and normalisation ops of a Llama layer, with ggml's arithmetic: RMSNorm,
//! rotary position embedding (normal and llama3-scaled), SwiGLU, GeGLU, log-softmax.

/// `out = x / sqrt(mean(x^2) + eps) * weight` (sum of squares in f64, as ggml does).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = (v * scale) * w;
    }
}

/// Rotary embedding tables for one head dimension: frequencies with optional per-pair
/// divisors (llama3-style scaling, ggml's `rope_freqs`).
#[derive(Debug, Clone)]
pub struct Rope {
    pub n_dims: usize,
    theta_scale: f32,
    freq_scale: f32,
    freq_factors: Option<Vec<f32>>,
    /// YaRN's extrapolation mix (0: none) and the pairs its ramp runs between.
    ext_factor: f32,
    corr_dims: [f32; 2],
    /// cos and sin are multiplied by this (ggml's `attn_factor`).
    mscale: f32,
}

impl Rope {
    /// `freq_factors`, when given, holds `n_dims / 2` divisors of each pair's frequency.
    pub fn new(n_dims: usize, freq_base: f32, freq_scale: f32, freq_factors: Option<Vec<f32>>) -> Self {
        let theta_scale = freq_base.powf(-2.0 / n_dims as f32);
        Rope { n_dims, theta_scale, freq_scale, freq_factors, ext_factor: 0.0, corr_dims: [0.0; 2], mscale: 1.0 }
    }

    /// cos and sin scaled by `mscale` (ggml's `attn_factor`: LongRoPE's and YaRN's magnitude).
    pub fn with_mscale(self, mscale: f32) -> Self {
        Rope { mscale, ..self }
    }

    /// YaRN (ggml's `rope_yarn` with `ext_factor`): between the pairs whose wavelengths make
    /// `beta_fast` and `beta_slow` rotations over `n_ctx_orig` positions, a ramp from
    /// extrapolated (unscaled) to interpolated angles; `freq_base` as given to [`Rope::new`].
    pub fn with_yarn(self, ext_factor: f32, n_ctx_orig: usize, freq_base: f32, beta_fast: f32, beta_slow: f32) -> Self {
        let corr_dims = yarn_corr_dims(self.n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow);
        Rope { ext_factor, corr_dims, ..self }
    }

    /// (cos, sin) for each pair at position `pos`, computed as ggml's `rope_cache_init`.
    pub fn table(&self, pos: usize) -> Vec<(f32, f32)> {
        let mut theta = pos as f32;
        (0..self.n_dims / 2)
            .map(|i| {
                let ff = self.freq_factors.as_ref().map_or(1.0, |f| f[i]);
                let extrap = theta / ff;
                let interp = self.freq_scale * extrap;
                theta *= self.theta_scale;
                let (mut t, mut mscale) = (interp, self.mscale);
                if self.ext_factor != 0.0 {
                    let [low, high] = self.corr_dims;
                    let ramp = 1.0 - ((i as f32 - low) / (high - low).max(0.001)).clamp(0.0, 1.0);
                    let mix = ramp * self.ext_factor;
                    t = interp * (1.0 - mix) + extrap * mix;
                    // (GCC contracts ggml's `1 + 0.1 * logf(...)` into a multiply-add.)
                    mscale *= 0.1f32.mul_add((1.0 / self.freq_scale).ln(), 1.0);
                }
                (t.cos() * mscale, t.sin() * mscale)
            })
            .collect()
    }

    /// Rotates consecutive pairs `(x[2i], x[2i+1])` of one head in place (normal, non-NeoX),
    /// with the multiply-adds GCC contracts ggml's `x0*cos - x1*sin` into.
    /// With FMA present the multiply-adds are instructions (bit for bit what the `fmaf` calls
    /// they otherwise compile to return).
    pub fn apply(table: &[(f32, f32)], head: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if super::isa() >= super::Isa::Avx2 {
            // SAFETY: AVX2 and FMA were detected.
            return unsafe { rope_fma(table, head) };
        }
        rope_body(table, head)
    }

    /// Rotates the pairs `(x[i], x[i + n/2])` of one head in place (NeoX's RoPE, Qwen's), with
    /// the same arithmetic as [`Rope::apply`].
    pub fn apply_neox(table: &[(f32, f32)], head: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if super::isa() >= super::Isa::Avx2 {
            // SAFETY: AVX2 and FMA were detected.
            return unsafe { rope_neox_fma(table, head) };
        }
        rope_neox_body(table, head)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rope_neox_fma(table: &[(f32, f32)], head: &mut [f32]) {
    rope_neox_body(table, head)
}

#[inline(always)]
fn rope_neox_body(table: &[(f32, f32)], head: &mut [f32]) {
    let (lo, hi) = head.split_at_mut(head.len() / 2);
    for ((x0, x1), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(table) {
        let (a, b) = (*x0, *x1);
        *x0 = a.mul_add(c, -(b * s));
        *x1 = a.mul_add(s, b * c);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rope_fma(table: &[(f32, f32)], head: &mut [f32]) {
    rope_body(table, head)
}

#[inline(always)]
fn rope_body(table: &[(f32, f32)], head: &mut [f32]) {
    for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(table) {
        let (x0, x1) = (pair[0], pair[1]);
        pair[0] = x0.mul_add(c, -(x1 * s));
        pair[1] = x0.mul_add(s, x1 * c);
    }
}

/// ggml's `ggml_rope_yarn_corr_dims`: the first and last pair YaRN's ramp runs between.
fn yarn_corr_dims(n_dims: usize, n_ctx_orig: usize, freq_base: f32, beta_fast: f32, beta_slow: f32) -> [f32; 2] {
    let corr_dim = |n_rot: f32| n_dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln() / (2.0 * freq_base.ln());
    [corr_dim(beta_fast).floor().max(0.0), corr_dim(beta_slow).ceil().min(n_dims as f32 - 1.0)]
}

/// Llama-3 frequency divisors (what llama.cpp's converter stores as `rope_freqs.weight`).
pub fn llama3_freq_factors(
    n_dims: usize,
    freq_base: f32,
    factor: f32,
    low_freq_factor: f32,
    high_freq_factor: f32,
    original_context: f32,
) -> Vec<f32> {
    let low_wavelen = original_context / low_freq_factor;
    let high_wavelen = original_context / high_freq_factor;
    (0..n_dims / 2)
        .map(|i| {
            let freq = 1.0 / freq_base.powf(2.0 * i as f32 / n_dims as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// `gate = silu(gate) * up`, with ggml's vectorised `x / (1 + expf(-x))`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::isa() == super::Isa::Avx512 {
        // SAFETY: AVX-512 F/BW/VL/DQ (with AVX2, FMA, F16C) were detected.
        return unsafe { silu_mul_avx512(gate, up) };
    }
    #[cfg(target_arch = "x86_64")]
    if super::isa() >= super::Isa::Avx2 {
        // SAFETY: AVX2 and FMA were detected.
        return unsafe { silu_mul_fma(gate, up) };
    }
    silu_mul_body(gate, up)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_fma(gate: &mut [f32], up: &[f32]) {
    silu_mul_body(gate, up)
}

/// Sixteen lanes at a time with ggml's AVX-512 `expf` (the same bits as the scalar body);
/// the tail of fewer than sixteen by the scalar body.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn silu_mul_avx512(gate: &mut [f32], up: &[f32]) {
    use std::arch::x86_64::*;
    let n = gate.len().min(up.len());
    let whole = n - n % 16;
    for i in (0..whole).step_by(16) {
        let x = _mm512_loadu_ps(gate.as_ptr().add(i));
        let e = super::attention_avx512::expf16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        let silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), e));
        _mm512_storeu_ps(gate.as_mut_ptr().add(i), _mm512_mul_ps(silu, _mm512_loadu_ps(up.as_ptr().add(i))));
    }
    silu_mul_body(&mut gate[whole..n], &up[whole..n]);
}

/// The scalar twin of [`silu_mul`]'s SIMD paths.
pub fn silu_mul_scalar(gate: &mut [f32], up: &[f32]) {
    silu_mul_body(gate, up)
}

#[inline(always)]
fn silu_mul_body(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = super::ggml_exact::silu(*g) * u;
    }
}

/// `gate = gelu(gate) * up` (Gemma's GeGLU) as ggml's CPU backend computes it: the tanh
/// approximation of GELU looked up in a table of every f16 input (the gate rounded to f16),
/// except below -10 (0) and from 10 on (the identity).
pub fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    let table = gelu_table();
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * u
        } else {
            half::f16::from_bits(table[half::f16::from_f32(x).to_bits() as usize]).to_f32() * u
        };
    }
}

/// ggml's `ggml_gelu_f32`: `0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))` in f32.
pub fn gelu(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh())
}

/// GELU of every f16 value, rounded to f16 (ggml's `ggml_table_gelu_f16`).
fn gelu_table() -> &'static [u16] {
    static TABLE: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| (0..=u16::MAX).map(|b| half::f16::from_f32(gelu(half::f16::from_bits(b).to_f32())).to_bits()).collect())
}

/// Log-softmax of logits in f64 (for reporting log-probabilities and perplexity).
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&v| v as f64 - lse).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_mul_follows_the_f16_table_and_its_cut_offs() {
        let mut g = [-20.0, -10.0, -1.0, 0.0, 0.5, 3.0, 10.0, 12.0];
        let up = [2.0; 8];
        gelu_mul(&mut g, &up);
        assert_eq!(g[..2], [0.0, 0.0]);
        assert_eq!(g[6..], [20.0, 24.0], "the identity from 10 on");
        for (x, y) in [(-1.0f32, g[2]), (0.5, g[4]), (3.0, g[5])] {
            assert!((y - 2.0 * gelu(x)).abs() <= 2.0 * gelu(x).abs() * 2e-3 + 1e-4, "gelu({x}) * 2 = {y}");
        }
        assert_eq!(g[3], 0.0);
        // The table's input is the gate rounded to f16: two gates of one f16 give one output.
        let (mut a, mut b) = ([0.70001f32], [0.70002f32]);
        gelu_mul(&mut a, &[1.0]);
        gelu_mul(&mut b, &[1.0]);
        assert_eq!(a, b);
    }

    #[test]
    fn llama3_factors_keep_high_frequencies_and_divide_low_ones() {
        // Llama 3.1: base 500000, factor 8, low 1, high 4, original context 8192, 128 dims.
        let f = llama3_freq_factors(128, 500_000.0, 8.0, 1.0, 4.0, 8192.0);
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0, "short wavelengths are not scaled");
        assert_eq!(f[63], 8.0, "long wavelengths are divided by the factor");
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "smooth, monotonic in between: {f:?}");
        assert!(f.iter().any(|&x| x > 1.0 && x < 8.0));
    }

    #[test]
    fn rope_rotates_pairs_by_position_angle() {
        let rope = Rope::new(4, 10000.0, 1.0, None);
        let table = rope.table(3);
        assert!((table[0].0 - 3f32.cos()).abs() < 1e-6 && (table[0].1 - 3f32.sin()).abs() < 1e-6);
        let mut head = [1.0, 0.0, 1.0, 0.0];
        Rope::apply(&table, &mut head);
        assert!((head[0] - 3f32.cos()).abs() < 1e-6 && (head[1] - 3f32.sin()).abs() < 1e-6);
        let mut zero_pos = [0.3, -0.7, 1.1, 2.0];
        Rope::apply(&rope.table(0), &mut zero_pos);
        assert_eq!(zero_pos, [0.3, -0.7, 1.1, 2.0]);
        // NeoX pairs x[0] with x[2]: the first pair's angle moves x[0] and x[2].
        let mut neox = [1.0, 0.0, 0.0, 0.0];
        Rope::apply_neox(&table, &mut neox);
        assert!((neox[0] - 3f32.cos()).abs() < 1e-6 && neox[1] == 0.0 && (neox[2] - 3f32.sin()).abs() < 1e-6);
    }
}
