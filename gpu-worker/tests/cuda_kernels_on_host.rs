//! The CUDA device's kernels checked on any machine (attention, greedy sampling, decode
//! products, expert rows, dequantisation, the fused decode steps, RoPE, in-place K/V): the kernel
//! files compile as host C++ with `support/cuda_on_host.h` (every thread of a block an OS
//! thread, `__syncthreads` and the warp shuffles barriers; see the header) and run, launched
//! as the CUDA device launches them, by `support/kernels_on_host.cpp`:
//!
//! - the KV mirror's `kv_store`, `attn_partial` and `attn_merge` on a paged pool, for decode
//!   items over whole contexts and shares of them, one position, none, several query heads
//!   per KV head (whole and partial head groups of the kernel), 1 to 3 splits and a soft
//!   cap; and `attn_prefill` on tiles of prefill rows over their causal prefixes, with and
//!   without a sliding window, beside them (each writing its items' slots): against the exact
//!   attention (f64) of the same f16 K/V, outputs within 2e-6, log-sum-exps within 2e-6
//!   relative; and `attn_prefill_mma64`/`128` on such tiles, their `mma.sync` and `ldmatrix` emulated;
//! - `argmax_rows` against the host's greedy sampler (`sampler::argmax`): ties, NaNs,
//!   nothing above minus infinity;
//! - `quantize_q8_1` and the `mmvq_*` kernels of every quantised weight type (decode-sized
//!   products of 1 to 37 rows) and `mmq_*` (the integer tensor cores' `mma.sync` emulated; 3
//!   and 37 rows, split over the units and not) within the rounding bound of their Q8_1
//!   activations of the exact product, as the GPU twin (`twins::linear_layers_...`) bounds
//!   them; the grouped `mmvq_*_group` launches bit for bit the single ones;
//! - `gather_rows` and `scatter_add_scaled`, a hot expert's rows on the GPU: exactly;
//! - `dequant_f16_*` of every quantised weight type (prefill's weights for cuBLAS): bit for
//!   bit the CPU's dequantisation rounded to f16, for a slice of rows;
//! - the fused decode kernels (`rms_norm_fused`: residual add, norm and Q8_1 units in one
//!   launch; `silu_mul_q8`) against the kernels they fuse: bit for bit;
//! - `rope` on a batch's queries and keys in one launch, against the CPU's RoPE (normal and
//!   NeoX pairs, a partial rotation): within 1e-6;
//! - `kv_to_arena`, the GPU's K/V rows written into a cpu-worker's arena in place: byte for
//!   byte what the host writes there (f16 and Q8_0 arenas, rounding ties included), nothing
//!   else touched; `arena_to_mirror`, the mirror's rows read from there: bit for bit what the
//!   host's widened rows give through `kv_store`.
//!
//! What the GPU adds (its `expf`, its scheduling) the GPU twins (`device::cuda::twins`,
//! `mirror_twins`) check where there is one. Without a C++ compiler the tests say they were
//! skipped (`DUET_REQUIRE_CXX=1`, which the test script sets, makes that a failure).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use duet_kernels::quant::{dequantize, GgmlType};
use duet_model::testutil::workspace_root;
use half::f16;
use rand::{Rng, SeedableRng};

#[path = "support/host_kernels.rs"]
mod host_kernels;

/// The harness, compiled once; `None` (having said why) without a C++ compiler.
fn harness() -> Option<&'static PathBuf> {
    static EXE: OnceLock<Option<PathBuf>> = OnceLock::new();
    EXE.get_or_init(|| host_kernels::compile_harness(&workspace_root().join("gpu-worker/tests/support/kernels_on_host.cpp"))).as_ref()
}

/// The harness's input stream.
#[derive(Default)]
struct Input(Vec<u8>);

impl Input {
    fn i32(&mut self, v: usize) -> &mut Self {
        self.0.extend(i32::try_from(v).unwrap().to_le_bytes());
        self
    }
    fn i32s(&mut self, v: &[i32]) -> &mut Self {
        v.iter().for_each(|x| self.0.extend(x.to_le_bytes()));
        self
    }
    fn f32(&mut self, v: f32) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn f32s(&mut self, v: &[f32]) -> &mut Self {
        v.iter().for_each(|x| self.0.extend(x.to_le_bytes()));
        self
    }
    /// Where each position `(block, slot)` of `slots` lies in an arena of `layout`
    /// (`ArenaLayout::slot_runs`), as the in-place K/V kernels take it: every run offset,
    /// then every stride between runs, u64 each.
    fn slot_runs(&mut self, layout: &duet_kv::ArenaLayout, slots: impl Iterator<Item = (u32, usize)>) -> &mut Self {
        let places: Vec<(usize, usize)> = slots.map(|(b, s)| layout.slot_runs(duet_kv::BlockId(b), s)).collect();
        places.iter().for_each(|&(o, _)| self.0.extend((o as u64).to_le_bytes()));
        places.iter().for_each(|&(_, st)| self.0.extend((st as u64).to_le_bytes()));
        self
    }
}

