//! Decode and prefill attention kernels against their twins, bit for bit: the AVX-512 and AVX2
//! group kernels (two-pass, ggml's arithmetic; one-pass, online softmax) against the per-head
//! widened twins, the dispatched prefill path against the widened one, and the one-pass
//! arithmetic against the two-pass one and f64 attention; Q8_0 rows (`--kv-type q8_0`) through
//! every entry against the one-pass twin over their dequantised values. Inputs are random, the
//! seeds fixed.

use duet_kernels::attention::{KvRows, KvRun};
use duet_kernels::{self as kernels, Isa};
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The head sizes the AVX-512 kernels take (Llama 3.2 1B's and SmolLM2's; Llama 3.1 8B's and OLMoE's).
const HEAD_DIMS: [usize; 2] = [64, 128];

/// Runs of 1 to 40 rows covering the `n` rows of `hd` of `k` and `v`, as paged blocks give them.
fn uneven_runs<'a>(k: &'a [f16], v: &'a [f16], n: usize, hd: usize, rng: &mut StdRng) -> Vec<KvRun<'a>> {
    let mut runs = Vec::new();
    let mut at = 0;
    while at < n {
        let len = rng.random_range(1..=40).min(n - at);
        runs.push(KvRun::f16(&k[at * hd..(at + len) * hd], &v[at * hd..(at + len) * hd]));
        at += len;
    }
    runs
}

/// Random K and V rows (heads of `hd`) of `n_ctx` positions for each of `n_kv` KV heads.
fn random_kv(rng: &mut StdRng, n_kv: usize, n_ctx: usize, hd: usize) -> Vec<(Vec<f16>, Vec<f16>)> {
    (0..n_kv)
        .map(|_| {
            let mut row = || (0..n_ctx * hd).map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0))).collect::<Vec<_>>();
            (row(), row())
        })
        .collect()
}

fn widened(x: &[f16]) -> Vec<f32> {
    x.iter().map(|x| x.to_f32()).collect()
}

/// Each head's output (`[head][hd]`) and log-sum-exp against `twin(head, out) -> lse`, bit for bit.
fn assert_heads_equal(out: &[f32], lse: &[f32], what: &str, mut twin: impl FnMut(usize, &mut [f32]) -> f32) {
    let hd = out.len() / lse.len();
    for (g, &l) in lse.iter().enumerate() {
        let mut expected = vec![0f32; hd];
        let expected_lse = twin(g, &mut expected);
        let fast = &out[g * hd..(g + 1) * hd];
        assert!(fast.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits()), "{what} head {g}: outputs differ");
        assert_eq!(l.to_bits(), expected_lse.to_bits(), "{what} head {g}: lse");
    }
}

/// Contexts and ranges of the two-pass kernels' tests, `(n_ctx, start, end)`: ranges that
/// start and end inside 64-position lane chunks, shorter than one chunk, in the f64 tail
/// only, and past 2048 positions.
const TWO_PASS_CASES: &[(usize, usize, usize)] = &[
    (1, 0, 1),
    (17, 0, 17),
    (64, 0, 64),
    (65, 0, 65),
    (200, 37, 200),
    (200, 0, 130),
    (1000, 999, 1000),
    (1000, 960, 1000),
    (300, 250, 300),
    (130, 100, 130),
    (1024, 0, 1024),
    (3000, 0, 3000),
    (5000, 1, 5000),
    (5000, 2100, 4993),
];

