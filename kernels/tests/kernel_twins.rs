//! Fast kernels against their scalar twins, and the scalar twins against f64 arithmetic, on random odd-size inputs.
//!
//! * `kernels::vec_dot` (the SIMD dispatch) against `dot::vec_dot_scalar`, for every weight
//!   type, within a rounding-level tolerance (the SIMD kernels sum in another order and use fma).
//! * `vec_dot_scalar` against the f64 dot of the dequantised weights with (1) the dequantised
//!   activations, to rounding level, and (2) the original f32 activations, within a bound
//!   derived per type from the activation quantisation (8-bit per block, f16, bf16).
//! * `quantize_row` for Q8_0 / Q8_1 / Q8_K: round trip within half a step, `s = d * sum(q)`,
//!   `bsums` the sums of 16 quants, zero blocks all zero.
//! * `matmul::matmul` over several batch rows equals `vec_dot` row by row, bit for bit.
//!
//! Each instruction set's product kernels called directly (the interleaved layout's, the
//! AVX2 and AVX-512 block and tile kernels) are in `isa_kernel_twins.rs`.
//!
//! Weights are random valid blocks (random bytes with random finite f16 scales), activations
//! random f32 with a different magnitude per block; the seed is fixed.

use duet_kernels::dot::{quantize_row, vec_dot_scalar, vec_dot_type};
use duet_kernels::matmul::{matmul, QMatrix, QuantizedActs};
use duet_kernels::quant::{dequantize, BlockQ8K, BlockQ8_1, ByteBlock, GgmlType, QK_K};
use duet_kernels::{self as kernels, Isa};
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
use common::{quantized, random_acts, random_f16, random_weight_row, sizes, ROWS_PER_SIZE};

const WEIGHT_TYPES: [GgmlType; 11] = GgmlType::WEIGHT_TYPES;

const EPS: f64 = f32::EPSILON as f64;

fn dequantized(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    dequantize(ty, bytes, &mut v).unwrap();
    v
}

/// The values an activation row of type `aty` stands for, by the format's definition
/// (`x = q * d`), in f64.
fn act_values(aty: GgmlType, a: &[u8], n: usize) -> Vec<f64> {
    match aty {
        GgmlType::Q8_1 => BlockQ8_1::slice(a)
            .unwrap()
            .iter()
            .flat_map(|b| {
                let d = f16::from_le_bytes(b.d).to_f64();
                b.qs.iter().map(move |&q| q as i8 as f64 * d)
            })
            .collect(),
        GgmlType::Q8K => BlockQ8K::slice(a)
            .unwrap()
            .iter()
            .flat_map(|b| {
                let d = b.scale() as f64;
                b.qs.iter().map(move |&q| q as i8 as f64 * d)
            })
            .collect(),
        _ => dequantized(aty, a, n).into_iter().map(f64::from).collect(),
    }
}

/// A weight row split into its scaled part and its offset part (`w = scaled + offset`): for
/// Q4_1/Q5_1 `d*q` and `m`, for Q4_K/Q5_K `d*sc*q` and `-dmin*m`, found by dequantising the
/// row with the other field zeroed. Other types have no offset.
struct Parts {
    scaled: Vec<f64>,
    offset: Vec<f64>,
}

fn weight_parts(ty: GgmlType, w: &[u8], n: usize) -> Parts {
    let zeroing = |off: usize| {
        let mut c = w.to_vec();
        for b in c.chunks_exact_mut(ty.block_bytes()) {
            b[off..off + 2].fill(0);
        }
        dequantized(ty, &c, n).into_iter().map(f64::from).collect::<Vec<_>>()
    };
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => {
            Parts { scaled: zeroing(2), offset: zeroing(0) }
        }
        _ => Parts { scaled: dequantized(ty, w, n).into_iter().map(f64::from).collect(), offset: vec![0.0; n] },
    }
}

fn uses_q8_1(ty: GgmlType) -> bool {
    vec_dot_type(ty) == GgmlType::Q8_1
}

/// The Q8_1 `s` fields of an activation row.
fn q8_1_sums(a: &[u8]) -> Vec<f64> {
    BlockQ8_1::slice(a).unwrap().iter().map(|b| f16::from_le_bytes(b.s).to_f64()).collect()
}

