//! Kernel twins: every CUDA kernel against the CPU kernels it replaces, on random weights of
//! every supported type. Dequantisation must be bit for bit the CPU's; products are checked
//! against an f64 reference on the dequantised weights within the bound their rounding
//! allows (Q8_1 activations: half a quantisation step per element; f16 for cuBLAS: two f16
//! roundings); the row-wise ops within a few f32 ulps of the CPU's. Needs a GPU: without one
//! each test says it was skipped and why, and `DUET_REQUIRE_CUDA=1` makes that a failure.

use duet_kernels::ops::{rms_norm, silu_mul_scalar, Rope};
use duet_kernels::quant::{dequantize, GgmlType};
use half::f16;
use rand::{Rng, SeedableRng};

use super::kernels::Kernels;
use super::launch::{Acts, GpuWeight, Launcher, MQ_TOK, MV_MAX_TOK, MV_PASS_ROWS};
use super::probe;
use crate::device::model::Weight;

/// The kernels on GPU 0, or `None` (having said why) when there is none.
pub(super) fn launcher() -> Option<Launcher> {
    match probe::probe(0) {
        Ok(gpu) => {
            let kernels = Kernels::load(&gpu.ctx, gpu.arch).expect("kernels load");
            // A small workspace, so that the cuBLAS path multiplies in several slices of rows.
            Some(Launcher::new(gpu.ctx.default_stream(), kernels, 1 << 15).expect("launcher"))
        }
        Err(why) => {
            if std::env::var("DUET_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
                panic!("DUET_REQUIRE_CUDA=1 but the CUDA device cannot run: {why}");
            }
            eprintln!("skipped (needs a GPU): {why}");
            None
        }
    }
}

const TYPES: [GgmlType; 11] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
];

/// A random `rows` x `cols` weight of type `ty`: random quants, scales in ±0.05.
fn random_weight(ty: GgmlType, rows: usize, cols: usize, rng: &mut rand::rngs::StdRng) -> Vec<u8> {
    let bytes = ty.row_bytes(cols) * rows;
    match ty {
        GgmlType::F32 => (0..rows * cols).flat_map(|_| rng.random_range(-1.0f32..1.0).to_le_bytes()).collect(),
        GgmlType::F16 => (0..rows * cols).flat_map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes()).collect(),
        GgmlType::BF16 => (0..rows * cols).flat_map(|_| ((rng.random_range(-1.0f32..1.0).to_bits() >> 16) as u16).to_le_bytes()).collect(),
        _ => {
            let mut data: Vec<u8> = (0..bytes).map(|_| rng.random()).collect();
            let block = ty.row_bytes(ty.block_size());
            for b in data.chunks_exact_mut(block) {
                for &off in ty.f16_field_offsets() {
                    b[off..off + 2].copy_from_slice(&f16::from_f32(rng.random_range(-0.05f32..0.05)).to_le_bytes());
                }
            }
            data
        }
    }
}

fn dequant_rows(ty: GgmlType, data: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * cols];
    for (r, o) in out.chunks_exact_mut(cols).enumerate() {
        dequantize(ty, &data[r * ty.row_bytes(cols)..(r + 1) * ty.row_bytes(cols)], o).unwrap();
    }
    out
}

