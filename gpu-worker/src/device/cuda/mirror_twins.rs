//! The KV mirror and the GPU's attention on it against a float64 reference over the same f16
//! K/V rows: decode ranges (whole contexts, shares, a sliding window's cut, an empty range),
//! prefill rows over their causal prefixes, rows written through the mirror and rows uploaded
//! from the host (f16 and Q8_0 caches), trimming and eviction under a small budget, and a
//! sequence too long for the mirror left to the host. Needs a GPU (see `twins`).

use std::ops::Range;

use duet_kernels::attention::{AttnShape, KvRows, KvRun, Q8_0_BLOCK_BYTES};
use half::f16;
use rand::{Rng, SeedableRng};

use super::mirror::{KvMirror, MirrorItem, PAGE};
use super::twins::launcher;
use crate::device::{KvAccessError, KvSink, KvSource};

/// Q8_0 rows as `[seq][layer][kv_head]` bytes.
type Blocks = Vec<Vec<Vec<Vec<u8>>>>;

/// Sequences' K/V on the host: `rows[seq][layer][kv_head]` f16 `[position][head_dim]` (or Q8_0).
struct HostKv {
    k: Vec<Vec<Vec<Vec<f16>>>>,
    v: Vec<Vec<Vec<Vec<f16>>>>,
    /// The same rows as Q8_0 blocks, when the cache is Q8_0.
    q8: Option<(Blocks, Blocks)>,
    head_dim: usize,
    keys: Vec<u64>,
}

impl KvSource for HostKv {
    fn runs(&self, seq: usize, layer: usize, kv_head: usize, range: Range<usize>) -> Result<Vec<KvRun<'_>>, KvAccessError> {
        let hd = self.head_dim;
        Ok(vec![match &self.q8 {
            None => KvRun { k: KvRows::F16(&self.k[seq][layer][kv_head][range.start * hd..range.end * hd]), v: KvRows::F16(&self.v[seq][layer][kv_head][range.start * hd..range.end * hd]) },
            Some((k, v)) => {
                let b = hd / 32 * Q8_0_BLOCK_BYTES;
                KvRun { k: KvRows::Q8_0(&k[seq][layer][kv_head][range.start * b..range.end * b]), v: KvRows::Q8_0(&v[seq][layer][kv_head][range.start * b..range.end * b]) }
            }
        }])
    }

    fn seq_key(&self, seq: usize) -> Option<u64> {
        self.keys.get(seq).copied()
    }
}

/// Rows of one sequence written as a batch: row r is position `pos0 + r`.
struct Rows {
    key: u64,
    pos0: usize,
}

impl KvSink for Rows {
    fn write(&mut self, _: usize, _: usize, _: &[f32], _: &[f32]) -> Result<(), KvAccessError> {
        Ok(())
    }

    fn position_of(&self, row: usize) -> Option<(u64, usize)> {
        Some((self.key, self.pos0 + row))
    }
}

/// Random K/V rows for sequences of `lens`, `layers` layers, as f16; with `q8` the cache is
/// Q8_0 blocks and the f16 rows are their dequantised values rounded to f16, as the mirror
/// holds them (the reference reads the f16 rows either way).
fn host_kv(shape: &AttnShape, layers: usize, lens: &[usize], q8: bool, rng: &mut rand::rngs::StdRng) -> HostKv {
    let hd = shape.head_dim;
    let mut make = || -> (Vec<Vec<Vec<Vec<f16>>>>, Blocks) {
        let mut f = Vec::new();
        let mut b = Vec::new();
        for &n in lens {
            let mut fl = Vec::new();
            let mut bl = Vec::new();
            for _ in 0..layers {
                let mut fh = Vec::new();
                let mut bh = Vec::new();
                for _ in 0..shape.n_kv_head {
                    let x: Vec<f32> = (0..n * hd).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                    if q8 {
                        let mut blocks = vec![0u8; n * hd / 32 * Q8_0_BLOCK_BYTES];
                        duet_kernels::dot::quantize_row(duet_kernels::quant::GgmlType::Q8_0, &x, &mut blocks);
                        let mut back = vec![0f32; n * hd];
                        KvRows::Q8_0(&blocks).widen_into(&mut back);
                        fh.push(back.iter().map(|&v| f16::from_f32(v)).collect());
                        bh.push(blocks);
                    } else {
                        fh.push(x.iter().map(|&v| f16::from_f32(v)).collect());
                    }
                }
                fl.push(fh);
                bl.push(bh);
            }
            f.push(fl);
            b.push(bl);
        }
        (f, b)
    };
    let (k, kb) = make();
    let (v, vb) = make();
    HostKv { k, v, q8: q8.then_some((kb, vb)), head_dim: hd, keys: (0..lens.len() as u64).map(|i| 100 + i).collect() }
}