/// A two-pass group kernel, `kernel(runs, start, end, n_padded, scale, q, out, lse)`, against
/// `decode_attention_range` run per query head on widened rows (itself bit-identical to the
/// scalar twins), bit for bit: heads of 64 and 128, every group size it is built for, the
/// ranges of `TWO_PASS_CASES`, runs of uneven length, sharp and flat softmaxes.
#[allow(clippy::type_complexity)]
fn check_two_pass_kernel(seed: u64, mut kernel: impl FnMut(&[KvRun<'_>], usize, usize, usize, f32, &[f32], &mut [f32], &mut [f32])) {
    use duet_kernels::attention::{attn_scale, decode_attention_range, padded_len, KV_PADDING};
    let mut rng = StdRng::seed_from_u64(seed);
    for hd in HEAD_DIMS {
        for (case, &(n_ctx, start, end)) in TWO_PASS_CASES.iter().enumerate() {
            for group in 1..=8 {
                let n = end - start;
                let gain = if (case + group).is_multiple_of(2) { 1.0 } else { 8.0 };
                let k: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0))).collect();
                let v: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0))).collect();
                let q: Vec<f32> = (0..group * hd).map(|_| rng.random_range(-1.0f32..1.0) * gain).collect();
                let runs = uneven_runs(&k, &v, n, hd, &mut rng);
                let n_padded = padded_len(n_ctx, KV_PADDING);
                let scale = attn_scale(hd);
                let (mut out, mut lse) = (vec![0f32; group * hd], vec![0f32; group]);
                kernel(&runs, start, end, n_padded, scale, &q, &mut out, &mut lse);
                let (kw, vw) = (widened(&k), widened(&v));
                assert_heads_equal(&out, &lse, &format!("heads of {hd}, n_ctx {n_ctx} range {start}..{end} group {group}"), |g, twin| {
                    decode_attention_range(&q[g * hd..(g + 1) * hd], &kw, &vw, start..end, n_padded, scale, twin)
                });
            }
        }
    }
}

/// The AVX-512 two-pass group kernel against the per-head twin (`check_two_pass_kernel`).
#[test]
fn avx512_group_attention_equals_per_head_twin_bit_for_bit() {
    use duet_kernels::attention_avx512::{attend_group, FastScratch};
    if kernels::isa() < Isa::Avx512 {
        println!("SKIPPED: this CPU (or DUET_ISA) has no AVX-512; the AVX-512 attention kernel is not run");
        return;
    }
    let mut scratch = FastScratch::default();
    check_two_pass_kernel(512, |runs, start, end, n_padded, scale, q, out, lse| {
        // SAFETY: AVX-512 was detected (checked above).
        unsafe { attend_group(runs, start, end, n_padded, scale, false, q, out, lse, &mut scratch) }
    });
}

/// The two-pass AVX2 group kernel (CPUs without AVX-512; run directly, so AVX-512 machines
/// test it too) against the per-head twin (`check_two_pass_kernel`).
#[test]
fn avx2_group_attention_equals_per_head_twin_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    {
        use duet_kernels::attention_avx2::{attend_group, Avx2Scratch};
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
            println!("SKIPPED: this CPU has no AVX2; the two-pass AVX2 attention kernel is not run");
            return;
        }
        let mut scratch = Avx2Scratch::default();
        check_two_pass_kernel(513, |runs, start, end, n_padded, scale, q, out, lse| {
            // SAFETY: AVX2, FMA and F16C were detected (checked above).
            unsafe { attend_group(runs, start, end, n_padded, scale, false, q, out, lse, &mut scratch) }
        });
    }
}

/// Inputs of a one-pass group kernel test: K and V rows of `n` positions (heads of `hd`) and
/// the group's queries; by `case` and `group`, a sharp softmax (`gain` 8) or a flat one, or
/// keys growing with the position (`rising`: later blocks score higher, so the running maximum
/// is raised in most blocks).
struct OnlineCase {
    k: Vec<f16>,
    v: Vec<f16>,
    q: Vec<f32>,
    gain: f32,
    rising: bool,
}

impl OnlineCase {
    fn new(rng: &mut StdRng, hd: usize, n: usize, case: usize, group: usize) -> Self {
        let gain = if (case + group).is_multiple_of(2) { 1.0 } else { 8.0 };
        let rising = (case + group).is_multiple_of(3);
        let k: Vec<f16> = (0..n * hd)
            .map(|i| {
                let x = rng.random_range(-1.0f32..1.0);
                f16::from_f32(if rising { x.abs() * (1.0 + (i / hd) as f32 / 64.0) } else { x })
            })
            .collect();
        let v: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0))).collect();
        let q: Vec<f32> = (0..group * hd).map(|_| if rising { rng.random_range(0.0f32..1.0) } else { rng.random_range(-1.0f32..1.0) * gain }).collect();
        OnlineCase { k, v, q, gain, rising }
    }
}