/// Runs the harness on `input`: its output as 4-byte words.
fn run(exe: &PathBuf, input: &Input) -> Vec<[u8; 4]> {
    let mut child = Command::new(exe).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(&input.0).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "harness: {:?} {}", out.status, String::from_utf8_lossy(&out.stderr));
    out.stdout.chunks_exact(4).map(|b| b.try_into().unwrap()).collect()
}

/// Heads of one test of the attention kernels.
struct Shape {
    n_kv_head: usize,
    group: usize,
    head_dim: usize,
}

/// Page size of the test pools (the mirror's is 16 positions too).
const PAGE: usize = 16;

/// Sequences' lengths: within a tile, over a tile of 128 with a partial page, over two tiles.
const LENS: [usize; 3] = [5, 70, 300];

/// Runs the kernels on one shape and compares with the exact attention; the largest output
/// and log-sum-exp differences.
/// With `mma` the tiles run `attn_prefill_mma64` or `128`, whose Q is rounded to f16: so is the
/// reference's then.
fn attention_case(exe: &PathBuf, shape: &Shape, n_split: usize, softcap: f32, mma: bool, seed: u64) -> (f64, f64) {
    let Shape { n_kv_head, group, head_dim } = *shape;
    let (kv_dim, n_head) = (n_kv_head * head_dim, n_kv_head * group);
    let (layers, layer) = (2usize, 1usize);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let f16_rounded = |x: f32| f16::from_f32(x).to_f32();

    // Each sequence's pages, taken from a shuffled pool so that tables are not in order.
    let n_pages: usize = LENS.iter().map(|l| l.div_ceil(PAGE)).sum::<usize>() + 3;
    let mut free: Vec<usize> = (0..n_pages).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, rng.random_range(0..=i));
    }
    let tables: Vec<Vec<usize>> = LENS.iter().map(|l| free.drain(..l.div_ceil(PAGE)).collect()).collect();
    // Every position's K and V (f16 values), stored by kv_store.
    let kv: Vec<(Vec<f32>, Vec<f32>)> = LENS
        .iter()
        .map(|&l| {
            let mut row = || (0..l * kv_dim).map(|_| f16_rounded(rng.random_range(-1.0f32..1.0))).collect::<Vec<f32>>();
            (row(), row())
        })
        .collect();
    let mut slots = Vec::new();
    for (s, &l) in LENS.iter().enumerate() {
        slots.extend((0..l).map(|p| (tables[s][p / PAGE] * PAGE + p % PAGE) as i32));
    }
    let mut pages: Vec<i32> = Vec::new();
    let mut toff = Vec::new();
    for t in &tables {
        toff.push(pages.len());
        pages.extend(t.iter().map(|&p| p as i32));
    }
    // Prefill rows in tiles: sequence 2's last 50 rows over their causal prefixes, sequence
    // 1's last 10 rows within a sliding window of 16, for the tensor-core kernel sequence 2's
    // rows 200..260 within one of 40 (a tile's warps then attend different stages of K/V)
    // (tiles of up to `per_tile` rows, as the kernel takes them, the last one short), and a
    // tile of one row.
    let mut ranges = Vec::new();
    let per_tile = if mma { 64 / group } else { (32 / group).min(4096 / (group * head_dim)) };
    let mut tiles = Vec::new();
    let mut tile_rows = |ranges: &mut Vec<(usize, std::ops::Range<usize>)>, s: usize, rows: Vec<std::ops::Range<usize>>, per: usize| {
        for chunk in rows.chunks(per) {
            tiles.extend([ranges.len() as i32, chunk.len() as i32, toff[s] as i32]);
            ranges.extend(chunk.iter().map(|r| (s, r.clone())));
        }
    };
    tile_rows(&mut ranges, 2, (250..300).map(|p| 0..p + 1).collect(), per_tile);
    tile_rows(&mut ranges, 1, (60..70).map(|p| p + 1 - 16..p + 1).collect(), per_tile);
    if mma {
        tile_rows(&mut ranges, 2, (200..260).map(|p| p + 1 - 40..p + 1).collect(), per_tile);
    }
    tile_rows(&mut ranges, 0, (2..3).map(|p| 0..p + 1).collect(), 1);
    // Single items after them (so that their merge writes the slots `dest` names, not its
    // own indices): whole contexts, shares of them, one position, none.
    let first_single = ranges.len() as i32;
    ranges.extend([(0, 0..5), (1, 0..70), (1, 10..70), (2, 0..300), (2, 128..300), (1, 69..70), (2, 3..131), (0, 5..5)]);
    let singles: Vec<i32> = (first_single..ranges.len() as i32).collect();
    let mut items = Vec::new();
    for (i, (s, r)) in ranges.iter().enumerate() {
        items.extend([i as i32, r.start as i32, r.end as i32, toff[*s] as i32]);
    }
    let q: Vec<f32> = (0..ranges.len() * n_head * head_dim).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let scale = 1.0 / (head_dim as f32).sqrt();
    let tiled = first_single as usize;

    let mut input = Input::default();
    input.i32(1).i32(n_kv_head).i32(head_dim).i32(group).i32(PAGE).i32(layers).i32(layer).i32(n_pages).i32(slots.len());
    for part in 0..2 {
        for (k, v) in &kv {
            input.f32s(if part == 0 { k } else { v });
        }
    }
    input.i32s(&slots).i32(pages.len()).i32s(&pages).i32(ranges.len()).i32s(&items);
    input.i32(tiles.len() / 3).i32s(&tiles).i32(singles.len()).i32s(&singles);
    input.i32(ranges.len()).f32s(&q).i32(n_split).f32(scale).f32(softcap).i32(usize::from(mma));
    let words = run(exe, &input);
    let f: Vec<f32> = words.iter().map(|b| f32::from_le_bytes(*b)).collect();
    assert_eq!(f.len(), ranges.len() * n_head * (head_dim + 1), "the harness's output");
    let (out, lse) = f.split_at(ranges.len() * n_head * head_dim);

    let (mut worst_out, mut worst_lse) = (0f64, 0f64);
    for (i, (s, r)) in ranges.iter().enumerate() {
        let (k, v) = &kv[*s];
        for h in 0..n_head {
            let kh = h / group;
            // The tensor-core kernel rounds each query, scaled, to f16.
            let qh: Vec<f64> = q[(i * n_head + h) * head_dim..][..head_dim]
                .iter()
                .map(|&x| if mma && i < tiled { f16_rounded(x * scale) as f64 / scale as f64 } else { x as f64 })
                .collect();
            let got = &out[(i * n_head + h) * head_dim..][..head_dim];
            let got_lse = lse[i * n_head + h];
            // NaN where no kernel wrote (the harness's fill), or read from a slot never stored.
            assert!(got.iter().all(|x| x.is_finite()) && !got_lse.is_nan(), "item {i} head {h}: not finite (unwritten, or read unstored K/V)");
            if r.is_empty() {
                assert!(got.iter().all(|&x| x == 0.0) && got_lse == f32::NEG_INFINITY, "item {i} attends nothing: zeros and minus infinity");
                continue;
            }
            let scores: Vec<f64> = r
                .clone()
                .map(|p| {
                    let kr = &k[p * kv_dim + kh * head_dim..][..head_dim];
                    let x = scale as f64 * qh.iter().zip(kr).map(|(&a, &b)| a * b as f64).sum::<f64>();
                    if softcap > 0.0 { softcap as f64 * (x / softcap as f64).tanh() } else { x }
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            for d in 0..head_dim {
                let want = r.clone().zip(&w).map(|(p, w)| w * v[p * kv_dim + kh * head_dim + d] as f64).sum::<f64>() / sum;
                worst_out = worst_out.max((got[d] as f64 - want).abs());
            }
            let want_lse = m + sum.ln();
            worst_lse = worst_lse.max((got_lse as f64 - want_lse).abs() / want_lse.abs().max(1.0));
        }
    }
    (worst_out, worst_lse)
}

#[test]
fn the_mirrors_attention_kernels_give_the_exact_attention_of_the_stored_rows() {
    let Some(exe) = harness() else { return };
    let shapes = [
        Shape { n_kv_head: 2, group: 3, head_dim: 64 },
        Shape { n_kv_head: 1, group: 6, head_dim: 128 },
        Shape { n_kv_head: 3, group: 1, head_dim: 32 },
        Shape { n_kv_head: 1, group: 2, head_dim: 256 },
        // Not a multiple of 32 (Phi-2's 80): the decode kernel's lanes own 2 or 3 dimensions.
        Shape { n_kv_head: 2, group: 2, head_dim: 80 },
        // Not a multiple of 8: K rows not on 16 bytes, read 4 bytes at a time.
        Shape { n_kv_head: 2, group: 2, head_dim: 36 },
    ];
    for (i, shape) in shapes.iter().enumerate() {
        for (n_split, softcap) in [(1, 0.0), (3, 0.0), (2, 30.0)] {
            let (out, lse) = attention_case(exe, shape, n_split, softcap, false, 7 + i as u64);
            println!(
                "{} KV heads × {} query heads of {}, {n_split} splits, soft cap {softcap}: outputs within {out:.1e}, log-sum-exps within {lse:.1e} (relative)",
                shape.n_kv_head, shape.group, shape.head_dim
            );
            assert!(out <= 2e-6 && lse <= 2e-6, "shape {i}, {n_split} splits, soft cap {softcap}: outputs off by {out:.3e}, log-sum-exps by {lse:.3e}");
        }
    }
}

/// The tensor-core prefill kernels (`attn_prefill_mma64` and `attn_prefill_mma128`, their
/// `mma.sync` and `ldmatrix` emulated with the PTX ISA's fragment layouts) on tiles of up to
/// 64 query vectors, for every head they take (multiples of 16 up to 128: 32, 64, 80 and 128;
/// whole and partial warps of query vectors, warps with none, one-row tiles, 1 to 8 query
/// heads per KV head, sliding windows whose warps skip different stages, a soft cap): within
/// the rounding of their probabilities to f16 (2^-11 of each weight: outputs within 1e-3) of
/// the exact attention of their f16 queries (each rounded after scaling); the log-sum-exps,
/// from f32 scores, within 2e-6.
#[test]
fn the_tensor_core_prefill_kernel_gives_the_exact_attention_of_its_f16_queries() {
    let Some(exe) = harness() else { return };
    let shapes = [
        Shape { n_kv_head: 2, group: 3, head_dim: 64 },
        Shape { n_kv_head: 1, group: 6, head_dim: 128 },
        Shape { n_kv_head: 3, group: 1, head_dim: 32 },
        Shape { n_kv_head: 2, group: 2, head_dim: 80 },
        Shape { n_kv_head: 2, group: 4, head_dim: 128 },
        Shape { n_kv_head: 1, group: 8, head_dim: 64 },
        Shape { n_kv_head: 1, group: 1, head_dim: 128 },
    ];
    for (i, shape) in shapes.iter().enumerate() {
        for softcap in [0.0, 30.0] {
            let (out, lse) = attention_case(exe, shape, 1, softcap, true, 11 + i as u64);
            println!(
                "{} KV heads × {} query heads of {}, soft cap {softcap}, tensor cores: outputs within {out:.1e}, log-sum-exps within {lse:.1e} (relative)",
                shape.n_kv_head, shape.group, shape.head_dim
            );
            assert!(out <= 1e-3 && lse <= 2e-6, "shape {i}, soft cap {softcap}: outputs off by {out:.3e}, log-sum-exps by {lse:.3e}");
        }
    }
}

#[test]
fn the_decode_matrix_vector_kernels_are_within_their_rounding_bound_of_the_exact_product() {
    // (And their grouped launches, `mmvq_*_group`, give the same bits.)
    let Some(exe) = harness() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    // 67 rows: the last block of 4 warps (a row each) part empty, mmq's second block of 64
    // rows nearly empty. 25 units a row where the type allows (mmq's last stage of 4 units
    // part empty), else 24.
    let rows = 67;
    let types = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];
    for ty in types {
        let cols = if matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K) { 768 } else { 800 };
        let w: Vec<u8> = (0..rows).flat_map(|_| host_kernels::random_row(ty, cols, &mut rng)).collect();
        let mut wf = vec![0f32; rows * cols];
        for (r, o) in wf.chunks_exact_mut(cols).enumerate() {
            dequantize(ty, &w[r * ty.row_bytes(cols)..(r + 1) * ty.row_bytes(cols)], o).unwrap();
        }
        // mmq at 3 rows (one tile of 8, part empty) and 37 (the device's batches of 9..64:
        // five tiles, the last part empty); the grouped launches at 3 and 16 (a whole pass);
        // not at every size, the emulation being slow (the GPU twins take them on a GPU).
        for n in [1, 3, 8, 16, 37] {
            let (mmq, groups) = (matches!(n, 3 | 37), matches!(n, 3 | 16));
            let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let mut input = Input::default();
            input.i32(3).i32(ty.id() as usize).i32(rows).i32(cols).i32(n).i32(usize::from(mmq) | (2 * usize::from(groups))).i32(w.len());
            input.0.extend(&w);
            input.f32s(&x);
            let all: Vec<f32> = run(exe, &input).iter().map(|b| f32::from_le_bytes(*b)).collect();
            let outs = 1 + usize::from(mmq) + 2 * usize::from(groups);
            assert_eq!(all.len(), outs * n * rows, "y, y of mmq (if asked), then y of the grouped launches over three and two weights");
            let (y, rest) = all.split_at(n * rows);
            let (y_mmq, grouped) = rest.split_at(if mmq { n * rows } else { 0 });
            // One launch over the rows as three weights (a layer's Q, K and V) and as two (its
            // gate and up): each row the same warp code, so the same bits.
            for (parts, g) in [3, 2].iter().zip(grouped.chunks_exact(n * rows)) {
                let same = y.iter().zip(g).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{ty:?} n={n}: mmvq_*_group over {parts} weights differs from mmvq");
            }
            let mut worst = 0f64;
            for t in 0..n {
                for r in 0..rows {
                    let (wr, xr) = (&wf[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                    let exact: f64 = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
                    // Q8_1 activations: each element off by at most half a step (amax / 254)
                    // of its unit; and f32 sums.
                    let bound: f64 = wr
                        .chunks_exact(32)
                        .zip(xr.chunks_exact(32))
                        .map(|(wu, xu)| wu.iter().map(|&v| (v as f64).abs()).sum::<f64>() * xu.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 254.0)
                        .sum::<f64>()
                        * 1.001
                        + 1e-5 * wr.iter().zip(xr).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum::<f64>()
                        + 1e-6;
                    for (what, out) in [("mmvq", y), ("mmq", y_mmq)].into_iter().filter(|(_, o)| !o.is_empty()) {
                        let got = out[t * rows + r] as f64;
                        assert!(got.is_finite() && (got - exact).abs() <= bound, "{ty:?} {what} n={n}: token {t} row {r}: kernel {got} vs exact {exact}, bound {bound:.3e}");
                        worst = worst.max((got - exact).abs() / bound);
                    }
                }
            }
            println!("{ty:?} quantize_q8_1 + mmvq{}, {n} rows: worst error {:.0}% of its bound", if mmq { " and mmq" } else { "" }, 100.0 * worst);
        }
    }
}

#[test]
fn argmax_rows_picks_what_the_host_greedy_sampler_picks() {
    let Some(exe) = harness() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    let cols = 3000;
    let mut rows: Vec<Vec<f32>> = (0..5).map(|_| (0..cols).map(|_| rng.random_range(-10.0f32..10.0)).collect()).collect();
    // Ties (the first maximum wins, across threads' strides), NaNs (never chosen; a NaN first
    // gives 0), nothing above minus infinity (0), the maximum last.
    rows[1][7] = 50.0;
    rows[1][2900] = 50.0;
    rows[2][0] = f32::NAN;
    rows[3][11] = f32::NAN;
    rows[3][12] = 40.0;
    rows[4][300] = 60.0;
    rows[4][44] = 60.0;
    rows.push(vec![f32::NEG_INFINITY; cols]);
    let mut last = vec![0.0f32; cols];
    last[cols - 1] = 1.0;
    rows.push(last);
    let mut input = Input::default();
    input.i32(2).i32(rows.len()).i32(cols).f32s(&rows.concat());
    let got: Vec<u32> = run(exe, &input).iter().map(|b| u32::from_le_bytes(*b)).collect();
    let want: Vec<u32> = rows.iter().map(|r| duet_gpu_worker::sampler::argmax(r)).collect();
    assert_eq!(got, want);
    println!("argmax_rows on the host: {} rows of {cols}, the greedy sampler's picks {want:?}", rows.len());
}

/// A hot expert's rows (`GpuExperts::add_outputs`): `gather_rows` takes the routed rows of
/// the layer's normed rows, and `scatter_add_scaled` adds the expert's outputs, times the
/// router's weights, to exactly those rows of the layer's sum, leaving the others alone.
#[test]
fn an_experts_rows_are_gathered_and_its_weighted_outputs_added_back() {
    let Some(exe) = harness() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(19);
    let (total, cols) = (9, 70);
    let rows: Vec<usize> = vec![7, 0, 3, 8];
    let w: Vec<f32> = rows.iter().map(|_| rng.random_range(0.0f32..1.0)).collect();
    let mut vals = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect() };
    let (x, y, src) = (vals(total * cols), vals(total * cols), vals(rows.len() * cols));
    let mut input = Input::default();
    input.i32(4).i32(total).i32(cols).i32(rows.len());
    for &r in &rows {
        input.0.extend((r as u32).to_le_bytes());
    }
    input.f32s(&w).f32s(&x).f32s(&y).f32s(&src);
    let got: Vec<f32> = run(exe, &input).iter().map(|b| f32::from_le_bytes(*b)).collect();
    let (gathered, summed) = got.split_at(rows.len() * cols);
    let want_gathered: Vec<f32> = rows.iter().flat_map(|&r| x[r * cols..(r + 1) * cols].iter().copied()).collect();
    assert_eq!(gathered, want_gathered.as_slice());
    let mut want = y.clone();
    for (j, &r) in rows.iter().enumerate() {
        for c in 0..cols {
            want[r * cols + c] += w[j] * src[j * cols + c];
        }
    }
    assert_eq!(summed, want.as_slice(), "rows {rows:?} of {total}");
}