/// The float64 attention of one query row over `range` of sequence `seq` of `layer`: per head
/// the output and the log-sum-exp.
fn reference(kv: &HostKv, shape: &AttnShape, seq: usize, layer: usize, q: &[f32], range: Range<usize>) -> (Vec<f64>, Vec<f64>) {
    let hd = shape.head_dim;
    let group = shape.n_head / shape.n_kv_head;
    let scale = duet_kernels::attention::attn_scale(hd) as f64;
    let (mut out, mut lse) = (vec![0f64; shape.n_head * hd], vec![f64::NEG_INFINITY; shape.n_head]);
    for h in 0..shape.n_head {
        if range.is_empty() {
            continue;
        }
        let (k, v) = (&kv.k[seq][layer][h / group], &kv.v[seq][layer][h / group]);
        let qh = &q[h * hd..(h + 1) * hd];
        let cap = |s: f64| shape.softcap.map_or(s, |c| c as f64 * (s / c as f64).tanh());
        let s: Vec<f64> = range.clone().map(|p| cap(qh.iter().zip(&k[p * hd..(p + 1) * hd]).map(|(&a, b)| a as f64 * b.to_f64()).sum::<f64>() * scale)).collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = s.iter().map(|x| (x - m).exp()).sum();
        for (j, p) in range.clone().enumerate() {
            let w = (s[j] - m).exp() / sum;
            for d in 0..hd {
                out[h * hd + d] += w * v[p * hd + d].to_f64();
            }
        }
        lse[h] = m + sum.ln();
    }
    (out, lse)
}

/// Writes positions `range` of sequence `seq` of every layer through the mirror's store.
fn store(k: &super::launch::Launcher, mirror: &mut KvMirror, kv: &HostKv, shape: &AttnShape, layers: usize, seq: usize, range: Range<usize>) {
    let hd = shape.head_dim;
    let kv_dim = shape.n_kv_head * hd;
    for layer in 0..layers {
        let rows = |src: &Vec<Vec<Vec<Vec<f16>>>>| -> Vec<f32> {
            range.clone().flat_map(|p| (0..shape.n_kv_head).flat_map(move |h| src[seq][layer][h][p * hd..(p + 1) * hd].iter().map(|x| x.to_f32()))).collect()
        };
        let (kr, vr) = (rows(&kv.k), rows(&kv.v));
        assert_eq!(kr.len(), range.len() * kv_dim);
        let (kr, vr) = (k.stream.clone_htod(&kr).unwrap(), k.stream.clone_htod(&vr).unwrap());
        mirror.store(k, layer, &kr, &vr, &Rows { key: kv.keys[seq], pos0: range.start }).unwrap();
    }
}