/// The one-pass (online softmax) AVX-512 group kernel against `decode_attention_online` run
/// per query head on widened rows: every group size, blocks whole and partial (ranges of 1
/// to 2048 positions), runs of uneven length, sharp and flat softmaxes, and scores rising
/// along the range (the running maximum raised, and the sums rescaled, in most blocks).
#[test]
fn avx512_online_group_attention_equals_twin_bit_for_bit() {
    use duet_kernels::attention::{attn_scale, decode_attention_online};
    use duet_kernels::attention_avx512::{attend_group_online, FastScratch};
    if kernels::isa() < Isa::Avx512 {
        println!("SKIPPED: this CPU (or DUET_ISA) has no AVX-512; the one-pass AVX-512 attention kernel is not run");
        return;
    }
    let mut rng = StdRng::seed_from_u64(2048);
    let mut scratch = FastScratch::default();
    for hd in HEAD_DIMS {
        for (case, &n) in [1usize, 5, 16, 17, 31, 64, 100, 333, 2048].iter().enumerate() {
            for group in 1..=8 {
                let OnlineCase { k, v, q, gain: _, rising } = OnlineCase::new(&mut rng, hd, n, case, group);
                let runs = uneven_runs(&k, &v, n, hd, &mut rng);
                let scale = attn_scale(hd);
                let (mut out, mut lse) = (vec![0f32; group * hd], vec![0f32; group]);
                // SAFETY: AVX-512 was detected (checked above).
                unsafe { attend_group_online(&runs, n, scale, &q, &mut out, &mut lse, &mut scratch) };
                let (kw, vw) = (widened(&k), widened(&v));
                assert_heads_equal(&out, &lse, &format!("heads of {hd}, n {n} group {group} (rising {rising})"), |g, twin| {
                    decode_attention_online(&q[g * hd..(g + 1) * hd], &kw, &vw, n, scale, twin)
                });
            }
        }
    }
}

/// The one-pass AVX2 group kernel (CPUs without AVX-512; run directly, so AVX-512 machines
/// test it too) against `decode_attention_online` per query head: f16 and Q8_0 rows, every
/// group size, blocks whole and partial, runs of uneven length, sharp and flat softmaxes, and
/// scores rising along the range (the running maximum raised in most blocks).
#[test]
fn avx2_online_group_attention_equals_twin_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    {
        use duet_kernels::attention::{attn_scale, decode_attention_online, Q8_0_BLOCK_BYTES};
        use duet_kernels::attention_avx2::{attend_group_online, Avx2Scratch};
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
            println!("SKIPPED: this CPU has no AVX2; the one-pass AVX2 attention kernel is not run");
            return;
        }
        let mut rng = StdRng::seed_from_u64(2049);
        let mut scratch = Avx2Scratch::default();
        for hd in HEAD_DIMS {
            for (case, &n) in [1usize, 5, 8, 9, 16, 17, 31, 64, 100, 333, 2048].iter().enumerate() {
                for group in 1..=8 {
                    let OnlineCase { k, v, q, gain, rising } = OnlineCase::new(&mut rng, hd, n, case, group);
                    let scale = attn_scale(hd);
                    let what = format!("heads of {hd}, n {n} group {group} (rising {rising})");
                    let runs = uneven_runs(&k, &v, n, hd, &mut rng);
                    let (mut out, mut lse) = (vec![0f32; group * hd], vec![0f32; group]);
                    // SAFETY: AVX2, FMA and F16C were detected (checked above).
                    unsafe { attend_group_online(&runs, n, scale, &q, &mut out, &mut lse, &mut scratch) };
                    let (kw, vw) = (widened(&k), widened(&v));
                    assert_heads_equal(&out, &lse, &what, |g, twin| decode_attention_online(&q[g * hd..(g + 1) * hd], &kw, &vw, n, scale, twin));
                    // The same rows as Q8_0 blocks, in one run.
                    let (_, kq) = random_q8_0(&mut rng, n, hd, gain);
                    let (_, vq) = random_q8_0(&mut rng, n, hd, 1.0);
                    assert_eq!(kq.len(), n * hd / 32 * Q8_0_BLOCK_BYTES);
                    let (mut kw, mut vw) = (vec![0f32; n * hd], vec![0f32; n * hd]);
                    kernels::widen_q8_0_scalar(&kq, &mut kw);
                    kernels::widen_q8_0_scalar(&vq, &mut vw);
                    let runs = [KvRun { k: KvRows::Q8_0(&kq), v: KvRows::Q8_0(&vq) }];
                    // SAFETY: as above.
                    unsafe { attend_group_online(&runs, n, scale, &q, &mut out, &mut lse, &mut scratch) };
                    assert_heads_equal(&out, &lse, &format!("q8_0 {what}"), |g, twin| decode_attention_online(&q[g * hd..(g + 1) * hd], &kw, &vw, n, scale, twin));
                }
            }
        }
    }
}

