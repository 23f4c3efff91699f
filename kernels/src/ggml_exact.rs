//! f32 arithmetic in the order and rounding of llama.cpp's x86 CPU path (AVX-512 build), so
//! that Duet's CPU device reproduces the reference's numbers, not just approximates them.
//!
//! Why it matters: the model's activations are quantised to 8 bits per block of 32, and a
//! block holding one of the model's large outlier activations quantises everything else in it
//! coarsely; a last-bit difference upstream then flips a rounding and moves log-probabilities
//! by up to ~0.3. Matching the reference within 0.02 needs the same summation trees, the same
//! fused multiply-adds and the same `exp` approximation (ggml's `ggml_v_expf`).

/// `ggml_v_expf` (AVX-512 variant) for one lane: max error 1.45 ulp; flushes to 0 below
/// -103.97 and to infinity above 88.38.
#[inline(always)]
pub fn expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r); // log2(e)
    let n = z - r;
    // fnmadd(a, b, c) = c - a*b with one rounding = fma(-a, b, c).
    let b = (-n).mul_add(f32::from_bits(0x35bf_be8e), (-n).mul_add(f32::from_bits(0x3f31_7200), x));
    let u = b * b;
    let p43 = f32::from_bits(0x3c07_2010).mul_add(b, f32::from_bits(0x3d2b_9f17));
    let p21 = f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb));
    let p10 = f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0);
    let j = p43.mul_add(u, p21).mul_add(u, p10);
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // vscalefps: j * 2^n rounded once (n is integral here; the f64 product is exact).
    let pow2 = f64::from_bits(((n as i64 + 1023) as u64) << 52);
    (j as f64 * pow2) as f32
}

/// ggml's vectorised SiLU lane: `x / (1 + expf(0 - x))`.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + expf(0.0 - x))
}

/// `_mm512_reduce_add_ps` on 16 lanes: halves added pairwise down to one.
#[inline(always)]
pub fn reduce16(v: &[f32; 16]) -> f32 {
    let mut t8 = [0f32; 8];
    for i in 0..8 {
        t8[i] = v[i + 8] + v[i];
    }
    let t4 = [t8[4] + t8[0], t8[5] + t8[1], t8[6] + t8[2], t8[7] + t8[3]];
    (t4[0] + t4[2]) + (t4[1] + t4[3])
}

/// `GGML_F32x16_REDUCE` of four 16-lane accumulators (lane `i` of the 64 holds the elements
/// whose index is `i` mod 64).
#[inline(always)]
pub fn reduce64(acc: &[f32; 64]) -> f32 {
    let mut h = [0f32; 16];
    for i in 0..16 {
        h[i] = (acc[i] + acc[i + 32]) + (acc[i + 16] + acc[i + 48]);
    }
    reduce16(&h)
}

/// tinyBLAS's (llamafile's) dot product, which llama.cpp runs for batches of query tokens: 16
/// lanes of fused multiply-adds over the 16-element chunks in order, then `reduce16`. Elements
/// past the last whole chunk are ignored: callers use it for lengths that are multiples of 16.
#[inline(always)]
pub fn dot_tiled(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    for (cx, cy) in x.chunks_exact(16).zip(y.chunks_exact(16)) {
        for l in 0..16 {
            acc[l] = cx[l].mul_add(cy[l], acc[l]);
        }
    }
    reduce16(&acc)
}

/// `ggml_vec_dot_f16` on values already widened from f16: fused multiply-adds into 64 lanes
/// for the first `n & !63` elements, the tree reduction, then the rest added in f64.
#[inline(always)]
pub fn dot_f16(x: &[f32], y: &[f32]) -> f32 {
    let (lanes, np) = fma_lanes64(x, y);
    let mut sum = lanes as f64;
    for i in np..x.len().min(y.len()) {
        sum += (x[i] * y[i]) as f64;
    }
    sum as f32
}