/// f64 dot of the dequantised weights with the dequantised activations (ggml's definition of
/// the product, the Q8_1 block sums `s` standing in for `d * sum(q)`), and the magnitude
/// `sum |terms|` that rounding errors scale with.
fn exact_reference(ty: GgmlType, p: &Parts, a: &[u8], n: usize) -> (f64, f64) {
    let aq = act_values(vec_dot_type(ty), a, n);
    if uses_q8_1(ty) {
        let s = q8_1_sums(a);
        let mut r: f64 = p.scaled.iter().zip(&aq).map(|(w, a)| w * a).sum();
        let mut mag: f64 = p.scaled.iter().zip(&aq).map(|(w, a)| (w * a).abs()).sum();
        for (b, s) in s.iter().enumerate() {
            let m = p.offset[32 * b];
            r += m * s;
            mag += (m * s).abs();
        }
        (r, mag)
    } else {
        let r = (0..n).map(|i| (p.scaled[i] + p.offset[i]) * aq[i]).sum();
        let mag = (0..n).map(|i| (p.scaled[i].abs() + p.offset[i].abs()) * aq[i].abs()).sum();
        (r, mag)
    }
}

/// Rounding tolerance of an f32 dot product over `n_blocks` blocks with magnitude `mag`.
fn rounding_tol(n_blocks: usize, mag: f64) -> f64 {
    2.0 * (n_blocks as f64 + 8.0) * EPS * mag + 1e-30
}

/// Per-element bound on |activation as quantised - x|, and per-block bound on
/// |Q8_1 s - d_f16 * sum(q)| (empty for other activation types).
fn act_error_bounds(aty: GgmlType, x: &[f32], a: &[u8]) -> (Vec<f64>, Vec<f64>) {
    let n = x.len();
    match aty {
        GgmlType::F32 => (vec![0.0; n], vec![]),
        // Round to nearest: half an ulp (2^-11 relative for f16, 2^-8 for bf16), or half the
        // spacing of the subnormals.
        GgmlType::F16 => (x.iter().map(|v| v.abs() as f64 * 2f64.powi(-11) + 2f64.powi(-25)).collect(), vec![]),
        GgmlType::BF16 => (x.iter().map(|v| v.abs() as f64 * 2f64.powi(-8) + 1e-38).collect(), vec![]),
        GgmlType::Q8_0 | GgmlType::Q8_1 => {
            // q = round(x * 127/amax), value q * f16(d) with d = amax/127: off by half a step
            // d/2, plus |q| <= 127 times the f16 rounding of d.
            let mut e = Vec::with_capacity(n);
            let mut s_err = Vec::new();
            let d_stored: Vec<f64> =
                a.chunks_exact(aty.block_bytes()).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f64()).collect();
            for (bi, xb) in x.chunks_exact(32).enumerate() {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = (amax / 127.0) as f64;
                let dy = d_stored[bi];
                let eb = d * (0.5 + 1e-4) + 127.0 * (dy - d).abs();
                e.extend(std::iter::repeat_n(eb, 32));
                if aty == GgmlType::Q8_1 {
                    let b = &BlockQ8_1::slice(a).unwrap()[bi];
                    let sumq: f64 = b.qs.iter().map(|&q| q as i8 as f64).sum();
                    s_err.push(
                        (2f64.powi(-11) * (d * sumq).abs()).max(2f64.powi(-25)) * 1.001 + sumq.abs() * (d - dy).abs(),
                    );
                }
            }
            (e, s_err)
        }
        GgmlType::Q8K => {
            let blocks = BlockQ8K::slice(a).unwrap();
            (
                blocks.iter().flat_map(|b| std::iter::repeat_n(b.scale().abs() as f64 * (0.5 + 1e-4), QK_K)).collect(),
                vec![],
            )
        }
        other => panic!("{other} is not an activation type"),
    }
}

fn assert_avx2_used_when_available() {
    #[cfg(target_arch = "x86_64")]
    if kernels::isa_cap().is_none() && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        assert!(kernels::isa() >= Isa::Avx2, "this CPU has AVX2+FMA: the SIMD twins must be the ones tested");
    }
    eprintln!("kernels::isa() = {:?}", kernels::isa());
}