/// Attends `items` (row r of `q` each) and checks each against the reference: within 2e-5 of
/// the exact attention, or, for an item of a prefill tile where they run on the tensor cores
/// (`prefill_on_tensor_cores`), within their rounding (probabilities to f16: 1e-3) of the
/// exact attention of the row's query rounded to f16.
fn check(k: &super::launch::Launcher, mirror: &mut KvMirror, kv: &HostKv, shape: &AttnShape, q: &[f32], items: &[MirrorItem], what: &str) -> Vec<bool> {
    let mma = super::mirror::prefill_on_tensor_cores(k.kernels().arch, shape.head_dim);
    // The items the launch puts in prefill tiles (the rest go to attn_partial one by one).
    let keys: Vec<(u64, i32, i32)> = items.iter().map(|it| (it.key, 0, it.row as i32)).collect();
    let per_tile = super::mirror::prefill_kernel(k.kernels().arch, shape.n_head / shape.n_kv_head, shape.head_dim).rows_per_tile;
    let (_, singles) = super::mirror::prefill_tiles(&keys, per_tile);
    let layers = kv.k[0].len();
    let q_dim = shape.n_head * shape.head_dim;
    let mut placed = Vec::new();
    let qd = k.stream.clone_htod(q).unwrap();
    for layer in 0..layers {
        let got = mirror.attend(k, layer, &qd, items, kv, &super::phases::Phases::default()).unwrap();
        placed = got.iter().map(Option::is_some).collect();
        for (i, (it, g)) in items.iter().zip(got).enumerate() {
            let Some((o, l)) = g else { continue };
            let tiled = mma && !singles.contains(&i);
            let qr = &q[it.row * q_dim..(it.row + 1) * q_dim];
            assert!(o.iter().all(|v| v.is_finite()), "{what}: layer {layer}, row {}: an output is not finite", it.row);
            // The largest output difference from `want`, and the first log-sum-exp off by more
            // than 2e-5 (relative).
            let off = |(want, want_lse): &(Vec<f64>, Vec<f64>)| {
                let worst = o.iter().zip(want).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
                let lse_off = l.iter().zip(want_lse).enumerate().find(|(_, (&a, &b))| if b.is_infinite() { a != f32::NEG_INFINITY } else { (a as f64 - b).abs() >= 2e-5 * b.abs().max(1.0) });
                (worst, lse_off.map(|(h, (&a, &b))| (h, a, b)))
            };
            let (worst, lse_off) = off(&reference(kv, shape, it.seq, layer, qr, it.range.clone()));
            let on_tensor_cores = || {
                let q16: Vec<f32> = qr.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
                let (worst, lse_off) = off(&reference(kv, shape, it.seq, layer, &q16, it.range.clone()));
                worst < 1e-3 && lse_off.is_none()
            };
            if (worst >= 2e-5 || lse_off.is_some()) && !(tiled && on_tensor_cores()) {
                panic!("{what}: layer {layer}, row {} over {:?}: output off by {worst}, log-sum-exp (head, got, want) {lse_off:?}", it.row, it.range);
            }
        }
    }
    placed
}