/// `kv_to_arena` (`host_map::store_in_place`): rows of one layer written at their slots,
/// found from `ArenaLayout::slot_runs`, are byte for byte what `KvArenas::write_token` writes
/// there — f16 rounded to nearest even, or Q8_0 as `quantize_row` makes it — in f16 arenas with
/// heads of 80 and Q8_0 arenas with heads of 64, in the first and the last layer; every other
/// byte of the arena is left alone.
#[test]
fn the_kv_rows_the_gpu_writes_in_place_are_the_hosts() {
    use duet_kv::{ArenaLayout, BlockId, KvDtype};
    let Some(exe) = harness() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    for (dtype, head_dim) in [(KvDtype::F16, 80), (KvDtype::Q8_0, 64)] {
        let layout = ArenaLayout { n_layer: 3, n_kv_head: 2, head_dim, block_size: 4, dtype, n_blocks: 3 };
        let (n_kv_head, row_bytes) = (2usize, layout.row_bytes().unwrap());
        let slots = [(2u32, 3usize), (0, 0), (1, 2), (0, 1)];
        for layer in [0u32, 2] {
            let kv_dim = n_kv_head * head_dim as usize;
            let mut vals = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect() };
            let (mut k, mut v) = (vals(slots.len() * kv_dim), vals(slots.len() * kv_dim));
            // Rounding ties: f16 halfway cases, and Q8_0 quants at x.5 (amax 127: the scale 1).
            for (i, x) in [1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11), -(1.0 + 2f32.powi(-11))].iter().enumerate() {
                k[i] = *x;
            }
            let tie_head = &mut v[kv_dim..kv_dim + 32];
            tie_head.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 - 15.5);
            tie_head[0] = 127.0;
            // A head of zeros: scale 0, quants 0.
            v[2 * kv_dim..2 * kv_dim + head_dim as usize].fill(0.0);
            let total = layout.total_bytes().unwrap();
            let mut want = vec![0xabu8; total];
            let mut input = Input::default();
            input.i32(5).i32(slots.len()).i32(n_kv_head).i32(head_dim as usize).i32(layer as usize).i32(usize::from(dtype == KvDtype::Q8_0)).i32(total);
            input.slot_runs(&layout, slots.iter().copied()).f32s(&k).f32s(&v);
            for (r, &(b, slot)) in slots.iter().enumerate() {
                for h in 0..n_kv_head {
                    for (offset, src) in [(layout.k_offset(BlockId(b), layer, h as u32), &k), (layout.v_offset(BlockId(b), layer, h as u32), &v)] {
                        let x = &src[r * kv_dim + h * head_dim as usize..][..head_dim as usize];
                        let dst = &mut want[offset + slot * row_bytes..][..row_bytes];
                        match dtype {
                            KvDtype::Q8_0 => duet_kernels::dot::quantize_row(GgmlType::Q8_0, x, dst),
                            _ => dst.chunks_exact_mut(2).zip(x).for_each(|(d, &x)| d.copy_from_slice(&f16::from_f32(x).to_le_bytes())),
                        }
                    }
                }
            }
            let got: Vec<u8> = run(exe, &input).into_iter().flatten().collect();
            assert_eq!(got.len(), total);
            let first_wrong = got.iter().zip(&want).position(|(a, b)| a != b);
            assert!(first_wrong.is_none(), "{dtype} layer {layer}: byte {} differs: {} against the host's {}", first_wrong.unwrap(), got[first_wrong.unwrap()], want[first_wrong.unwrap()]);
        }
    }
}