/// (a) The dispatched kernel (SIMD where there is one) against the scalar twin.
#[test]
fn vec_dot_equals_scalar_twin() {
    assert_avx2_used_when_available();
    let mut rng = StdRng::seed_from_u64(0x5eed_0001);
    let mut failures = Vec::new();
    for ty in WEIGHT_TYPES {
        let mut worst = 0f64;
        for n in sizes(ty) {
            for trial in 0..ROWS_PER_SIZE {
                let w = random_weight_row(&mut rng, ty, n);
                let x = random_acts(&mut rng, n);
                let a = quantized(vec_dot_type(ty), &x);
                let fast = kernels::vec_dot(ty, n, &w, &a);
                let slow = vec_dot_scalar(ty, n, &w, &a);
                let (_, mag) = exact_reference(ty, &weight_parts(ty, &w, n), &a, n);
                let tol = rounding_tol(n / ty.block_size(), mag);
                let err = ((fast as f64) - (slow as f64)).abs();
                if !fast.is_finite() || !slow.is_finite() || err > tol {
                    failures.push(format!("{ty} n={n} trial {trial}: vec_dot {fast:e}, scalar {slow:e}, tol {tol:e}"));
                }
                worst = worst.max(err / tol);
            }
        }
        eprintln!("{ty}: largest |vec_dot - scalar| is {:.1}% of its tolerance", 100.0 * worst);
    }
    assert!(failures.is_empty(), "SIMD kernels differ from their scalar twins:\n{}", failures.join("\n"));
}

/// (a) Extreme quants with scales of 1: every product and sum is an exact small integer in
/// f32, so the twins must agree exactly (catches saturation and sign handling in the SIMD code).
#[test]
fn vec_dot_equals_scalar_twin_at_extreme_quants() {
    let n = 32 * 7;
    let one = f16::ONE.to_le_bytes();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0] {
        for (wq, aq) in
            [(0x00u8, 127i8), (0xFF, 127), (0x00, -127), (0xFF, -127), (0x80, -127), (0x7F, 127), (0x0F, -127)]
        {
            let mut w = vec![wq; ty.row_bytes(n)];
            for b in w.chunks_exact_mut(ty.block_bytes()) {
                for &off in ty.f16_field_offsets() {
                    b[off..off + 2].copy_from_slice(&one);
                }
            }
            let aty = vec_dot_type(ty);
            let mut a = vec![aq as u8; aty.row_bytes(n)];
            for b in a.chunks_exact_mut(aty.block_bytes()) {
                b[0..2].copy_from_slice(&one);
                if aty == GgmlType::Q8_1 {
                    b[2..4].copy_from_slice(&f16::from_f32(32.0 * aq as f32).to_le_bytes());
                }
            }
            let (fast, slow) = (kernels::vec_dot(ty, n, &w, &a), vec_dot_scalar(ty, n, &w, &a));
            assert_eq!(
                fast.to_bits(),
                slow.to_bits(),
                "{ty} weight bytes {wq:#04x}, activations {aq}: {fast} vs {slow}"
            );
        }
    }
}

/// (b) The scalar twins against f64 arithmetic on the dequantised operands.
#[test]
fn scalar_dot_matches_f64_reference() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0002);
    let mut failures = Vec::new();
    for ty in WEIGHT_TYPES {
        let aty = vec_dot_type(ty);
        let (mut worst, mut worst_exact) = (0f64, 0f64);
        for n in sizes(ty) {
            for trial in 0..ROWS_PER_SIZE {
                let w = random_weight_row(&mut rng, ty, n);
                let x = random_acts(&mut rng, n);
                let a = quantized(aty, &x);
                let got = vec_dot_scalar(ty, n, &w, &a) as f64;
                let p = weight_parts(ty, &w, n);

                // (1) With the activations as quantised: only rounding separates the two.
                let (r, mag) = exact_reference(ty, &p, &a, n);
                let tol = rounding_tol(n / ty.block_size(), mag);
                if (got - r).abs() > tol {
                    failures.push(format!(
                        "{ty} n={n} trial {trial}: scalar {got:e}, f64 of quantised operands {r:e}, tol {tol:e}"
                    ));
                }
                worst_exact = worst_exact.max((got - r).abs() / tol);

                // (2) With the original f32 activations: the activation quantisation error,
                // bounded per element (and per Q8_1 block sum), weighted by |w|.
                let r2: f64 = (0..n).map(|i| (p.scaled[i] + p.offset[i]) * x[i] as f64).sum();
                let (e, s_err) = act_error_bounds(aty, &x, &a);
                let mut bound: f64 = (0..n).map(|i| (p.scaled[i].abs() + p.offset[i].abs()) * e[i]).sum();
                bound += s_err.iter().enumerate().map(|(b, s)| p.offset[32 * b].abs() * s).sum::<f64>();
                bound += tol + (r2.abs() + bound) * EPS;
                if (got - r2).abs() > bound {
                    failures.push(format!(
                        "{ty} n={n} trial {trial}: scalar {got:e}, f64 of f32 activations {r2:e}, bound {bound:e}"
                    ));
                }
                if bound > 0.0 {
                    worst = worst.max((got - r2).abs() / bound);
                }
            }
        }
        eprintln!(
            "{ty}: largest error {:.1}% of the rounding tolerance against the quantised operands, \
             {:.1}% of the bound against the f32 activations",
            100.0 * worst_exact,
            100.0 * worst
        );
    }
    assert!(failures.is_empty(), "scalar dot products differ from the f64 reference:\n{}", failures.join("\n"));
}

