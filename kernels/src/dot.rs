//! Activation quantisation and scalar dot products of a weight row with an activation row.
//!
//! As in ggml, each weight type has a "vec-dot type" its activations are converted to first
//! (Q4_1 → Q8_1, Q4_K → Q8_K, F16 → F16, ...); the dot product is then integer per block.
//! These scalar functions are the reference twins of the SIMD kernels in `simd_x86`.

use half::{bf16, f16};

use super::quant::*;

/// The activation format a weight type is multiplied with.
pub fn vec_dot_type(weight: GgmlType) -> GgmlType {
    match weight {
        GgmlType::F32 => GgmlType::F32,
        GgmlType::F16 => GgmlType::F16,
        GgmlType::BF16 => GgmlType::BF16,
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => GgmlType::Q8_0,
        GgmlType::Q4_1 | GgmlType::Q5_1 => GgmlType::Q8_1,
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => GgmlType::Q8K,
        GgmlType::Q8_1 | GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q8K => weight,
    }
}

/// Quantises `x` into `out` (exactly `ty.row_bytes(x.len())` bytes) as activation type `ty`.
///
/// Q8_0/Q8_1 follow ggml's x86 path (`id = 127/amax`, round half to even); Q8_K follows
/// `quantize_row_q8_K_ref`. Panics if the lengths disagree (a caller bug, not input).
/// Q8_0/Q8_1/Q8_K run the AVX-512 kernels where the CPU has them (the same bytes for finite `x`).
pub fn quantize_row(ty: GgmlType, x: &[f32], out: &mut [u8]) {
    assert_eq!(out.len(), ty.row_bytes(x.len()), "quantize_row: output length");
    #[cfg(target_arch = "x86_64")]
    if super::isa() == super::Isa::Avx512 {
        use super::quantize_avx512::{quantize_row_q8, quantize_row_q8_k};
        match ty {
            // SAFETY: AVX-512 F/BW/VL/DQ were detected (`isa()`); the sizes were checked.
            GgmlType::Q8_0 => return unsafe { quantize_row_q8::<false>(x, out) },
            GgmlType::Q8_1 => return unsafe { quantize_row_q8::<true>(x, out) },
            GgmlType::Q8K => return unsafe { quantize_row_q8_k(x, out) },
            _ => {}
        }
    }
    quantize_row_scalar(ty, x, out);
}

/// [`quantize_row`] without the AVX-512 kernel: the twin it is tested against.
pub fn quantize_row_scalar(ty: GgmlType, x: &[f32], out: &mut [u8]) {
    assert_eq!(out.len(), ty.row_bytes(x.len()), "quantize_row: output length");
    match ty {
        GgmlType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            for (b, x) in BlockQ8_0::slice_mut(out).unwrap().iter_mut().zip(x.chunks_exact(32)) {
                let (d, qs, _) = quantize_block_q8(x);
                b.d = f16::from_f32(d).to_le_bytes();
                b.qs = qs.map(|q| q as u8);
            }
        }
        GgmlType::Q8_1 => {
            for (b, x) in BlockQ8_1::slice_mut(out).unwrap().iter_mut().zip(x.chunks_exact(32)) {
                let (d, qs, sum) = quantize_block_q8(x);
                b.d = f16::from_f32(d).to_le_bytes();
                b.s = f16::from_f32(d * sum as f32).to_le_bytes();
                b.qs = qs.map(|q| q as u8);
            }
        }
        GgmlType::Q8K => {
            for (b, x) in BlockQ8K::slice_mut(out).unwrap().iter_mut().zip(x.chunks_exact(QK_K)) {
                quantize_block_q8_k(x, b);
            }
        }
        other => panic!("{other} is not an activation type"),
    }
}