/// `arena_to_mirror` (`KvMirror::read_in_place`): rows of one layer read from an arena at
/// their slots (`ArenaLayout::slot_runs`) into a page pool are bit for bit what the host's
/// upload stores (the runs widened to f32 — an f16 arena's values, a Q8_0 arena's d · q —
/// then rounded to f16 by `kv_store`), in the first and the last layer, rows in any order and
/// pages; nothing else in the pool is touched.
#[test]
fn the_rows_the_mirror_reads_from_the_arenas_are_what_the_host_uploads() {
    use duet_kv::{ArenaLayout, BlockId, KvDtype};
    let Some(exe) = harness() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(31);
    for (dtype, head_dim) in [(KvDtype::F16, 80), (KvDtype::Q8_0, 64)] {
        let layout = ArenaLayout { n_layer: 3, n_kv_head: 2, head_dim, block_size: 4, dtype, n_blocks: 3 };
        let (n_kv_head, hd, row_bytes) = (2usize, head_dim as usize, layout.row_bytes().unwrap());
        let kv_dim = n_kv_head * hd;
        // Any bytes: f16 values, or Q8_0 blocks (an f16 scale, 32 quants) within ±8.
        let total = layout.total_bytes().unwrap();
        let mut arena: Vec<u8> = (0..total).map(|_| rng.random()).collect();
        if dtype == KvDtype::Q8_0 {
            for block in arena.chunks_exact_mut(34) {
                block[..2].copy_from_slice(&f16::from_f32(rng.random_range(-0.06f32..0.06)).to_le_bytes());
            }
        } else {
            for v in arena.chunks_exact_mut(2) {
                v.copy_from_slice(&f16::from_f32(rng.random_range(-8.0f32..8.0)).to_le_bytes());
            }
        }
        // Positions (block, slot) of one sequence into pool slots (page * PAGE + offset).
        let rows = [(2u32, 3usize, 5 * PAGE + 15), (0, 0, 0), (1, 2, 3 * PAGE + 1), (0, 1, 1)];
        let (layers, n_pages) = (3usize, 6usize);
        let page_elems = layers * 2 * kv_dim * PAGE;
        for layer in [0u32, 2] {
            let mut input = Input::default();
            input.i32(9).i32(rows.len()).i32(n_kv_head).i32(hd).i32(layers).i32(layer as usize);
            input.i32(usize::from(dtype == KvDtype::Q8_0)).i32(n_pages).i32(PAGE).i32(total);
            input.0.extend(&arena);
            input.slot_runs(&layout, rows.iter().map(|&(b, s, _)| (b, s)));
            input.i32s(&rows.iter().map(|&(.., slot)| slot as i32).collect::<Vec<_>>());
            let mut want = vec![0xababu16; n_pages * page_elems];
            let mut widened = vec![0f32; hd];
            for &(b, s, slot) in &rows {
                for h in 0..n_kv_head {
                    for (is_v, offset) in [(0, layout.k_offset(BlockId(b), layer, h as u32)), (1, layout.v_offset(BlockId(b), layer, h as u32))] {
                        let src = &arena[offset + s * row_bytes..][..row_bytes];
                        match dtype {
                            KvDtype::Q8_0 => duet_kernels::widen_q8_0_scalar(src, &mut widened),
                            _ => widened.iter_mut().zip(src.chunks_exact(2)).for_each(|(w, b)| *w = f16::from_le_bytes([b[0], b[1]]).to_f32()),
                        }
                        let (page, p) = (slot / PAGE, slot % PAGE);
                        let base = page * page_elems + layer as usize * 2 * kv_dim * PAGE + is_v * kv_dim * PAGE + (h * PAGE + p) * hd;
                        want[base..base + hd].iter_mut().zip(&widened).for_each(|(d, &x)| *d = f16::from_f32(x).to_bits());
                    }
                }
            }
            let got: Vec<u16> = run(exe, &input).into_iter().flat_map(|w| [u16::from_le_bytes([w[0], w[1]]), u16::from_le_bytes([w[2], w[3]])]).collect();
            assert_eq!(got.len(), want.len());
            let first_wrong = got.iter().zip(&want).position(|(a, b)| a != b);
            assert!(first_wrong.is_none(), "{dtype} layer {layer}: value {} is {:#06x}, the host's {:#06x}", first_wrong.unwrap(), got[first_wrong.unwrap()], want[first_wrong.unwrap()]);
        }
    }
}