/// `ggml_vec_dot_f32` as llama.cpp's AVX-512 build runs it (four 16-lane registers; its AVX2
/// build has 32 lanes): the lanes of [`dot_f16`], then the rest added in f32 (its running sum
/// is a float, not a double).
#[inline(always)]
pub fn dot_f32(x: &[f32], y: &[f32]) -> f32 {
    let (mut sum, np) = fma_lanes64(x, y);
    for i in np..x.len().min(y.len()) {
        sum += x[i] * y[i];
    }
    sum
}

/// The first `n & !63` elements' products fused-multiply-added into 64 lanes and reduced by
/// [`reduce64`] (0 if there are none), and that count.
#[inline(always)]
fn fma_lanes64(x: &[f32], y: &[f32]) -> (f32, usize) {
    let np = x.len().min(y.len()) & !63;
    let mut acc = [0f32; 64];
    for i in (0..np).step_by(64) {
        for l in 0..64 {
            acc[l] = x[i + l].mul_add(y[i + l], acc[l]);
        }
    }
    (if np > 0 { reduce64(&acc) } else { 0.0 }, np)
}

/// `ggml_vec_soft_max_f32` + normalisation over `x[..n_padded]` where only `x[..n]` is real
/// (the rest is masked to -inf, i.e. contributes 0): leaves the probabilities of `x[..n]` in
/// `x` and returns the log-sum-exp of the input, `max + ln(sum)` (the sum before
/// normalisation), with which softmaxes over disjoint parts of a row merge.
#[inline(always)]
pub fn softmax_in_place(x: &mut [f32]) -> f32 {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f64;
    for chunk in x.chunks_mut(16) {
        let mut lanes = [0f32; 16];
        for (l, v) in lanes.iter_mut().zip(chunk.iter_mut()) {
            *v = expf(*v - max);
            *l = *v;
        }
        sum += reduce16(&lanes) as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
    (max as f64 + sum.ln()) as f32
}

/// ggml's `ggml_soft_max` of one row of any length as its AVX-512 build computes it: whole
/// chunks of 16 with ggml's `exp` summed by `reduce16`, the tail with libm's `expf` summed one
/// by one (in f64), then scaled by `1 / sum` (the MoE router's probabilities).
pub fn soft_max_row(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let whole = x.len() / 16 * 16;
    let mut sum = 0f64;
    for chunk in x[..whole].chunks_exact_mut(16) {
        let mut lanes = [0f32; 16];
        for (l, v) in lanes.iter_mut().zip(chunk.iter_mut()) {
            *v = expf(*v - max);
            *l = *v;
        }
        sum += reduce16(&lanes) as f64;
    }
    for v in &mut x[whole..] {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expf_is_within_two_ulp_of_libm_in_range() {
        for i in -2000..2000 {
            let x = i as f32 * 0.0437;
            let (a, b) = (expf(x), x.exp());
            let ulp = (a.to_bits() as i64 - b.to_bits() as i64).abs();
            assert!(ulp <= 2, "x={x}: {a} vs {b}");
        }
        assert_eq!(expf(-200.0), 0.0);
        assert_eq!(expf(200.0), f32::INFINITY);
        assert_eq!(expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(expf(0.0), 1.0);
    }

    #[test]
    fn reductions_sum_every_lane() {
        let v: [f32; 64] = std::array::from_fn(|i| i as f32);
        assert_eq!(reduce64(&v), (0..64).sum::<i32>() as f32);
        let x: Vec<f32> = (0..100).map(|i| (i % 7) as f32 - 3.0).collect();
        let y: Vec<f32> = (0..100).map(|i| (i % 5) as f32 * 0.5).collect();
        let exact: f64 = x.iter().zip(&y).map(|(a, b)| (a * b) as f64).sum();
        assert_eq!(dot_f16(&x, &y) as f64, exact);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
        let lse_exact = x.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
        let lse = softmax_in_place(&mut x);
        assert!((lse as f64 - lse_exact).abs() < 2e-6, "{lse} vs {lse_exact}");
        let s: f32 = x.iter().sum();
        assert!((s - 1.0).abs() < 1e-5);
        assert!(x.iter().all(|&p| p > 0.0));
    }
}