fn upload(k: &Launcher, ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> GpuWeight {
    GpuWeight::upload(&k.stream, &Weight { name: format!("{ty:?}"), ty, rows, cols, first_row: 0 }, data).unwrap()
}

fn down<T: cudarc::driver::DeviceRepr>(k: &Launcher, x: &cudarc::driver::CudaSlice<T>) -> Vec<T> {
    let v = k.stream.clone_dtoh(x).unwrap();
    k.stream.synchronize().unwrap();
    v
}

#[test]
fn dequantisation_is_bit_for_bit_the_cpus_for_every_type() {
    let Some(k) = launcher() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (rows, cols) = (37, 768);
    for ty in TYPES {
        let data = random_weight(ty, rows, cols, &mut rng);
        let want = dequant_rows(ty, &data, rows, cols);
        let w = upload(&k, ty, rows, cols, &data);
        // Embedding rows, in a shuffled order with a repeat.
        let tokens: Vec<u32> = [5u32, 0, 36, 5, 17].to_vec();
        let ids = k.stream.clone_htod(&tokens).unwrap();
        let got = down(&k, &k.get_rows(&w, &ids, tokens.len()).unwrap());
        for (i, &t) in tokens.iter().enumerate() {
            let (g, e) = (&got[i * cols..(i + 1) * cols], &want[t as usize * cols..(t as usize + 1) * cols]);
            let bad = g.iter().zip(e).position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(bad.is_none(), "{ty:?}: get_rows row {t} element {bad:?}: GPU {:?}, CPU {:?}", bad.map(|j| g[j]), bad.map(|j| e[j]));
        }
        // Rows 3..23 as f16, as cuBLAS gets them.
        let mut h = k.stream.alloc_zeros::<u16>(20 * cols).unwrap();
        k.dequant_f16(&w, 3, 20, &mut h).unwrap();
        let got = down(&k, &h);
        for (j, (&g, &e)) in got.iter().zip(&want[3 * cols..23 * cols]).enumerate() {
            assert_eq!(g, f16::from_f32(e).to_bits(), "{ty:?}: dequant_f16 element {j}");
        }
        println!("{ty:?}: dequantisation exact");
    }
}

/// Checks `got` (`[n][rows]`) against the f64 product of `w` (`[rows][cols]`, dequantised) and
/// `x` (`[n][cols]`), each within `bound(row, t)`.
fn check_product(what: &str, got: &[f32], w: &[f32], x: &[f32], rows: usize, cols: usize, bound: impl Fn(usize, usize) -> f64) {
    let n = x.len() / cols;
    let mut worst = 0f64;
    for t in 0..n {
        for r in 0..rows {
            let (wr, xr) = (&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
            let exact: f64 = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
            let err = (got[t * rows + r] as f64 - exact).abs();
            let b = bound(r, t);
            assert!(err <= b, "{what}: token {t} row {r}: GPU {} vs exact {exact}, error {err:.3e} over the bound {b:.3e}", got[t * rows + r]);
            worst = worst.max(err / b);
        }
    }
    println!("{what}: worst error {:.0}% of its bound", worst * 100.0);
}

#[test]
fn linear_layers_match_the_exact_product_within_their_rounding_bound() {
    let Some(mut k) = launcher() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (rows, cols) = (67, 768);
    // The default rule (batches of 9..64 rows on mmq), the same with cuBLAS for them
    // (DUET_CUDA_MMQ=0), and passes of MV_MAX_TOK rows up to 64 (DUET_CUDA_MV_ROWS=64).
    for (ty, pass_rows, mmq) in TYPES.iter().flat_map(|&ty| [(ty, MV_PASS_ROWS, true), (ty, MV_PASS_ROWS, false), (ty, 4 * MV_MAX_TOK, false)]) {
        k.set_mv_pass_rows(pass_rows);
        k.set_mmq(mmq);
        let mmq = mmq && k.kernels().arch >= 80;
        let data = random_weight(ty, rows, cols, &mut rng);
        let wf = dequant_rows(ty, &data, rows, cols);
        let w = upload(&k, ty, rows, cols, &data);
        // MV_MAX_TOK + 5 rows: under passes of 64, two matrix-vector launches for quantised
        // weights; 40 and MQ_TOK: mmq's tiles, the last part empty and all full; 70: cuBLAS
        // for every type.
        for n in [1, 3, MV_PASS_ROWS, MV_PASS_ROWS + 1, MV_MAX_TOK, MV_MAX_TOK + 5, 40, MQ_TOK, 70] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let xd = k.stream.clone_htod(&x).unwrap();
            let got = down(&k, &k.linear(&w, &mut Acts::new(&xd, n, cols)).unwrap());
            let quantised = super::kernels::quant_suffix(ty).is_some();
            let mv_rows = if quantised { pass_rows } else { MV_MAX_TOK.min(pass_rows) };
            // The weight again as three (a layer's Q, K and V) and as two (its gate and up),
            // in one grouped launch where the matrix-vector kernels take it (else one product
            // each): the same bits, wherever a matrix-vector kernel computes the rows (cuBLAS
            // may sum a slice of the rows in another order).
            let parts = |cuts: &[usize]| -> Vec<GpuWeight> {
                let bytes = ty.row_bytes(cols);
                cuts.windows(2).map(|c| upload(&k, ty, c[1] - c[0], cols, &data[c[0] * bytes..c[1] * bytes])).collect()
            };
            let (three, two) = (parts(&[0, 23, 41, rows]), parts(&[0, 30, rows]));
            let acts = || Acts::new(&xd, n, cols);
            let grouped3 = k.linear_group([&three[0], &three[1], &three[2]], &mut acts()).unwrap().iter().map(|y| down(&k, y)).collect::<Vec<_>>();
            let grouped2 = k.linear_group([&two[0], &two[1]], &mut acts()).unwrap().iter().map(|y| down(&k, y)).collect::<Vec<_>>();
            for (what, ys, cuts) in [("three", grouped3, vec![0, 23, 41, rows]), ("two", grouped2, vec![0, 30, rows])].into_iter().filter(|_| n <= mv_rows) {
                for t in 0..n {
                    for (y, c) in ys.iter().zip(cuts.windows(2)) {
                        let r = c[1] - c[0];
                        let same = y[t * r..(t + 1) * r].iter().zip(&got[t * rows + c[0]..t * rows + c[1]]).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{ty:?} n={n}: the grouped launch over {what} weights differs from linear");
                    }
                }
            }
            let abs_dot = |r: usize, t: usize| -> f64 { (0..cols).map(|c| (wf[r * cols + c] as f64 * x[t * cols + c] as f64).abs()).sum() };
            let float_slack = |r: usize, t: usize| 1e-5 * abs_dot(r, t) + 1e-6;
            let on_mmq = quantised && mmq && n > mv_rows && n <= MQ_TOK;
            if n > mv_rows && ty == GgmlType::F32 {
                check_product(&format!("{ty:?} sgemm n={n}"), &got, &wf, &x, rows, cols, float_slack);
            } else if n > mv_rows && !on_mmq {
                // cuBLAS on f16 weights and activations: each product off by two f16 roundings.
                check_product(&format!("{ty:?} gemm n={n}"), &got, &wf, &x, rows, cols, |r, t| 2.0 * 2f64.powi(-11) * abs_dot(r, t) + float_slack(r, t));
            } else if quantised {
                // Q8_1 activations: each element off by at most half a step (amax / 254) of its unit.
                let bound = |r: usize, t: usize| -> f64 {
                    (0..cols / 32)
                        .map(|u| {
                            let xs = &x[t * cols + 32 * u..t * cols + 32 * u + 32];
                            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
                            let wsum: f64 = wf[r * cols + 32 * u..r * cols + 32 * u + 32].iter().map(|&v| (v as f64).abs()).sum();
                            wsum * amax / 254.0
                        })
                        .sum::<f64>()
                        * 1.001
                        + float_slack(r, t)
                };
                check_product(&format!("{ty:?} {} n={n}", if on_mmq { "mmq" } else { "mmvq" }), &got, &wf, &x, rows, cols, bound);
            } else {
                check_product(&format!("{ty:?} mv n={n}"), &got, &wf, &x, rows, cols, float_slack);
            }
        }
    }
}

#[test]
fn row_ops_match_the_cpu() {
    let Some(k) = launcher() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    let (n, d) = (5, 576);
    let x: Vec<f32> = (0..n * d).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    let w: Vec<f32> = (0..d).map(|_| rng.random_range(0.5f32..1.5)).collect();
    let close = |what: &str, got: &[f32], want: &[f32], tol: f32| {
        for (i, (&g, &e)) in got.iter().zip(want).enumerate() {
            assert!((g - e).abs() <= tol * e.abs().max(1.0), "{what} element {i}: GPU {g}, CPU {e}");
        }
    };
    let xd = k.stream.clone_htod(&x).unwrap();
    let wd = k.stream.clone_htod(&w).unwrap();
    // RMS norm (the CPU sums squares in f64, the GPU in f32).
    let got = down(&k, &k.rms_norm(&xd, &wd, n, 1e-5).unwrap());
    let mut want = vec![0f32; n * d];
    for (o, xr) in want.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        rms_norm(xr, &w, 1e-5, o);
    }
    close("rms_norm", &got, &want, 1e-5);
    // RoPE with per-pair divisors, 9 query and 3 key heads of 64 in one launch, 32 dimensions
    // rotated.
    let (q_heads, k_heads, hd, n_rot) = (9, 3, 64, 32);
    let rope = Rope::new(n_rot, 10000.0, 0.5, Some((0..n_rot / 2).map(|i| 1.0 + i as f32 / 4.0).collect()));
    let positions = [0usize, 1, 17, 300, 4095];
    let rows = |heads: usize, rng: &mut rand::rngs::StdRng| -> Vec<f32> { (0..positions.len() * heads * hd).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
    let (q, kr) = (rows(q_heads, &mut rng), rows(k_heads, &mut rng));
    let tables: Vec<f32> = positions.iter().flat_map(|&p| rope.table(p)).flat_map(|(c, s)| [c, s]).collect();
    for neox in [false, true] {
        let (mut qd, mut kd) = (k.stream.clone_htod(&q).unwrap(), k.stream.clone_htod(&kr).unwrap());
        k.rope(&mut qd, &mut kd, &k.stream.clone_htod(&tables).unwrap(), positions.len(), q_heads, k_heads, hd, n_rot, neox).unwrap();
        let apply = if neox { Rope::apply_neox } else { Rope::apply };
        for (what, got, x, heads) in [("queries", &qd, &q, q_heads), ("keys", &kd, &kr, k_heads)] {
            let mut want = x.clone();
            for (row, &p) in want.chunks_exact_mut(heads * hd).zip(&positions) {
                let t = rope.table(p);
                row.chunks_exact_mut(hd).for_each(|h| apply(&t, &mut h[..n_rot]));
            }
            close(&format!("rope{} of the {what}", if neox { " (NeoX)" } else { "" }), &down(&k, got), &want, 1e-6);
        }
    }
    // SiLU-mul, residual add, row gathering.
    let u: Vec<f32> = (0..n * d).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    let ud = k.stream.clone_htod(&u).unwrap();
    let mut g = k.stream.clone_htod(&x).unwrap();
    k.silu_mul(&mut g, &ud).unwrap();
    let mut want = x.clone();
    silu_mul_scalar(&mut want, &u);
    close("silu_mul", &down(&k, &g), &want, 1e-6);
    let mut s = k.stream.clone_htod(&x).unwrap();
    k.add_assign(&mut s, &ud).unwrap();
    let want: Vec<f32> = x.iter().zip(&u).map(|(a, b)| a + b).collect();
    assert_eq!(down(&k, &s), want, "add_assign");
    let mut s = k.stream.clone_htod(&x).unwrap();
    k.add_bias(&mut s, &k.stream.clone_htod(&u[..d]).unwrap()).unwrap();
    let want: Vec<f32> = x.iter().enumerate().map(|(i, a)| a + u[i % d]).collect();
    assert_eq!(down(&k, &s), want, "add_bias");
    let picked = down(&k, &k.gather_rows(&xd, &[4, 0, 2], d).unwrap());
    assert_eq!(picked, [&x[4 * d..5 * d], &x[..d], &x[2 * d..3 * d]].concat(), "gather_rows");
}

#[test]
fn argmax_rows_picks_what_the_host_greedy_sampler_picks() {
    let Some(k) = launcher() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    let cols = 128_256;
    let mut rows: Vec<Vec<f32>> = (0..5).map(|_| (0..cols).map(|_| rng.random_range(-10.0f32..10.0)).collect()).collect();
    // Ties (the first maximum wins), NaNs (never chosen; a NaN first gives 0), nothing
    // above minus infinity (0), the maximum last.
    rows[1][7] = 50.0;
    rows[1][90_000] = 50.0;
    rows[2][0] = f32::NAN;
    rows[3][11] = f32::NAN;
    rows[3][12] = 40.0;
    rows.push(vec![f32::NEG_INFINITY; cols]);
    let mut last = vec![0.0f32; cols];
    last[cols - 1] = 1.0;
    rows.push(last);
    let flat: Vec<f32> = rows.concat();
    let x = k.stream.clone_htod(&flat).unwrap();
    let got = down(&k, &k.argmax_rows(&x, rows.len(), cols).unwrap());
    let want: Vec<u32> = rows.iter().map(|r| crate::sampler::argmax(r)).collect();
    assert_eq!(got, want);
    println!("argmax_rows: {} rows of {cols}, the host's picks {want:?}", rows.len());
}