/// `dequant_f16_*` (prefill batches' weights for cuBLAS), a slice of rows of each quantised
/// type: bit for bit the CPU's dequantised values rounded to f16, every value written.
#[test]
fn dequantised_weights_are_the_cpus_rounded_to_f16() {
    let Some(exe) = harness() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(29);
    // 7 rows of 24 units: a whole block of 128 units and a partial one.
    let (rows, cols, row0, n) = (10, 768, 2, 7);
    let types = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];
    for ty in types {
        let w: Vec<u8> = (0..rows).flat_map(|_| host_kernels::random_row(ty, cols, &mut rng)).collect();
        let rb = ty.row_bytes(cols);
        let mut want = Vec::with_capacity(n * cols);
        for r in row0..row0 + n {
            let mut f = vec![0f32; cols];
            dequantize(ty, &w[r * rb..(r + 1) * rb], &mut f).unwrap();
            want.extend(f.iter().map(|&x| f16::from_f32(x).to_bits()));
        }
        let mut input = Input::default();
        input.i32(6).i32(ty.id() as usize).i32(cols).i32(row0).i32(n).i32(w.len());
        input.0.extend(&w);
        let got: Vec<u16> = run(exe, &input).iter().flat_map(|b| [u16::from_le_bytes([b[0], b[1]]), u16::from_le_bytes([b[2], b[3]])]).collect();
        assert_eq!(got.len(), want.len(), "{ty:?}");
        let first = got.iter().zip(&want).position(|(a, b)| a != b);
        assert!(first.is_none(), "{ty:?}: value {} is {:#06x}, the CPU's {:#06x}", first.unwrap(), got[first.unwrap()], want[first.unwrap()]);
    }
}