/// The one-pass arithmetic computes the same attention as llama.cpp's two passes, to float
/// rounding: `decode_attention_online` against `decode_attention_range` (output within 2e-6
/// of the largest |V|-weighted value, log-sum-exp within 1e-5), on flat, sharp and rising
/// score profiles.
#[test]
fn online_decode_attention_matches_two_pass_attention() {
    use duet_kernels::attention::{attn_scale, decode_attention_online, decode_attention_range};
    let mut rng = StdRng::seed_from_u64(4096);
    for &(n, gain, rising) in &[(1usize, 1.0f32, false), (40, 1.0, false), (700, 8.0, false), (2048, 1.0, true), (1500, 12.0, true)] {
        let k: Vec<f32> = (0..n * 64)
            .map(|i| {
                let x = rng.random_range(-1.0f32..1.0);
                f16::from_f32(if rising { x.abs() * (1.0 + (i / 64) as f32 / 256.0) } else { x }).to_f32()
            })
            .collect();
        let v: Vec<f32> = (0..n * 64).map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0)).to_f32()).collect();
        let q: Vec<f32> = (0..64).map(|_| rng.random_range(-1.0f32..1.0) * gain).collect();
        let (mut online, mut two_pass) = (vec![0f32; 64], vec![0f32; 64]);
        let scale = attn_scale(64);
        let lse_online = decode_attention_online(&q, &k, &v, n, scale, &mut online);
        let lse_two = decode_attention_range(&q, &k, &v, 0..n, n.next_multiple_of(32), scale, &mut two_pass);
        let worst = online.iter().zip(&two_pass).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        // The two-pass weights are rounded to f16 (relative 2^-11): that is the difference.
        assert!(worst < 1e-3, "n {n} gain {gain} rising {rising}: outputs differ by {worst}");
        assert!((lse_online - lse_two).abs() < 1e-4 * lse_two.abs().max(1.0), "n {n}: lse {lse_online} vs {lse_two}");
        // Exact (f64) attention: the one-pass result is the closer of the two.
        let s: Vec<f64> = (0..n).map(|i| (0..64).map(|d| f16::from_f32(q[d]).to_f64() * k[i * 64 + d] as f64).sum::<f64>() * scale as f64).collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        let exact: Vec<f64> = (0..64).map(|d| (0..n).map(|i| (s[i] - m).exp() / z * v[i * 64 + d] as f64).sum()).collect();
        let err = |o: &[f32]| o.iter().zip(&exact).map(|(a, e)| (*a as f64 - e).abs()).fold(0f64, f64::max);
        assert!(err(&online) < 2e-6, "n {n} gain {gain} rising {rising}: one-pass error {} (two-pass {})", err(&online), err(&two_pass));
    }
}