/// (c) The activation quantisers: round trip, scales, block sums.
#[test]
fn activation_quantisers_round_trip() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0003);
    for aty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8K] {
        for n in sizes(if aty == GgmlType::Q8K { GgmlType::Q4K } else { GgmlType::Q4_0 }) {
            for trial in 0..ROWS_PER_SIZE {
                let mut x = random_acts(&mut rng, n);
                if trial == 0 {
                    x[..aty.block_size()].fill(0.0); // a whole zero block
                }
                let a = quantized(aty, &x);
                let aq = act_values(aty, &a, n);
                let (e, s_err) = act_error_bounds(aty, &x, &a);
                let ctx = format!("{aty} n={n} trial {trial}");
                for i in 0..n {
                    assert!(
                        (aq[i] - x[i] as f64).abs() <= e[i],
                        "{ctx}: element {i}: {} -> {} (bound {})",
                        x[i],
                        aq[i],
                        e[i]
                    );
                }
                let bs = aty.block_bytes();
                for (bi, (b, xb)) in a.chunks_exact(bs).zip(x.chunks_exact(aty.block_size())).enumerate() {
                    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let qs: Vec<i32> = match aty {
                        GgmlType::Q8_0 => b[2..34].iter().map(|&q| q as i8 as i32).collect(),
                        GgmlType::Q8_1 => b[4..36].iter().map(|&q| q as i8 as i32).collect(),
                        _ => b[4..4 + QK_K].iter().map(|&q| q as i8 as i32).collect(),
                    };
                    assert!(qs.iter().all(|q| q.abs() <= 127), "{ctx} block {bi}: quant outside -127..=127");
                    if amax == 0.0 {
                        assert!(
                            b.iter().all(|&v| v == 0),
                            "{ctx} block {bi}: a zero block must quantise to zero bytes"
                        );
                        continue;
                    }
                    // The largest magnitude maps to +-127.
                    let imax = xb.iter().position(|v| v.abs() == amax).unwrap();
                    assert_eq!(qs[imax].abs(), 127, "{ctx} block {bi}: the largest |x| must quantise to +-127");
                    let sumq: i32 = qs.iter().sum();
                    match aty {
                        GgmlType::Q8_0 | GgmlType::Q8_1 => {
                            let d = amax / 127.0;
                            assert_eq!(
                                &b[0..2],
                                &f16::from_f32(d).to_le_bytes(),
                                "{ctx} block {bi}: d = f16(amax/127)"
                            );
                            if aty == GgmlType::Q8_1 {
                                // ggml: y.s = FP32_TO_FP16(d * sum(q)), d the f32 scale.
                                let s = f16::from_le_bytes([b[2], b[3]]);
                                assert_eq!(s, f16::from_f32(d * sumq as f32), "{ctx} block {bi}: s = f16(d * sum(q))");
                                let dy = f16::from_le_bytes([b[0], b[1]]).to_f64();
                                assert!(
                                    (s.to_f64() - dy * sumq as f64).abs() <= s_err[bi],
                                    "{ctx} block {bi}: s vs d * sum(q)"
                                );
                            }
                        }
                        _ => {
                            let blk = &BlockQ8K::slice(b).unwrap()[0];
                            for j in 0..QK_K / 16 {
                                assert_eq!(
                                    blk.bsum(j),
                                    qs[16 * j..16 * j + 16].iter().sum::<i32>(),
                                    "{ctx} block {bi}: bsums[{j}]"
                                );
                            }
                            // d = 1/iscale with iscale = -127/max: -127 d is the signed max.
                            let max = xb[imax] as f64;
                            assert!(
                                (-127.0 * blk.scale() as f64 - max).abs() <= 4.0 * EPS * max.abs(),
                                "{ctx} block {bi}: d"
                            );
                            assert_eq!(qs[imax], -127, "{ctx} block {bi}: the signed max maps to -127");
                        }
                    }
                }
            }
        }
    }
}