/// The fused decode kernels compute what the kernels they replace compute, bit for bit:
/// `rms_norm_fused` (with the residual add or without, with Q8_1 units or without) against `add_assign`,
/// `rms_norm` and `quantize_q8_1`; `silu_mul_q8` against `silu_mul` and `quantize_q8_1`. Rows
/// of 2048 and of 576 (SmolLM2's: units that straddle the norm's thread stride), and of a
/// zero unit (scale 0).
#[test]
fn the_fused_decode_kernels_compute_what_the_separate_ones_do() {
    let Some(exe) = harness() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(31);
    for (rows, cols) in [(3usize, 2048usize), (2, 576)] {
        for add in [false, true] {
            let n = rows * cols;
            let mut vals = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-3.0f32..3.0)).collect() };
            let (mut x, y, w, g, u) = (vals(n), vals(n), vals(cols), vals(n), vals(n));
            x[32..64].fill(0.0);
            let mut input = Input::default();
            input.i32(7).i32(rows).i32(cols).i32(usize::from(add)).f32(1e-5).f32s(&x).f32s(&y).f32s(&w).f32s(&g).f32s(&u);
            let words = run(exe, &input);
            // Per way: x, the normed rows, their units (40 bytes each), g, its units.
            let units_words = n / 32 * 10;
            let way = 3 * n + 2 * units_words;
            assert_eq!(words.len(), 2 * way + 2 * n, "rows {rows} of {cols}");
            let (separate, rest) = words.split_at(way);
            let (fused, unquantised) = rest.split_at(way);
            assert_eq!(unquantised, &separate[..2 * n], "rows {rows} of {cols}, add {add}: x and the normed rows without units");
            let names = ["x after the add", "the normed rows", "their Q8_1 units", "g", "g's Q8_1 units"];
            let lens = [n, n, units_words, n, units_words];
            let (mut at, mut first_diff) = (0, None);
            for (name, len) in names.iter().zip(lens) {
                if let Some(i) = (at..at + len).find(|&i| separate[i] != fused[i]) {
                    first_diff.get_or_insert((*name, i - at));
                }
                at += len;
            }
            assert_eq!(first_diff, None, "rows {rows} of {cols}, add {add}: (what, word) that differs");
            assert!(fused[n..2 * n].iter().all(|b| f32::from_le_bytes(*b).is_finite()), "every normed value written");
        }
    }
}