/// Prefill attention (several query tokens, causal, after `pos0` cached positions) on the
/// dispatched path — the AVX-512 or AVX2 group kernel with tinyBLAS's arithmetic where the
/// CPU has one — against the widened one-head-at-a-time path, bit for bit: first prompts and second
/// turns, group sizes 1 to 8, prompts crossing the kernel's 2048-position windows.
#[test]
fn prefill_attention_equals_widened_twin_bit_for_bit() {
    use duet_kernels::attention::{AttnShape, KvHead};
    use duet_kernels::causal::{causal_attention, causal_attention_widened};
    if kernels::isa() < Isa::Avx2 {
        println!("SKIPPED: this CPU (or DUET_ISA) has no AVX2; prefill runs the widened path itself");
    }
    let mut rng = StdRng::seed_from_u64(1024);
    let cases = [(64, 3, 3, 0, 2), (64, 3, 3, 0, 37), (64, 3, 3, 300, 17), (64, 1, 2, 5, 9), (64, 4, 2, 0, 64), (64, 8, 1, 2040, 20), (64, 2, 1, 0, 2100)];
    let cases_128 = [(128, 4, 2, 0, 37), (128, 1, 2, 300, 17), (128, 8, 1, 2040, 20), (128, 2, 1, 0, 2100)];
    for &(hd, group, n_kv, pos0, n_tok) in cases.iter().chain(&cases_128) {
        let shape = AttnShape { n_head: group * n_kv, n_kv_head: n_kv, head_dim: hd, softcap: None };
        let n_ctx = pos0 + n_tok;
        let gain = if n_tok % 2 == 0 { 1.0 } else { 6.0 };
        let kv_data = random_kv(&mut rng, n_kv, n_ctx, hd);
        let kv: Vec<KvHead<'_>> = kv_data.iter().map(|(k, v)| KvHead { k: KvRows::F16(k), v: KvRows::F16(v) }).collect();
        let q: Vec<f32> = (0..n_tok * shape.n_head * hd).map(|_| rng.random_range(-1.0f32..1.0) * gain).collect();
        let (mut fast, mut twin) = (vec![0f32; q.len()], vec![0f32; q.len()]);
        causal_attention(&q, &kv, shape, pos0, &mut fast);
        causal_attention_widened(&q, &kv, shape, pos0, &mut twin);
        let first_bad = fast.iter().zip(&twin).position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(first_bad.is_none(), "heads of {hd}, group {group} x {n_kv} kv heads, pos0 {pos0}, {n_tok} tokens: differs at {first_bad:?}");
    }
}

/// `decode_group` (the one entry every decode path takes) picks the arithmetic by the context:
/// a context that fits in one `DECODE_CHUNK` gets ggml's two passes, each chunk of a longer
/// one the one-pass online softmax — on any instruction set (per-head twins here).
#[test]
fn decode_group_picks_the_arithmetic_by_context_length() {
    use duet_kernels::attention::{attn_scale, decode_attention_online, decode_attention_range, padded_len, KV_PADDING};
    use duet_kernels::decode_batch::{decode_group, GroupScratch, DECODE_CHUNK};
    let mut rng = StdRng::seed_from_u64(77);
    let mut scratch = GroupScratch::default();
    let group = 3;
    // (context, range): one chunk; the first and the last chunk of a longer context.
    let ranges = [(1500usize, 0usize, 1500usize), (DECODE_CHUNK + 500, 0, DECODE_CHUNK), (DECODE_CHUNK + 500, DECODE_CHUNK, DECODE_CHUNK + 500)];
    for (hd, &(n_ctx, start, end)) in HEAD_DIMS.into_iter().flat_map(|hd| ranges.iter().map(move |r| (hd, r))) {
        let n = end - start;
        let k: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0))).collect();
        let v: Vec<f16> = (0..n * hd).map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0))).collect();
        let q: Vec<f32> = (0..group * hd).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let n_padded = padded_len(n_ctx, KV_PADDING);
        let scale = attn_scale(hd);
        let (mut out, mut lse) = (vec![0f32; group * hd], vec![0f32; group]);
        decode_group(&[KvRun::f16(&k, &v)], start..end, n_padded, scale, &q, &mut out, &mut lse, &mut scratch);
        let (kw, vw) = (widened(&k), widened(&v));
        assert_heads_equal(&out, &lse, &format!("heads of {hd}, context {n_ctx} range {start}..{end}"), |g, twin| {
            let qh = &q[g * hd..(g + 1) * hd];
            if n_ctx > DECODE_CHUNK {
                decode_attention_online(qh, &kw, &vw, n, scale, twin)
            } else {
                decode_attention_range(qh, &kw, &vw, start..end, n_padded, scale, twin)
            }
        });
    }
    println!("kernels::isa() = {:?}", kernels::isa());
}