#[test]
fn attention_on_the_mirror_matches_a_float64_reference() {
    let Some(k) = launcher() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    // Llama's groups of 4 with heads of 64; Qwen 2's of 7 (two head groups per block, the
    // second partial) with 128; one head per group with 80, soft-capped (Gemma 2's scores).
    let shapes = [
        AttnShape { n_head: 8, n_kv_head: 2, head_dim: 64, softcap: None },
        AttnShape { n_head: 14, n_kv_head: 2, head_dim: 128, softcap: None },
        AttnShape { n_head: 3, n_kv_head: 3, head_dim: 96, softcap: Some(5.0) },
    ];
    let layers = 2;
    for (si, shape) in shapes.iter().enumerate() {
        for q8 in [false, true] {
            let what = format!("shape {si}{}", if q8 { ", Q8_0 cache" } else { "" });
            let lens = [1, 17, 300, 1000];
            let kv = host_kv(shape, layers, &lens, q8, &mut rng);
            let q_dim = shape.n_head * shape.head_dim;
            let q: Vec<f32> = (0..64 * q_dim).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let mut mirror = KvMirror::new(&k.stream, 1 << 30, layers, *shape, 8).unwrap();
            // Sequence 2 written through the mirror, sequence 1 partly (the rest uploaded);
            // the others uploaded from the host when first attended.
            store(&k, &mut mirror, &kv, shape, layers, 2, 0..300);
            store(&k, &mut mirror, &kv, shape, layers, 1, 0..9);
            let it = |row: usize, seq: usize, range: Range<usize>| MirrorItem { row, range, seq, key: kv.keys[seq] };
            let mut items = vec![it(0, 0, 0..1), it(1, 1, 0..17), it(2, 2, 0..300), it(3, 3, 0..1000), it(4, 3, 200..777), it(5, 2, 299..300), it(6, 3, 500..500)];
            // Prefill rows of sequence 3: positions 990..1000 over their prefixes.
            items.extend((0..10).map(|i| it(7 + i, 3, 0..991 + i)));
            let placed = check(&k, &mut mirror, &kv, shape, &q, &items, &what);
            assert!(placed.iter().all(|&p| p), "{what}: every item fits a 1 GiB mirror");
            // Left on the GPU for a layer wholly on the device: the same outputs, row by row;
            // items out of row order are declined.
            let qd = k.stream.clone_htod(&q).unwrap();
            let (on_gpu, _timed) = mirror.attend_rows(&k, 1, &qd, &items, &kv).unwrap().expect("row-ordered items are all placed");
            let on_gpu = k.stream.clone_dtoh(&on_gpu).unwrap();
            let phases = super::phases::Phases::default();
            for (it, got) in items.iter().zip(mirror.attend(&k, 1, &qd, &items, &kv, &phases).unwrap()) {
                assert_eq!(on_gpu[it.row * q_dim..(it.row + 1) * q_dim], got.unwrap().0[..], "{what}: row {}", it.row);
            }
            let mut swapped = items.clone();
            swapped.swap(0, 1);
            assert!(mirror.attend_rows(&k, 1, &qd, &swapped, &kv).unwrap().is_none());
            // A sequence rewritten from position 5 (taken back): the mirror drops what
            // followed and uploads it again.
            store(&k, &mut mirror, &kv, shape, layers, 1, 5..6);
            check(&k, &mut mirror, &kv, shape, &q, &[it(0, 1, 0..17)], &what);

            // A mirror of 1100 positions: sequence 3 alone fits, 2 and 3 together do not
            // (sequence 2 gives up the pages 3 needs from its end, then uploads them again); a
            // 2000-position range fits nowhere.
            let page = KvMirror::page_bytes(layers, shape);
            let mut small = KvMirror::new(&k.stream, 1100usize.div_ceil(PAGE) * page, layers, *shape, 8).unwrap();
            for round in 0..2 {
                for items in [vec![it(0, 2, 0..300)], vec![it(1, 3, 0..1000)], vec![it(0, 2, 0..300), it(1, 3, 0..1000)]] {
                    let placed = check(&k, &mut small, &kv, shape, &q, &items, &format!("{what}, small mirror, round {round}"));
                    assert!(placed[0], "{what}: the first sequence of a call always fits");
                    if items.len() == 2 {
                        assert!(!placed[1], "{what}: 1300 positions in a mirror of 1100");
                    }
                }
            }
            // Sequence 3 written whole but attended over 0..300 only gives back its pages
            // past 300 when sequence 2 needs room, and stays right; then both fit.
            let mut trim = KvMirror::new(&k.stream, 1100usize.div_ceil(PAGE) * page, layers, *shape, 8).unwrap();
            store(&k, &mut trim, &kv, shape, layers, 3, 0..1000);
            check(&k, &mut trim, &kv, shape, &q, &[it(0, 3, 0..300)], &what);
            assert_eq!(check(&k, &mut trim, &kv, shape, &q, &[it(1, 2, 0..300)], &what), [true]);
            assert_eq!(check(&k, &mut trim, &kv, shape, &q, &[it(0, 3, 0..300), it(1, 2, 0..300)], &what), [true, true], "{what}: trimmed, both fit");
            let mut tiny = KvMirror::new(&k.stream, 4 * page, layers, *shape, 8).unwrap();
            let placed = check(&k, &mut tiny, &kv, shape, &q, &[it(0, 3, 0..1000), it(1, 0, 0..1)], &what);
            assert_eq!(placed, [false, true], "{what}: a sequence over the mirror goes to the host, the others stay");
            println!("{what}: GPU attention within 2e-5 of float64");
        }
    }
}