/// (d) The matrix product over a batch equals the row-by-row dot products, bit for bit, and
/// its activation rows are `quantize_row`'s.
#[test]
fn matmul_equals_per_row_vec_dot() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0004);
    for ty in WEIGHT_TYPES {
        let cols = sizes(ty)[1];
        for rows in [1usize, 7, 37] {
            for batch in [1usize, 3, 5, 17, 40] {
                let data: Vec<u8> = (0..rows).flat_map(|_| random_weight_row(&mut rng, ty, cols)).collect();
                let w = QMatrix::new(ty, rows, cols, &data);
                let x = random_acts(&mut rng, cols * batch);
                let acts = QuantizedActs::new(ty, &x, cols);
                assert_eq!(acts.n_rows, batch);
                let mut out = vec![f32::NAN; rows * batch];
                matmul(&w, &acts, &mut out);
                for t in 0..batch {
                    let a = quantized(vec_dot_type(ty), &x[t * cols..(t + 1) * cols]);
                    assert_eq!(acts.row(t), &a[..], "{ty} batch row {t}: QuantizedActs differs from quantize_row");
                    for r in 0..rows {
                        let want = kernels::vec_dot(ty, cols, w.row(r), &a);
                        let got = out[t * rows + r];
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{ty} {rows}x{cols} batch {batch}: out[{t}][{r}] = {got:e}, vec_dot {want:e}"
                        );
                    }
                }
            }
        }
    }
}

/// The four-row kernels give, bit for bit, what four single-row `vec_dot` calls give.
#[test]
fn four_row_kernels_equal_four_single_rows() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0004);
    for ty in WEIGHT_TYPES {
        for n in sizes(ty) {
            let w = random_weight_row(&mut rng, ty, n);
            let acts: Vec<Vec<u8>> = (0..4).map(|_| quantized(vec_dot_type(ty), &random_acts(&mut rng, n))).collect();
            let rows = [acts[0].as_slice(), &acts[1], &acts[2], &acts[3]];
            let four = kernels::vec_dot_x4(ty, n, &w, rows);
            for (r, a) in rows.iter().enumerate() {
                let one = kernels::vec_dot(ty, n, &w, a);
                assert_eq!(four[r].to_bits(), one.to_bits(), "{ty} n={n} row {r}: {} vs {one}", four[r]);
            }
        }
    }
}

/// The four-weight-row kernels (AVX-512, with and without VNNI, where the CPU has them) and
/// their dispatch `vec_dot_r4` against four single-row `vec_dot` calls, bit for bit.
#[test]
fn four_weight_row_kernels_equal_four_single_rows() {
    let mut rng = StdRng::seed_from_u64(0x5eed_0005);
    for ty in WEIGHT_TYPES {
        for n in sizes(ty).into_iter().chain([ty.block_size() * 96]) {
            let ws: Vec<Vec<u8>> = (0..4).map(|_| random_weight_row(&mut rng, ty, n)).collect();
            let w = [ws[0].as_slice(), &ws[1], &ws[2], &ws[3]];
            let a = quantized(vec_dot_type(ty), &random_acts(&mut rng, n));
            let single = w.map(|w| kernels::vec_dot(ty, n, w, &a));
            let mut variants = vec![("vec_dot_r4", kernels::vec_dot_r4(ty, n, w, &a))];
            #[cfg(target_arch = "x86_64")]
            if kernels::isa() == Isa::Avx512 {
                use duet_kernels::matvec_avx512 as m;
                // SAFETY: AVX-512 (and VNNI where called) detected; rows are whole blocks.
                unsafe {
                    match ty {
                        GgmlType::Q4_0 => variants.push(("q4_0 r4", m::dot_q4_0_q8_0_r4(w, &a))),
                        GgmlType::Q4_1 => variants.push(("q4_1 r4", m::dot_q4_1_q8_1_r4(w, &a))),
                        GgmlType::Q8_0 => variants.push(("q8_0 r4", m::dot_q8_0_q8_0_r4(w, &a))),
                        _ => {}
                    }
                    if kernels::has_vnni() {
                        match ty {
                            GgmlType::Q4_0 => variants.push(("q4_0 r4 vnni", m::dot_q4_0_q8_0_r4_vnni(w, &a))),
                            GgmlType::Q4_1 => variants.push(("q4_1 r4 vnni", m::dot_q4_1_q8_1_r4_vnni(w, &a))),
                            GgmlType::Q8_0 => variants.push(("q8_0 r4 vnni", m::dot_q8_0_q8_0_r4_vnni(w, &a))),
                            _ => {}
                        }
                    }
                }
            }
            for (name, four) in variants {
                for r in 0..4 {
                    assert_eq!(four[r].to_bits(), single[r].to_bits(), "{name} {ty} n={n} row {r}: {} vs {}", four[r], single[r]);
                }
            }
        }
    }
}