/// With a sliding window (Gemma 3's layers) the AVX-512 prefill kernel, given the window's
/// rows at their absolute positions, still equals the widened twin bit for bit; and the window
/// changes the result (it is not ignored).
#[test]
fn windowed_prefill_attention_equals_widened_twin_bit_for_bit() {
    use duet_kernels::attention::{AttnShape, KvHead};
    use duet_kernels::causal::{causal_attention, causal_attention_widened_windowed, causal_attention_windowed};
    let mut rng = StdRng::seed_from_u64(4096);
    for &(group, n_kv, pos0, n_tok, window) in &[(2, 2, 0, 40, 8), (4, 1, 30, 17, 16), (1, 2, 0, 3, 1), (2, 1, 100, 33, 512)] {
        let shape = AttnShape { n_head: group * n_kv, n_kv_head: n_kv, head_dim: 64, softcap: None };
        let n_ctx = pos0 + n_tok;
        let kv_data = random_kv(&mut rng, n_kv, n_ctx, 64);
        let kv: Vec<KvHead<'_>> = kv_data.iter().map(|(k, v)| KvHead { k: KvRows::F16(k), v: KvRows::F16(v) }).collect();
        let q: Vec<f32> = (0..n_tok * shape.n_head * 64).map(|_| rng.random_range(-1.0f32..1.0) * 4.0).collect();
        let (mut fast, mut twin, mut full) = (vec![0f32; q.len()], vec![0f32; q.len()], vec![0f32; q.len()]);
        causal_attention_windowed(&q, &kv, shape, pos0, Some(window), &mut fast);
        causal_attention_widened_windowed(&q, &kv, shape, pos0, Some(window), &mut twin);
        causal_attention(&q, &kv, shape, pos0, &mut full);
        let first_bad = fast.iter().zip(&twin).position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(first_bad.is_none(), "window {window}, group {group} x {n_kv}, pos0 {pos0}, {n_tok} tokens: differs at {first_bad:?}");
        assert_eq!(fast == full, window >= n_ctx, "window {window} of a context of {n_ctx}: changes the result exactly when it cuts");
    }
}

/// Random K or V rows of `n` positions (heads of `hd`) as f32 and as Q8_0 blocks of them.
fn random_q8_0(rng: &mut StdRng, n: usize, hd: usize, gain: f32) -> (Vec<f32>, Vec<u8>) {
    use duet_kernels::dot::quantize_row;
    use duet_kernels::GgmlType;
    let x: Vec<f32> = (0..n * hd).map(|_| rng.random_range(-1.0f32..1.0) * gain).collect();
    let mut q = vec![0u8; GgmlType::Q8_0.row_bytes(n * hd)];
    quantize_row(GgmlType::Q8_0, &x, &mut q);
    (x, q)
}