/// One block of 32 to 8 bits: (scale, quants, sum of quants).
#[inline(always)]
fn quantize_block_q8(x: &[f32]) -> (f32, [i8; 32], i32) {
    #[cfg(target_arch = "x86_64")]
    if super::isa() >= super::Isa::Avx2 {
        // SAFETY: AVX2 (which implies SSE4.1's round instruction) was detected.
        return unsafe { quantize_block_q8_avx2(x) };
    }
    quantize_block_q8_body(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_q8_avx2(x: &[f32]) -> (f32, [i8; 32], i32) {
    quantize_block_q8_body(x)
}

#[inline(always)]
fn quantize_block_q8_body(x: &[f32]) -> (f32, [i8; 32], i32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut qs = [0i8; 32];
    let mut sum = 0i32;
    for (q, v) in qs.iter_mut().zip(x) {
        *q = (v * id).round_ties_even() as i8;
        sum += *q as i32;
    }
    (d, qs, sum)
}

/// One block of 256 to Q8_K, compiled for AVX2 where the CPU has it (the same code: rounding
/// becomes one `vroundps` instead of a call to libm's `rintf` per value, which was 3 % of a
/// 1B-shape model's decode step).
fn quantize_block_q8_k(x: &[f32], b: &mut BlockQ8K) {
    #[cfg(target_arch = "x86_64")]
    if super::isa() >= super::Isa::Avx2 {
        // SAFETY: AVX2 (which implies SSE4.1's round instruction) was detected.
        return unsafe { quantize_block_q8_k_avx2(x, b) };
    }
    quantize_block_q8_k_body(x, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_q8_k_avx2(x: &[f32], b: &mut BlockQ8K) {
    quantize_block_q8_k_body(x, b)
}

#[inline(always)]
fn quantize_block_q8_k_body(x: &[f32], b: &mut BlockQ8K) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        *b = BlockQ8K { d: [0; 4], qs: [0; QK_K], bsums: [0; 32] };
        return;
    }
    let iscale = -127.0 / max;
    for (q, &v) in b.qs.iter_mut().zip(x) {
        *q = ((iscale * v).round_ties_even() as i32).min(127) as i8 as u8;
    }
    for j in 0..QK_K / 16 {
        let s: i32 = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i8 as i32).sum();
        b.bsums[2 * j..2 * j + 2].copy_from_slice(&(s as i16).to_le_bytes());
    }
    b.d = (1.0 / iscale).to_le_bytes();
}

/// Scalar reference dot product of a weight row of type `ty` with an activation row already
/// quantised to `vec_dot_type(ty)`. `n` is the number of elements.
pub fn vec_dot_scalar(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    debug_assert_eq!(w.len(), ty.row_bytes(n));
    debug_assert_eq!(a.len(), vec_dot_type(ty).row_bytes(n));
    match ty {
        GgmlType::F32 => {
            // ggml's `ggml_vec_dot_f32` as its AVX-512 build runs it (64 lanes, their tree, the
            // rest in f32), not its scalar fallback's one f64 sum, as for F16 below.
            let floats = |b: &[u8]| b.chunks_exact(4).map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]])).collect::<Vec<f32>>();
            super::ggml_exact::dot_f32(&floats(w), &floats(a))
        }
        GgmlType::F16 => {
            // ggml's `ggml_vec_dot_f16` as its AVX-512 build runs it (64 lanes, their tree, the
            // rest in f64; the AVX2 build has 32 lanes), not its scalar fallback's one f64 sum.
            let widen = |b: &[u8]| b.chunks_exact(2).map(|h| f16_bytes([h[0], h[1]])).collect::<Vec<f32>>();
            super::ggml_exact::dot_f16(&widen(w), &widen(a))
        }
        GgmlType::BF16 => {
            // ggml's AVX-512F `ggml_vec_dot_bf16`: two 16-lane sums over steps of 32 elements,
            // each reduced (`reduce16`) into an f64 sum, the rest in f64. (On CPUs with
            // AVX512-BF16 llama.cpp uses `vdpbf16ps`, whose rounding no portable code repeats.)
            let widen = |b: &[u8]| b.chunks_exact(2).map(|h| bf16::from_le_bytes([h[0], h[1]]).to_f32()).collect::<Vec<f32>>();
            let (w, a) = (widen(w), widen(a));
            let n32 = w.len().min(a.len()) & !31;
            let (mut c1, mut c2) = ([0f32; 16], [0f32; 16]);
            for i in (0..n32).step_by(32) {
                for l in 0..16 {
                    c1[l] += w[i + l] * a[i + l];
                    c2[l] += w[i + 16 + l] * a[i + 16 + l];
                }
            }
            let mut s = super::ggml_exact::reduce16(&c1) as f64;
            s += super::ggml_exact::reduce16(&c2) as f64;
            for i in n32..w.len().min(a.len()) {
                s += (w[i] * a[i]) as f64;
            }
            s as f32
        }
        GgmlType::Q4_0 => pairs::<BlockQ4_0, BlockQ8_0>(w, a, |x, y| {
            let mut sumi = 0i32;
            for j in 0..16 {
                sumi += ((x.qs[j] & 0xF) as i32 - 8) * y.qs[j] as i8 as i32;
                sumi += ((x.qs[j] >> 4) as i32 - 8) * y.qs[j + 16] as i8 as i32;
            }
            sumi as f32 * (f16_bytes(x.d) * f16_bytes(y.d))
        }),
        GgmlType::Q4_1 => pairs::<BlockQ4_1, BlockQ8_1>(w, a, |x, y| {
            let mut sumi = 0i32;
            for j in 0..16 {
                sumi += (x.qs[j] & 0xF) as i32 * y.qs[j] as i8 as i32;
                sumi += (x.qs[j] >> 4) as i32 * y.qs[j + 16] as i8 as i32;
            }
            (f16_bytes(x.d) * f16_bytes(y.d)) * sumi as f32 + f16_bytes(x.m) * f16_bytes(y.s)
        }),
        GgmlType::Q5_0 => pairs::<BlockQ5_0, BlockQ8_0>(w, a, |x, y| {
            let q = q5_values(x.qh, &x.qs);
            let sumi: i32 = q.iter().zip(&y.qs).map(|(&q, &v)| (q as i32 - 16) * v as i8 as i32).sum();
            sumi as f32 * (f16_bytes(x.d) * f16_bytes(y.d))
        }),
        GgmlType::Q5_1 => pairs::<BlockQ5_1, BlockQ8_1>(w, a, |x, y| {
            let q = q5_values(x.qh, &x.qs);
            let sumi: i32 = q.iter().zip(&y.qs).map(|(&q, &v)| q as i32 * v as i8 as i32).sum();
            (f16_bytes(x.d) * f16_bytes(y.d)) * sumi as f32 + f16_bytes(x.m) * f16_bytes(y.s)
        }),
        GgmlType::Q8_0 => pairs::<BlockQ8_0, BlockQ8_0>(w, a, |x, y| {
            let sumi: i32 = x.qs.iter().zip(&y.qs).map(|(&q, &v)| q as i8 as i32 * v as i8 as i32).sum();
            sumi as f32 * (f16_bytes(x.d) * f16_bytes(y.d))
        }),
        GgmlType::Q4K => pairs::<BlockQ4K, BlockQ8K>(w, a, |x, y| {
            let (mut sum_sc, mut sum_m) = (0i32, 0i32);
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, &x.scales);
                let q = &x.qs[32 * (j / 2)..32 * (j / 2) + 32];
                let shift = 4 * (j % 2);
                let dot: i32 = (0..32).map(|l| ((q[l] >> shift) & 0xF) as i32 * y.qs[32 * j + l] as i8 as i32).sum();
                sum_sc += sc as i32 * dot;
                sum_m += m as i32 * (y.bsum(2 * j) + y.bsum(2 * j + 1));
            }
            y.scale() * (f16_bytes(x.d) * sum_sc as f32) - y.scale() * f16_bytes(x.dmin) * sum_m as f32
        }),
        GgmlType::Q5K => pairs::<BlockQ5K, BlockQ8K>(w, a, |x, y| {
            let (mut sum_sc, mut sum_m) = (0i32, 0i32);
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, &x.scales);
                let q = &x.qs[32 * (j / 2)..32 * (j / 2) + 32];
                let shift = 4 * (j % 2);
                let dot: i32 = (0..32)
                    .map(|l| {
                        let hi = ((x.qh[l] >> j) & 1) << 4;
                        (((q[l] >> shift) & 0xF) | hi) as i32 * y.qs[32 * j + l] as i8 as i32
                    })
                    .sum();
                sum_sc += sc as i32 * dot;
                sum_m += m as i32 * (y.bsum(2 * j) + y.bsum(2 * j + 1));
            }
            y.scale() * (f16_bytes(x.d) * sum_sc as f32) - y.scale() * f16_bytes(x.dmin) * sum_m as f32
        }),
        GgmlType::Q6K => pairs::<BlockQ6K, BlockQ8K>(w, a, |x, y| {
            let q = q6k_values(x);
            let mut sumi = 0i32;
            for j in 0..16 {
                let dot: i32 = (16 * j..16 * j + 16).map(|l| q[l] as i32 * y.qs[l] as i8 as i32).sum();
                sumi += x.scales[j] as i8 as i32 * dot;
            }
            f16_bytes(x.d) * y.scale() * sumi as f32
        }),
        GgmlType::Q8_1 | GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q8K => {
            panic!("{ty} is not a weight type Duet multiplies with")
        }
    }
}

#[inline(always)]
fn pairs<W: ByteBlock, A: ByteBlock>(w: &[u8], a: &[u8], f: impl Fn(&W, &A) -> f32) -> f32 {
    let (w, a) = (W::slice(w).unwrap(), A::slice(a).unwrap());
    w.iter().zip(a).map(|(x, y)| f(x, y)).sum()
}