/// The KV helpers used by decode attention: `dot_f16_head` (heads of 64 and 128) is
/// bit-identical to `ggml_exact::dot_f16` (the same products and reduction tree),
/// `dot_tiled_head` to `ggml_exact::dot_tiled`, `widen_f16` to the scalar
/// widening — on random values, exact zeros of both signs, and magnitudes far apart.
#[test]
fn attention_kv_helpers_equal_their_scalar_twins_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(64);
    head_dots_equal_their_twins::<64>(&mut rng);
    head_dots_equal_their_twins::<128>(&mut rng);
    for n in [0, 1, 7, 8, 9, 63, 64, 65, 1000] {
        let src: Vec<f16> = (0..n).map(|_| random_f16(&mut rng)).collect();
        let (mut fast, mut twin) = (vec![0f32; n], vec![0f32; n]);
        kernels::widen_f16(&src, &mut fast);
        kernels::widen_f16_scalar(&src, &mut twin);
        assert!(fast.iter().zip(&twin).all(|(a, b)| a.to_bits() == b.to_bits()), "widen_f16 at n = {n}");
    }
    assert_avx2_used_when_available();
}

fn head_dots_equal_their_twins<const N: usize>(rng: &mut StdRng) {
    use duet_kernels::ggml_exact::{dot_f16, dot_tiled};
    for case in 0..2000 {
        let mut x = [0f32; N];
        let mut y = [0f32; N];
        for i in 0..N {
            let scale = 10f32.powi(rng.random_range(-6..6));
            x[i] = f16::from_f32(rng.random_range(-1.0f32..1.0) * scale.min(60000.0)).to_f32();
            y[i] = rng.random_range(-1.0f32..1.0) * scale;
            match (case + i) % 17 {
                0 => x[i] = 0.0,
                1 => x[i] = -0.0,
                2 => y[i] = -0.0,
                _ => {}
            }
        }
        let (fast, twin) = (kernels::dot_f16_head(&x, &y), dot_f16(&x, &y));
        assert_eq!(fast.to_bits(), twin.to_bits(), "head of {N}, case {case}: {fast} vs {twin}");
        let (fast, twin) = (kernels::dot_tiled_head(&x, &y), dot_tiled(&x, &y));
        assert_eq!(fast.to_bits(), twin.to_bits(), "head of {N}, case {case}, tinyBLAS order: {fast} vs {twin}");
    }
}

/// RoPE with hardware FMA (when the CPU has it) against the same multiply-adds done by
/// `f32::mul_add` here (a correctly rounded fused multiply-add either way): bit for bit.
#[test]
fn rope_equals_its_scalar_twin_bit_for_bit() {
    use duet_kernels::ops::Rope;
    let mut rng = StdRng::seed_from_u64(5);
    for n in [2usize, 6, 64, 128] {
        let table: Vec<(f32, f32)> = (0..n / 2).map(|_| (rng.random_range(-1.0..1.0), rng.random_range(-1.0..1.0))).collect();
        let head: Vec<f32> = (0..n).map(|_| rng.random_range(-100.0..100.0)).collect();
        let mut got = head.clone();
        Rope::apply(&table, &mut got);
        let want: Vec<f32> = head
            .chunks_exact(2)
            .zip(&table)
            .flat_map(|(p, &(c, s))| [p[0].mul_add(c, -(p[1] * s)), p[0].mul_add(s, p[1] * c)])
            .collect();
        assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "head of {n}");
        // NeoX: pair i is (x[i], x[i + n/2]).
        let mut got = head.clone();
        Rope::apply_neox(&table, &mut got);
        let mut want = head.clone();
        for (i, &(c, s)) in table.iter().enumerate() {
            let (x0, x1) = (head[i], head[i + n / 2]);
            want[i] = x0.mul_add(c, -(x1 * s));
            want[i + n / 2] = x0.mul_add(s, x1 * c);
        }
        assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "NeoX head of {n}");
    }
}