/// Q8_0 K/V rows through `decode_group` (the AVX-512 one-pass kernel where the CPU has it) —
/// in one run and in uneven runs, contexts inside one chunk and past it, every group size —
/// against `decode_attention_online` per head over the scalar twin's dequantised values, bit
/// for bit; and the same attention from f16 rows of the unquantised values is within Q8_0's
/// rounding.
#[test]
fn q8_0_decode_attention_equals_online_twin_bit_for_bit() {
    use duet_kernels::attention::{attn_scale, decode_attention_online, padded_len, KV_PADDING, Q8_0_BLOCK_BYTES};
    use duet_kernels::decode_batch::{decode_group, GroupScratch, DECODE_CHUNK};
    let mut rng = StdRng::seed_from_u64(808);
    let mut scratch = GroupScratch::default();
    for hd in HEAD_DIMS {
        let row = hd / 32 * Q8_0_BLOCK_BYTES;
        for (case, &(n, n_ctx)) in [(1usize, 1usize), (17, 17), (100, 700), (333, 333), (DECODE_CHUNK, DECODE_CHUNK + 40)].iter().enumerate() {
            for group in 1..=8 {
                let (k32, k) = random_q8_0(&mut rng, n, hd, 1.0);
                let (v32, v) = random_q8_0(&mut rng, n, hd, 1.0);
                let q: Vec<f32> = (0..group * hd).map(|_| rng.random_range(-1.0f32..1.0) * if case % 2 == 0 { 1.0 } else { 6.0 }).collect();
                let (mut kw, mut vw) = (vec![0f32; n * hd], vec![0f32; n * hd]);
                kernels::widen_q8_0_scalar(&k, &mut kw);
                kernels::widen_q8_0_scalar(&v, &mut vw);
                let scale = attn_scale(hd);
                let n_padded = padded_len(n_ctx, KV_PADDING);
                let mut cut = Vec::new();
                let mut at = 0;
                while at < n {
                    let len = rng.random_range(1..=40).min(n - at);
                    cut.push(KvRun { k: KvRows::Q8_0(&k[at * row..(at + len) * row]), v: KvRows::Q8_0(&v[at * row..(at + len) * row]) });
                    at += len;
                }
                for runs in [vec![KvRun { k: KvRows::Q8_0(&k), v: KvRows::Q8_0(&v) }], cut] {
                    let (mut out, mut lse) = (vec![0f32; group * hd], vec![0f32; group]);
                    decode_group(&runs, 0..n, n_padded, scale, &q, &mut out, &mut lse, &mut scratch);
                    let what = format!("q8_0 heads of {hd}, n {n} of {n_ctx}, group {group}, {} runs", runs.len());
                    assert_heads_equal(&out, &lse, &what, |g, twin| decode_attention_online(&q[g * hd..(g + 1) * hd], &kw, &vw, n, scale, twin));
                    // The f16 cache of the unquantised rows gives nearly the same attention.
                    let (k16, v16): (Vec<f16>, Vec<f16>) = (k32.iter().map(|&x| f16::from_f32(x)).collect(), v32.iter().map(|&x| f16::from_f32(x)).collect());
                    let (mut exact, mut lse16) = (vec![0f32; group * hd], vec![0f32; group]);
                    decode_group(&[KvRun::f16(&k16, &v16)], 0..n, n_padded, scale, &q, &mut exact, &mut lse16, &mut scratch);
                    let worst = out.iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(worst < 0.03, "{what}: {worst} from the f16 cache's attention");
                }
            }
        }
    }
}

