//! Causal attention of a sequence's new rows over its cache: every query token sees the
//! positions up to its own (within its sliding window, if any). Prefill rows run the scalar
//! twins' arithmetic per head (the AVX-512 or AVX2 group kernels for heads of 64 and 128; over a Q8_0
//! cache each token's one-pass attention over its prefix); a single decode token goes through
//! the decode fan-out ([`decode_batch`]).

use std::ops::Range;

use rayon::prelude::*;

use super::attention::{decode_attention_online, padded_len, run, window_start, AttnShape, Job, KvHead, KvRows, KvRun, Scores, KV_PADDING};
use super::decode_batch::{decode_batch, DecodeQuery};
use super::{isa, Isa};

/// Attention of `n_tok` query tokens at positions `pos0..pos0 + n_tok` over the cache, each
/// token seeing positions `0..=its own` (causal). `q` and `out` are `[token][head][head_dim]`;
/// `kv[h]` must hold at least `pos0 + n_tok` positions already written.
pub fn causal_attention(q: &[f32], kv: &[KvHead<'_>], shape: AttnShape, pos0: usize, out: &mut [f32]) {
    causal_attention_windowed(q, kv, shape, pos0, None, out)
}

/// [`causal_attention`], each token seeing only the positions of its sliding `window` when one
/// is given ([`window_start`]); the V lanes still follow absolute positions, so the result is
/// what llama.cpp's masked attention gives.
pub fn causal_attention_windowed(q: &[f32], kv: &[KvHead<'_>], shape: AttnShape, pos0: usize, window: Option<usize>, out: &mut [f32]) {
    let Causal { n_kv_head, hd, n_tok, n_ctx, group, scores, n_padded, .. } = Causal::of(q, kv, shape, pos0, out);
    if n_tok == 1 {
        // Decode: each KV head's query group in one pass over its rows, chunk by chunk, the
        // (head, chunk) pairs in parallel.
        let query = DecodeQuery { q, range: window_start(n_ctx - 1, window)..n_ctx, n_ctx };
        let rows = |_, h: usize, c: Range<usize>| {
            Ok::<_, std::convert::Infallible>(vec![KvRun { k: kv[h].k.slice(c.start * hd..c.end * hd), v: kv[h].v.slice(c.start * hd..c.end * hd) }])
        };
        let Ok(mut parts) = decode_batch(&[query], shape, KV_PADDING, 0, rows);
        out.copy_from_slice(&parts.remove(0).0);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa() >= Isa::Avx2
        && super::attention_rows::supports_head_dim(hd)
        && group <= super::attention_rows::MAX_GROUP
        && scores.softcap.is_none()
        && kv.iter().all(|h| h.k.f16().is_some() == h.v.f16().is_some())
    {
        // Prefill: per token and KV head, the query group over the token's causal prefix in
        // one pass over the rows: f16 rows with tinyBLAS's arithmetic, Q8_0 rows with the
        // one-pass online softmax (see `KvRows`).
        let (q8, scale) = (quantised(kv), scores.scale);
        let groups = PrefillGroups { q, kv, n_kv_head, group, hd, pos0, window };
        if isa() == Isa::Avx512 {
            groups.run(out, |run, first, len, q, o, lse, scratch: &mut super::attention_avx512::FastScratch| {
                // SAFETY: AVX-512 F/BW/VL/DQ (with AVX2, FMA, F16C) were detected by `isa()`.
                unsafe {
                    if q8 {
                        super::attention_avx512::attend_group_online(&[run], len - first, scale, q, o, lse, scratch)
                    } else {
                        super::attention_avx512::attend_group(&[run], first, len, n_padded, scale, true, q, o, lse, scratch)
                    }
                }
            });
        } else {
            groups.run(out, |run, first, len, q, o, lse, scratch: &mut super::attention_avx2::Avx2Scratch| {
                // SAFETY: AVX2, FMA and F16C were detected by `isa()`.
                unsafe {
                    if q8 {
                        super::attention_avx2::attend_group_online(&[run], len - first, scale, q, o, lse, scratch)
                    } else {
                        super::attention_avx2::attend_group(&[run], first, len, n_padded, scale, true, q, o, lse, scratch)
                    }
                }
            });
        }
        return;
    }
    causal_attention_widened_windowed(q, kv, shape, pos0, window, out);
}

/// [`causal_attention`] on K/V widened to f32 once for all query tokens, one query head and
/// token at a time: the path of machines without AVX2 (and of heads other than 64 and 128,
/// and of soft-capped scores), and the twin the group kernels are tested against.
pub fn causal_attention_widened(q: &[f32], kv: &[KvHead<'_>], shape: AttnShape, pos0: usize, out: &mut [f32]) {
    causal_attention_widened_windowed(q, kv, shape, pos0, None, out)
}

/// [`causal_attention_widened`] with a sliding window, as [`causal_attention_windowed`].
pub fn causal_attention_widened_windowed(q: &[f32], kv: &[KvHead<'_>], shape: AttnShape, pos0: usize, window: Option<usize>, out: &mut [f32]) {
    let Causal { n_head, hd, n_tok, n_ctx, group, scores, n_padded, .. } = Causal::of(q, kv, shape, pos0, out);
    // Widen each KV head once for all query tokens.
    let widened: Vec<(Vec<f32>, Vec<f32>)> = kv
        .par_iter()
        .map(|h| {
            let (mut k, mut v) = (vec![0f32; n_ctx * hd], vec![0f32; n_ctx * hd]);
            h.k.slice(0..n_ctx * hd).widen_into(&mut k);
            h.v.slice(0..n_ctx * hd).widen_into(&mut v);
            (k, v)
        })
        .collect();
    let q8 = quantised(kv);
    out.par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
        let (t, head) = (i / n_head, i % n_head);
        let (k, v) = &widened[head / group];
        let q_row = &q[i * hd..(i + 1) * hd];
        let (first, end) = (window_start(pos0 + t, window), pos0 + t + 1);
        if q8 {
            decode_attention_online(q_row, &k[first * hd..], &v[first * hd..], end - first, scores, o);
            return;
        }
        let job = Job { q: q_row, k: &k[first * hd..], v: &v[first * hd..], start: first, end, n_padded, hd, scores, tiled: n_tok >= 2 };
        run(&job, o);
    });
}

/// A prompt's (token, KV head) query groups, each over the token's causal prefix (within its
/// window), for a group kernel.
#[cfg(target_arch = "x86_64")]
struct PrefillGroups<'a> {
    q: &'a [f32],
    kv: &'a [KvHead<'a>],
    n_kv_head: usize,
    group: usize,
    hd: usize,
    pos0: usize,
    window: Option<usize>,
}

#[cfg(target_arch = "x86_64")]
impl PrefillGroups<'_> {
    /// Every group in parallel into its slice of `out`: `attend(rows, first, len, q, out, lse,
    /// scratch)` over the rows of positions `first..len`.
    #[allow(clippy::type_complexity)]
    fn run<S: Default + Send>(&self, out: &mut [f32], attend: impl Fn(KvRun<'_>, usize, usize, &[f32], &mut [f32], &mut [f32], &mut S) + Sync) {
        let PrefillGroups { q, kv, n_kv_head, group, hd, pos0, window } = *self;
        out.par_chunks_mut(group * hd).enumerate().for_each_init(S::default, |scratch, (i, o)| {
            let (t, h) = (i / n_kv_head, i % n_kv_head);
            let len = pos0 + t + 1;
            let first = window_start(len - 1, window);
            let run = KvRun { k: kv[h].k.slice(first * hd..len * hd), v: kv[h].v.slice(first * hd..len * hd) };
            let mut lse = [0f32; super::attention_rows::MAX_GROUP];
            attend(run, first, len, &q[i * group * hd..(i + 1) * group * hd], o, &mut lse[..group], scratch);
        });
    }
}

/// Whether the cache holds Q8_0 rows (attended with the one-pass arithmetic, token by token).
fn quantised(kv: &[KvHead<'_>]) -> bool {
    kv.iter().any(|h| matches!(h.k, KvRows::Q8_0(_)) || matches!(h.v, KvRows::Q8_0(_)))
}

/// The sizes of one causal attention call, checked.
struct Causal {
    n_head: usize,
    n_kv_head: usize,
    hd: usize,
    n_tok: usize,
    n_ctx: usize,
    group: usize,
    scores: Scores,
    n_padded: usize,
}

impl Causal {
    fn of(q: &[f32], kv: &[KvHead<'_>], shape: AttnShape, pos0: usize, out: &[f32]) -> Causal {
        let AttnShape { n_head, n_kv_head, head_dim: hd, .. } = shape;
        let n_tok = q.len() / (n_head * hd);
        let n_ctx = pos0 + n_tok;
        assert_eq!(kv.len(), n_kv_head, "one KvHead per KV head");
        assert_eq!(out.len(), q.len(), "attention output size");
        Causal { n_head, n_kv_head, hd, n_tok, n_ctx, group: n_head / n_kv_head, scores: shape.scores(), n_padded: padded_len(n_ctx, KV_PADDING) }
    }
}