/// Activation quantisation to Q8_0 / Q8_1 / Q8_K on the dispatched path (the AVX-512 kernels
/// where the CPU has them) against the scalar twin, byte for byte: odd block counts, scales from
/// tiny to huge, an all-zero block, values that land exactly halfway between two quants, and
/// the largest magnitude twice with both signs (the first sets the scale).
#[test]
fn q8_quantisation_equals_scalar_twin_byte_for_byte() {
    use duet_kernels::dot::quantize_row_scalar;
    if kernels::isa() != Isa::Avx512 {
        println!("SKIPPED: this CPU has no AVX-512; quantize_row is its scalar twin here");
    }
    let mut rng = StdRng::seed_from_u64(0x5eed_0008);
    for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8K] {
        let bs = ty.block_size();
        for blocks in [1usize, 3, 18, 47] {
            for scale in [1e-30f32, 1e-3, 1.0, 7.5, 1e30] {
                let mut x: Vec<f32> = (0..blocks * bs).map(|_| rng.random_range(-1.0f32..1.0) * scale).collect();
                // Block 0 all zero when there are several; in the last block, amax = 127 and
                // values at k + 0.5 (ties, rounded to even); -127 twice after it, in the same vector of
                // sixteen and in the next.
                if blocks > 1 {
                    x[..bs].fill(0.0);
                }
                let last = (blocks - 1) * bs;
                x[last + 3] = 127.0;
                x[last + 14] = -127.0;
                x[last + 20] = -127.0;
                for (i, v) in x[last + 4..last + 12].iter_mut().enumerate() {
                    *v = i as f32 - 3.5;
                }
                let (mut got, mut want) = (vec![0u8; ty.row_bytes(x.len())], vec![0u8; ty.row_bytes(x.len())]);
                quantize_row(ty, &x, &mut got);
                quantize_row_scalar(ty, &x, &mut want);
                assert_eq!(got, want, "{ty} {blocks} blocks, scale {scale:e}");
            }
        }
    }
}

/// `silu_mul` on the dispatched path (AVX-512 sixteen lanes at a time where the CPU has it)
/// against the scalar twin, bit for bit: odd lengths (a scalar tail), inputs from tiny to past
/// `expf`'s overflow and underflow limits.
#[test]
fn silu_mul_equals_scalar_twin_bit_for_bit() {
    use duet_kernels::ops::{silu_mul, silu_mul_scalar};
    let mut rng = StdRng::seed_from_u64(0x5eed_0051);
    for n in [1usize, 15, 16, 17, 1536, 1543] {
        for range in [1e-3f32, 1.0, 20.0, 200.0] {
            let gate: Vec<f32> = (0..n).map(|_| rng.random_range(-range..range)).collect();
            let up: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let (mut got, mut want) = (gate.clone(), gate.clone());
            silu_mul(&mut got, &up);
            silu_mul_scalar(&mut want, &up);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "n {n}, inputs within ±{range}");
        }
    }
}

/// F32 · F32, F16 · F16 and BF16 · BF16 on the dispatched path (the AVX-512 kernels where the
/// CPU has them) against the scalar twins (ggml's x86 orders), bit for bit: lengths below, at
/// and past multiples of their 64 and 32 lanes.
#[test]
fn float_dots_equal_scalar_twins_bit_for_bit() {
    let mut rng = StdRng::seed_from_u64(0x5eed_00f1);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for n in [1usize, 31, 32, 33, 63, 64, 65, 200, 576, 4096 + 7] {
            for _ in 0..4 {
                let w = random_weight_row(&mut rng, ty, n);
                let a = quantized(ty, &random_acts(&mut rng, n));
                let (fast, slow) = (kernels::vec_dot(ty, n, &w, &a), vec_dot_scalar(ty, n, &w, &a));
                assert_eq!(fast.to_bits(), slow.to_bits(), "{ty} n {n}: {fast:e} vs {slow:e}");
            }
        }
    }
}