/// A prompt's attention over a Q8_0 cache (the AVX-512 one-pass kernel per token where the CPU
/// has it) is the widened twin's bit for bit, and the f16 cache's attention of the unquantised
/// rows to within Q8_0's rounding (so the rows are read where they lie, whole blocks per row);
/// a single token's is the one-pass twin's over the dequantised rows, bit for bit.
#[test]
fn q8_0_prefill_attention_is_the_f16_attention_within_rounding() {
    use duet_kernels::attention::{attn_scale, decode_attention_online, AttnShape, KvHead};
    use duet_kernels::causal::{causal_attention, causal_attention_widened};
    let mut rng = StdRng::seed_from_u64(909);
    for &(hd, group, n_kv, pos0, n_tok) in &[(64, 3, 3, 0, 37), (64, 4, 2, 300, 17), (128, 4, 2, 0, 33), (128, 2, 1, 100, 1), (64, 1, 2, 40, 1)] {
        let shape = AttnShape { n_head: group * n_kv, n_kv_head: n_kv, head_dim: hd, softcap: None };
        let n_ctx = pos0 + n_tok;
        let data: Vec<_> = (0..n_kv).map(|_| (random_q8_0(&mut rng, n_ctx, hd, 1.0), random_q8_0(&mut rng, n_ctx, hd, 1.0))).collect();
        let quantised: Vec<KvHead<'_>> = data.iter().map(|((_, k), (_, v))| KvHead { k: KvRows::Q8_0(k), v: KvRows::Q8_0(v) }).collect();
        let halves: Vec<(Vec<f16>, Vec<f16>)> =
            data.iter().map(|((k, _), (v, _))| (k.iter().map(|&x| f16::from_f32(x)).collect(), v.iter().map(|&x| f16::from_f32(x)).collect())).collect();
        let f16_cache: Vec<KvHead<'_>> = halves.iter().map(|(k, v)| KvHead { k: KvRows::F16(k), v: KvRows::F16(v) }).collect();
        let q: Vec<f32> = (0..n_tok * shape.n_head * hd).map(|_| rng.random_range(-1.0f32..1.0) * 3.0).collect();
        let (mut got, mut want, mut twin) = (vec![0f32; q.len()], vec![0f32; q.len()], vec![0f32; q.len()]);
        causal_attention(&q, &quantised, shape, pos0, &mut got);
        causal_attention(&q, &f16_cache, shape, pos0, &mut want);
        // The dispatched path (the AVX-512 one-pass kernel per token) is the widened twin's.
        causal_attention_widened(&q, &quantised, shape, pos0, &mut twin);
        let first_bad = got.iter().zip(&twin).position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(first_bad.is_none(), "heads of {hd}, pos0 {pos0}, {n_tok} tokens: differs from the widened twin at {first_bad:?}");
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 0.03, "heads of {hd}, pos0 {pos0}, {n_tok} tokens: {worst} from the f16 cache's attention");
        if n_tok == 1 {
            for h in 0..shape.n_head {
                let ((_, k), (_, v)) = &data[h / group];
                let (mut kw, mut vw) = (vec![0f32; n_ctx * hd], vec![0f32; n_ctx * hd]);
                kernels::widen_q8_0_scalar(k, &mut kw);
                kernels::widen_q8_0_scalar(v, &mut vw);
                let mut twin = vec![0f32; hd];
                decode_attention_online(&q[h * hd..(h + 1) * hd], &kw, &vw, n_ctx, attn_scale(hd), &mut twin);
                assert!(got[h * hd..(h + 1) * hd].iter().zip(&twin).all(|(a, b)| a.to_bits() == b.to_bits()), "decode head {h}");
            }
        }
    }
}

/// `widen_q8_0`'s SIMD path equals its scalar twin, and both are `d · q`.
#[test]
fn widen_q8_0_equals_scalar_twin() {
    let mut rng = StdRng::seed_from_u64(5);
    for n in [32usize, 64, 128, 4096] {
        let (x, q) = random_q8_0(&mut rng, n, 1, 3.0);
        let (mut fast, mut twin) = (vec![0f32; n], vec![0f32; n]);
        kernels::widen_q8_0(&q, &mut fast);
        kernels::widen_q8_0_scalar(&q, &mut twin);
        assert!(fast.iter().zip(&twin).all(|(a, b)| a.to_bits() == b.to_bits()), "n {n}");
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(x.iter().zip(&twin).all(|(a, b)| (a - b).abs() <= amax / 127.0), "n {n}: dequantised values within a step");
    }
}
