//! Paged decode attention against the single-process path: bit-identical over a whole
//! context, and split into ranges merged by log-sum-exp within a stated tolerance of the
//! unsplit result and of a float64 reference, for real and odd shapes.

use duet_kernels::attention::{attn_scale, padded_len, AttnShape, KvHead, KvRows, KvRun, KV_PADDING};
use duet_kernels::causal::causal_attention;
use duet_kernels::decode_batch::{decode_group, GroupScratch};
use duet_kernels::decode_batch::{merge_lse, merge_partials};
use duet_kv::paged::{rows, PagedRange};
use duet_kv::{ArenaLayout, BlockId, KvDtype};
use half::f16;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Where the error comes from: the softmax weights are rounded to f16 before ·V (as
/// llama.cpp does), a relative error of at most u = 2^-11 per weight, so a result differs
/// from exact arithmetic on the same f16 inputs by at most u · Σ w|v| <= u · max|v| (plus
/// f32 effects ~1e-6). V is drawn from [-1, 1] here, so max|v| <= 1.
const U: f64 = 1.0 / 2048.0;
/// Either result against float64 arithmetic on the same inputs (measured: 2.5e-4).
const F64_TOL: f64 = U * 1.01;
/// Split-and-merged against unsplit: each side's own weight rounding, 2u (measured: 4.2e-4
/// over 17 positions, whose weights are large; 0.5e-4 to 1.2e-4 over 64 to 1000).
const SPLIT_TOL: f64 = 2.0 * U * 1.01;

/// Decode attention of `kv_head`'s query group over the paged range `r`: its rows read in
/// place from the arena (as a cpu-worker reads them), then the kernel.
#[allow(clippy::too_many_arguments)] // the arena, the range and the group's three slices
fn attend_group(arena: &[f16], layout: &ArenaLayout, r: &PagedRange<'_>, kv_head: u32, q: &[f32], out: &mut [f32], lse: &mut [f32], scratch: &mut GroupScratch) {
    let runs: Vec<KvRun<'_>> = rows(arena, layout, r, kv_head).collect();
    decode_group(&runs, r.start..r.end, padded_len(r.n_ctx, r.kv_padding), attn_scale(layout.head_dim as usize), q, out, lse, scratch);
}

/// One sequence's K/V written into a paged arena and kept contiguous for the reference.
struct Fixture {
    layout: ArenaLayout,
    shape: AttnShape,
    arena: Vec<f16>,
    blocks: Vec<BlockId>,
    /// Per KV head, `[position][head_dim]`.
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    /// One decode token's queries, `[head][head_dim]`.
    q: Vec<f32>,
    n: usize,
    layer: u32,
}

impl Fixture {
    fn new(shape: AttnShape, block_size: u32, n: usize, q_gain: f32, seed: u64) -> Fixture {
        let mut rng = StdRng::seed_from_u64(seed);
        let hd = shape.head_dim;
        let n_used = n.div_ceil(block_size as usize);
        let layout = ArenaLayout {
            n_layer: 3,
            n_kv_head: shape.n_kv_head as u32,
            head_dim: hd as u32,
            block_size,
            dtype: KvDtype::F16,
            n_blocks: (n_used + 5) as u32,
        };
        let mut arena = vec![f16::from_f32(f32::NAN); layout.total_bytes().unwrap() / 2];
        // The sequence's blocks in a random order, leaving others (full of NaN) in between.
        let mut ids: Vec<BlockId> = (0..layout.n_blocks).map(BlockId).collect();
        ids.shuffle(&mut rng);
        let blocks = ids[..n_used].to_vec();
        let layer = 1;
        let mut rand_rows = |len| (0..len).map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0))).collect::<Vec<_>>();
        let k: Vec<Vec<f16>> = (0..shape.n_kv_head).map(|_| rand_rows(n * hd)).collect();
        let v: Vec<Vec<f16>> = (0..shape.n_kv_head).map(|_| rand_rows(n * hd)).collect();
        let bs = block_size as usize;
        for h in 0..shape.n_kv_head {
            for p in 0..n {
                let (block, slot) = (blocks[p / bs], p % bs);
                let ko = layout.k_offset(block, layer, h as u32) / 2 + slot * hd;
                let vo = layout.v_offset(block, layer, h as u32) / 2 + slot * hd;
                arena[ko..ko + hd].copy_from_slice(&k[h][p * hd..(p + 1) * hd]);
                arena[vo..vo + hd].copy_from_slice(&v[h][p * hd..(p + 1) * hd]);
            }
        }
        let q = (0..shape.n_head * hd).map(|_| rng.random_range(-1.0f32..1.0) * q_gain).collect();
        Fixture { layout, shape, arena, blocks, k, v, q, n, layer }
    }

    /// The single-process result for the decode token at position n - 1.
    fn reference(&self) -> Vec<f32> {
        let heads: Vec<KvHead<'_>> = self.k.iter().zip(&self.v).map(|(k, v)| KvHead { k: KvRows::F16(k), v: KvRows::F16(v) }).collect();
        let mut out = vec![0f32; self.q.len()];
        causal_attention(&self.q, &heads, self.shape, self.n - 1, &mut out);
        out
    }

    /// Paged attention of every query head over `start..end` (all KV heads): outputs and LSEs.
    fn paged(&self, start: usize, end: usize) -> (Vec<f32>, Vec<f32>) {
        let AttnShape { n_head, n_kv_head, head_dim: hd, .. } = self.shape;
        let group = n_head / n_kv_head;
        let bs = self.layout.block_size as usize;
        let first = start / bs;
        let r = PagedRange {
            layer: self.layer,
            blocks: &self.blocks[first..(end - 1) / bs + 1],
            first_pos: first * bs,
            start,
            end,
            n_ctx: self.n,
            kv_padding: KV_PADDING,
        };
        let (mut out, mut lse) = (vec![0f32; n_head * hd], vec![0f32; n_head]);
        let mut scratch = GroupScratch::default();
        for h in 0..n_kv_head {
            let heads = h * group..(h + 1) * group;
            attend_group(
                &self.arena[..],
                &self.layout,
                &r,
                h as u32,
                &self.q[heads.start * hd..heads.end * hd],
                &mut out[heads.start * hd..heads.end * hd],
                &mut lse[heads],
                &mut scratch,
            );
        }
        (out, lse)
    }

    /// Float64 attention of query head `head` over all n positions: output and LSE.
    fn f64_reference(&self, head: usize) -> (Vec<f64>, f64) {
        let AttnShape { n_head, n_kv_head, head_dim: hd, .. } = self.shape;
        let kvh = head / (n_head / n_kv_head);
        let q: Vec<f64> = self.q[head * hd..(head + 1) * hd].iter().map(|&x| f16::from_f32(x).to_f64()).collect();
        let scale = 1.0 / (hd as f64).sqrt();
        let s: Vec<f64> = (0..self.n)
            .map(|p| (0..hd).map(|d| q[d] * self.k[kvh][p * hd + d].to_f64()).sum::<f64>() * scale)
            .collect();
        let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = s.iter().map(|x| (x - max).exp()).sum();
        let out = (0..hd)
            .map(|d| (0..self.n).map(|p| (s[p] - max).exp() / sum * self.v[kvh][p * hd + d].to_f64()).sum())
            .collect();
        (out, max + sum.ln())
    }

    /// Splits 0..n at `cuts`, attends each range, merges per query head.
    fn split_merged(&self, cuts: &[usize]) -> Vec<f32> {
        let hd = self.shape.head_dim;
        let mut bounds = vec![0];
        bounds.extend_from_slice(cuts);
        bounds.push(self.n);
        let parts: Vec<(Vec<f32>, Vec<f32>)> = bounds.windows(2).map(|w| self.paged(w[0], w[1])).collect();
        let mut merged = Vec::with_capacity(self.q.len());
        for head in 0..self.shape.n_head {
            let ps: Vec<(&[f32], f32)> = parts.iter().map(|(o, l)| (&o[head * hd..(head + 1) * hd], l[head])).collect();
            merged.extend(merge_partials(&ps));
        }
        merged
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn max_abs_diff(a: &[f32], b: impl IntoIterator<Item = f64>) -> f64 {
    a.iter().zip(b).map(|(&x, y)| (x as f64 - y).abs()).fold(0.0, f64::max)
}

/// Checks bit-exactness of the whole range, the LSEs against float64, and splits at `cuts`.
fn check(f: &Fixture, splits: &[&[usize]]) -> (f64, f64) {
    let hd = f.shape.head_dim;
    let reference = f.reference();
    let (whole, lse) = f.paged(0, f.n);
    assert_eq!(bits(&whole), bits(&reference), "n={} shape {:?}: paged != causal_attention", f.n, f.shape);
    let mut worst = (0f64, 0f64);
    for head in 0..f.shape.n_head {
        let (o64, lse64) = f.f64_reference(head);
        let d = max_abs_diff(&whole[head * hd..(head + 1) * hd], o64.iter().copied());
        assert!(d <= F64_TOL, "n={} head {head}: |paged - f64| = {d:e}", f.n);
        worst.1 = worst.1.max(d);
        assert!((lse[head] as f64 - lse64).abs() <= 1e-5 * lse64.abs().max(1.0), "lse {} vs {lse64}", lse[head]);
    }
    for cuts in splits {
        let merged = f.split_merged(cuts);
        let d = max_abs_diff(&merged, whole.iter().map(|&x| x as f64));
        assert!(d <= SPLIT_TOL, "n={} cuts {cuts:?}: |merged - unsplit| = {d:e}", f.n);
        worst.0 = worst.0.max(d);
        for head in 0..f.shape.n_head {
            let (o64, _) = f.f64_reference(head);
            let d = max_abs_diff(&merged[head * hd..(head + 1) * hd], o64);
            assert!(d <= F64_TOL, "n={} cuts {cuts:?} head {head}: |merged - f64| = {d:e}", f.n);
        }
    }
    worst
}

/// SmolLM2's shape (9 query heads over 3 KV heads of 64), blocks of 16.
const SMOLLM2: AttnShape = AttnShape { n_head: 9, n_kv_head: 3, head_dim: 64, softcap: None };

#[test]
fn whole_context_is_bit_identical_and_splits_merge() {
    let mut worst = (0f64, 0f64);
    for (i, n) in [1usize, 17, 64, 65, 200, 1000].into_iter().enumerate() {
        // Sharp attention (q scaled up) for the larger contexts, where rounding matters most.
        let f = Fixture::new(SMOLLM2, 16, n, if i % 2 == 0 { 1.0 } else { 6.0 }, 100 + i as u64);
        let splits: Vec<Vec<usize>> = match n {
            1 => vec![],
            17 => vec![vec![16], vec![5, 11]],
            64 => vec![vec![32], vec![1, 63]],
            65 => vec![vec![64], vec![7, 40]],
            200 => vec![vec![128], vec![50, 131]],
            _ => vec![vec![512], vec![333, 700], vec![960, 999]],
        };
        let splits: Vec<&[usize]> = splits.iter().map(Vec::as_slice).collect();
        let w = check(&f, &splits);
        worst = (worst.0.max(w.0), worst.1.max(w.1));
    }
    println!("max |merged - unsplit| = {:.2e}, max |paged - f64| = {:.2e}", worst.0, worst.1);
}

#[test]
fn odd_head_dims_groups_and_block_sizes() {
    let shapes = [
        (AttnShape { n_head: 1, n_kv_head: 1, head_dim: 1, softcap: None }, 1),
        (AttnShape { n_head: 3, n_kv_head: 1, head_dim: 3, softcap: None }, 5),
        (AttnShape { n_head: 10, n_kv_head: 2, head_dim: 17, softcap: None }, 16),
        (AttnShape { n_head: 7, n_kv_head: 7, head_dim: 65, softcap: None }, 3),
        (AttnShape { n_head: 15, n_kv_head: 3, head_dim: 80, softcap: None }, 7),
        (AttnShape { n_head: 4, n_kv_head: 2, head_dim: 128, softcap: None }, 32),
    ];
    for (i, (shape, bs)) in shapes.into_iter().enumerate() {
        for (j, n) in [1usize, 2, 63, 130].into_iter().enumerate() {
            let f = Fixture::new(shape, bs, n, 2.0, 1000 + 10 * i as u64 + j as u64);
            let cuts: Vec<usize> = if n > 2 { vec![n / 3, n / 2 + 1] } else { vec![] };
            check(&f, &[&cuts]);
        }
    }
}

#[test]
fn lse_of_merged_parts_is_the_whole_lse() {
    let f = Fixture::new(SMOLLM2, 16, 300, 3.0, 7);
    let (_, whole) = f.paged(0, 300);
    let (_, a) = f.paged(0, 100);
    let (_, b) = f.paged(100, 300);
    for h in 0..SMOLLM2.n_head {
        let m = merge_lse(&[a[h], b[h]]);
        assert!((m - whole[h]).abs() <= 1e-5 * whole[h].abs().max(1.0), "head {h}: {m} vs {}", whole[h]);
    }
}