/// `rope` turns a batch's queries and keys (heads of each a row) in one launch as the CPU's
/// `Rope` does: normal and NeoX pairs, 32 of 64 dimensions rotated, per-pair divisors.
#[test]
fn rope_turns_queries_and_keys_as_the_cpu_does() {
    use duet_kernels::ops::Rope;
    let Some(exe) = harness() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(37);
    let (q_heads, k_heads, hd, n_rot) = (9usize, 3usize, 64usize, 32usize);
    let rope = Rope::new(n_rot, 10000.0, 0.5, Some((0..n_rot / 2).map(|i| 1.0 + i as f32 / 4.0).collect()));
    let positions = [0usize, 1, 17, 300, 4095];
    let mut vals = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
    let (q, k) = (vals(positions.len() * q_heads * hd), vals(positions.len() * k_heads * hd));
    let tables: Vec<f32> = positions.iter().flat_map(|&p| rope.table(p)).flat_map(|(c, s)| [c, s]).collect();
    for neox in [false, true] {
        let mut input = Input::default();
        input.i32(8).i32(positions.len()).i32(q_heads).i32(k_heads).i32(hd).i32(n_rot).i32(usize::from(neox)).f32s(&q).f32s(&k).f32s(&tables);
        let got: Vec<f32> = run(exe, &input).iter().map(|b| f32::from_le_bytes(*b)).collect();
        let (gq, gk) = got.split_at(q.len());
        let apply = if neox { Rope::apply_neox } else { Rope::apply };
        for (what, got, x, heads) in [("queries", gq, &q, q_heads), ("keys", gk, &k, k_heads)] {
            let mut want = x.clone();
            for (row, &p) in want.chunks_exact_mut(heads * hd).zip(&positions) {
                let t = rope.table(p);
                row.chunks_exact_mut(hd).for_each(|h| apply(&t, &mut h[..n_rot]));
            }
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-6, "rope (neox {neox}) of the {what}: off by {worst}");
        }
    }
}
