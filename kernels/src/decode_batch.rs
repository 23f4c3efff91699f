//! Decode attention of a batch of query tokens — the one fan-out every caller uses (the
//! single-process runner, the gpu-worker's own share, the cpu-workers' jobs): each token's
//! range split into [`DECODE_CHUNK`]-aligned chunks, every (token, KV head, chunk) a task on
//! rayon's pool running [`decode_group`] over K/V rows the caller hands in as slices, the
//! chunks merged by log-sum-exp ([`merge_partials`], which also merges partial results of
//! different devices).

use std::ops::Range;

use rayon::prelude::*;

use super::attention::{decode_attention_online, decode_attention_range, padded_len, AttnShape, KvRows, KvRun, Scores};
use super::{isa, Isa};

/// One decode token of [`decode_batch`]: its queries (`[n_head][head_dim]`) attending
/// positions `range` of its context of `n_ctx` positions (the whole context, or the share of
/// it computed here).
#[derive(Debug, Clone)]
pub struct DecodeQuery<'a> {
    pub q: &'a [f32],
    pub range: Range<usize>,
    pub n_ctx: usize,
}

/// A partial attention result of one token: the output (`[n_head][head_dim]`) and each query
/// head's log-sum-exp.
pub type Partial = (Vec<f32>, Vec<f32>);

/// Decode attention of every query of `queries` over its range, with the KV padding unit
/// `kv_padding` (llama.cpp's [`KV_PADDING`](super::attention::KV_PADDING)): returns each
/// query's output and log-sum-exps. `rows(query, kv_head, chunk)` gives the K/V rows of
/// positions `chunk` of a query's context for one KV head, in position order (one run per
/// block of a paged cache, or one slice); it is called for every task before any runs, so a
/// failure stops the batch before it computes anything. Each KV head's query group reads its
/// rows once. Jobs of fewer than `serial_below` (position, KV head) pairs run on the calling
/// thread: waking the pool costs more than it saves there (0: always in parallel).
///
/// Bit for bit what [`decode_group`] gives over a range within one chunk; a range covering a
/// token's whole context gives what `causal_attention` gives for it.
pub fn decode_batch<'k, E>(
    queries: &[DecodeQuery<'_>],
    shape: AttnShape,
    kv_padding: usize,
    serial_below: usize,
    mut rows: impl FnMut(usize, usize, Range<usize>) -> Result<Vec<KvRun<'k>>, E>,
) -> Result<Vec<Partial>, E> {
    let AttnShape { n_head, n_kv_head: n_kv, head_dim: hd, .. } = shape;
    let group = n_head / n_kv;
    let scores = shape.scores();
    let tasks = chunk_tasks(queries.iter().map(|q| q.range.clone()), n_kv);
    let runs = tasks.iter().map(|t| rows(t.item, t.kv_head, t.chunk.clone())).collect::<Result<Vec<_>, E>>()?;
    let positions: usize = queries.iter().map(|q| q.range.len()).sum::<usize>() * n_kv;
    let min_len = if positions < serial_below { tasks.len().max(1) } else { 1 };
    let parts: Vec<Partial> = tasks
        .par_iter()
        .zip(&runs)
        .with_min_len(min_len)
        .map_init(GroupScratch::default, |scratch, (ChunkTask { item, kv_head: h, chunk }, runs)| {
            let query = &queries[*item];
            let q = &query.q[h * group * hd..(h + 1) * group * hd];
            let (mut o, mut l) = (vec![0f32; group * hd], vec![0f32; group]);
            decode_group(runs, chunk.clone(), padded_len(query.n_ctx, kv_padding), scores, q, &mut o, &mut l, scratch);
            (o, l)
        })
        .collect();
    Ok(merge_chunk_tasks(&tasks, &parts, queries.len(), n_kv, group, hd))
}

/// A cpu-worker's decode attention jobs of fewer (position, KV head) pairs than this run on
/// the calling thread (`decode_batch`'s `serial_below`): waking the pool cost more than it
/// saved there (a batch-1 step of the 1B shape at depth 0–64: 0.6–0.8 ms of attention across
/// the pool, 0.5–0.55 on one thread, when the gpu-worker's own attention used it too; that
/// one is now always parallel, `duet_gpu_worker::device::host_attention::decode`).
pub const PARALLEL_MIN_POSITIONS: usize = 8192;

/// Decode attention over a long context is computed in chunks of this many positions,
/// aligned to multiples of it, and the chunks merged by log-sum-exp ([`decode_batch`] does both).
/// The chunks of one KV head can then run on different threads (a batch-1 step of a model with
/// three KV heads otherwise keeps one of two threads idle a third of the time), and every path
/// (single process, gpu-worker, cpu-worker) computes the same chunks, so they still agree bit
/// for bit. Within a chunk of a context that fits in one chunk the arithmetic is llama.cpp's;
/// the chunks of a longer context (whose merge llama.cpp does not do anyway) run in one pass
/// over K and V with an online softmax ([`decode_attention_online`](super::attention::decode_attention_online)).
pub const DECODE_CHUNK: usize = 2048;

/// The [`DECODE_CHUNK`]-aligned chunks of `range`, in order (none if it is empty).
fn decode_chunks(range: Range<usize>) -> impl Iterator<Item = Range<usize>> {
    let mut at = range.start;
    std::iter::from_fn(move || {
        if at >= range.end {
            return None;
        }
        let end = ((at / DECODE_CHUNK + 1) * DECODE_CHUNK).min(range.end);
        let chunk = at..end;
        at = end;
        Some(chunk)
    })
}

/// Merges the partial results `parts` of one token (`(out, lse)` each: `[head][head_dim]` and
/// one log-sum-exp per head, over disjoint position ranges) into `out`, head by head with
/// [`merge_partials`]'s arithmetic, and each head's log-sum-exp into `lse` where given: the
/// chunks of a long context, or the shares of a split token (the gpu-worker's and the
/// cpu-workers'). One part is copied unchanged.
pub fn merge_heads(parts: &[Partial], out: &mut [f32], mut lse: Option<&mut [f32]>) {
    assert!(!parts.is_empty(), "merge of no partial results");
    let n_head = parts[0].1.len();
    assert!(n_head > 0 && out.len().is_multiple_of(n_head), "{} outputs for {n_head} heads", out.len());
    assert!(parts.iter().all(|(o, l)| o.len() == out.len() && l.len() == n_head), "partial results of another shape");
    let hd = out.len() / n_head;
    // One scratch for every head: per head, allocating its parts, sum and output (three
    // vectors) cost as much as the arithmetic (a 64-row layer of 32 heads: 268 µs before).
    let mut acc = vec![0f64; hd];
    let mut lses = Vec::with_capacity(parts.len());
    for (h, oh) in out.chunks_exact_mut(hd).enumerate() {
        lses.clear();
        lses.extend(parts.iter().map(|p| p.1[h]));
        let total = merge_into(|i| &parts[i].0[h * hd..(h + 1) * hd], &lses, oh, &mut acc);
        if let Some(lse) = lse.as_deref_mut() {
            // `merge_lse` of these log-sum-exps, where the merge computed it already.
            lse[h] = total.map_or_else(|| merge_lse(&lses), |t| t as f32);
        }
    }
}

/// One decode task of [`chunk_tasks`]: a chunk of item (sequence) `item`'s range, for one KV
/// head's query group.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ChunkTask {
    item: usize,
    kv_head: usize,
    chunk: Range<usize>,
}

/// The decode tasks of `ranges` (one per item), every KV head of each: items and heads in
/// order, each (item, head)'s chunks (aligned to [`DECODE_CHUNK`]) consecutive and in
/// position order — the order [`merge_chunk_tasks`] merges them in.
fn chunk_tasks(ranges: impl IntoIterator<Item = Range<usize>>, n_kv_head: usize) -> Vec<ChunkTask> {
    let mut tasks = Vec::new();
    for (item, range) in ranges.into_iter().enumerate() {
        for kv_head in 0..n_kv_head {
            tasks.extend(decode_chunks(range.clone()).map(|chunk| ChunkTask { item, kv_head, chunk }));
        }
    }
    tasks
}

/// Merges the results `parts` of `tasks` (from [`chunk_tasks`], one part each) into one output
/// (`[head][head_dim]`, `n_kv_head * group` heads) and one log-sum-exp per query head for each
/// of `n_items` items. Heads without a task stay zero.
fn merge_chunk_tasks(tasks: &[ChunkTask], parts: &[Partial], n_items: usize, n_kv_head: usize, group: usize, hd: usize) -> Vec<Partial> {
    assert_eq!(tasks.len(), parts.len(), "one part per task");
    let mut results: Vec<Partial> = (0..n_items).map(|_| (vec![0f32; n_kv_head * group * hd], vec![0f32; n_kv_head * group])).collect();
    let mut at = 0;
    while at < tasks.len() {
        let (i, h) = (tasks[at].item, tasks[at].kv_head);
        let n = tasks[at..].iter().take_while(|t| (t.item, t.kv_head) == (i, h)).count();
        let (o, l) = &mut results[i];
        merge_heads(&parts[at..at + n], &mut o[h * group * hd..(h + 1) * group * hd], Some(&mut l[h * group..(h + 1) * group]));
        at += n;
    }
    results
}

/// Merges partial attention outputs of one query head over disjoint position ranges, each
/// given with its log-sum-exp: `o = Σ o_i · exp(lse_i − L)` with `L = ln Σ exp(lse_i)`,
/// in f64. A single part is returned unchanged, bit for bit; parts whose log-sum-exp is
/// −∞ (empty ranges) weigh nothing, and if all are, the output is zero. Panics if `parts`
/// is empty or the outputs differ in length.
pub fn merge_partials(parts: &[(&[f32], f32)]) -> Vec<f32> {
    assert!(!parts.is_empty(), "merge of no partial results");
    let dim = parts[0].0.len();
    assert!(parts.iter().all(|(o, _)| o.len() == dim), "partial outputs differ in length");
    let lses: Vec<f32> = parts.iter().map(|p| p.1).collect();
    let mut out = vec![0f32; dim];
    merge_into(|i| parts[i].0, &lses, &mut out, &mut vec![0f64; dim]);
    out
}

/// [`merge_partials`] of the parts `part(i)` with log-sum-exps `lses` into `out`, summing in
/// `acc` (`out.len()` values): the merged log-sum-exp (`merge_lse`'s value, in f64) where it
/// was computed, `None` where one part came back unchanged.
fn merge_into<'a>(part: impl Fn(usize) -> &'a [f32], lses: &[f32], out: &mut [f32], acc: &mut [f64]) -> Option<f64> {
    // A single part, or a single part that attended anything (the others being ranges a
    // sliding window cut away, which weigh nothing), comes back unchanged.
    let mut live = lses.iter().enumerate().filter(|(_, &l)| l != f32::NEG_INFINITY);
    if let (Some((i, _)), None) = (live.next(), live.next()) {
        out.copy_from_slice(part(i));
        return None;
    }
    if lses.len() == 1 {
        out.copy_from_slice(part(0));
        return None;
    }
    let total = merge_lse_f64(lses.iter().copied());
    if total == f64::NEG_INFINITY {
        out.fill(0.0);
        return Some(total);
    }
    acc.fill(0.0);
    for (i, &l) in lses.iter().enumerate() {
        let w = (l as f64 - total).exp();
        if w == 0.0 {
            continue;
        }
        for (a, &x) in acc.iter_mut().zip(part(i)) {
            *a += x as f64 * w;
        }
    }
    for (o, &a) in out.iter_mut().zip(acc.iter()) {
        *o = a as f32;
    }
    Some(total)
}

/// The log-sum-exp of merged parts: `ln Σ exp(lse_i)` (a single part unchanged), so that
/// merges compose.
pub fn merge_lse(lses: &[f32]) -> f32 {
    match lses {
        [l] => *l,
        _ => merge_lse_f64(lses.iter().copied()) as f32,
    }
}

fn merge_lse_f64(lses: impl Iterator<Item = f32> + Clone) -> f64 {
    let max = lses.clone().fold(f32::NEG_INFINITY, f32::max) as f64;
    if max == f64::NEG_INFINITY || !max.is_finite() {
        return max;
    }
    max + lses.map(|l| (l as f64 - max).exp()).sum::<f64>().ln()
}

/// Reusable buffers of [`decode_group`].
#[derive(Debug, Default)]
pub struct GroupScratch {
    k: Vec<f32>,
    v: Vec<f32>,
    #[cfg(target_arch = "x86_64")]
    fast: super::attention_avx512::FastScratch,
    #[cfg(target_arch = "x86_64")]
    avx2: super::attention_avx2::Avx2Scratch,
}

/// Decode attention of one KV head's query group over positions `range`, whose K/V rows are
/// `runs` in position order (adding up to `range.len()` rows): `q` and `out` are
/// `[group][head_dim]`, `lse` gets one log-sum-exp per head; `n_padded` and `scores` as in
/// [`decode_attention_range`], whose results these are, bit for bit, head by head — or, for a
/// context longer than one chunk (`n_padded > DECODE_CHUNK`), [`decode_attention_online`]'s.
/// The range lies within one [`DECODE_CHUNK`]: [`decode_batch`] splits longer ones and merges
/// the parts.
///
/// Q8_0 rows (`--kv-type q8_0`) always take [`decode_attention_online`]'s arithmetic over
/// their dequantised values. With AVX-512 and heads of 64 or 128 the group runs as one kernel
/// straight from the rows (`attention_avx512`), and with AVX2 too (`attention_avx2`);
/// otherwise the rows are widened once and each head runs the twin. Panics if the slices disagree.
#[allow(clippy::too_many_arguments)] // the rows, the range and the group's three slices
pub fn decode_group(
    runs: &[KvRun<'_>],
    range: Range<usize>,
    n_padded: usize,
    scores: impl Into<Scores>,
    q: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut GroupScratch,
) {
    let scores = scores.into();
    let group = lse.len();
    assert!(group > 0 && q.len() == out.len() && out.len().is_multiple_of(group), "query group slice sizes");
    let hd = out.len() / group;
    let n = range.end.saturating_sub(range.start);
    assert_eq!(runs.iter().map(|r| r.k.len()).sum::<usize>(), n * hd, "K rows cover the range");
    assert!(runs.iter().all(|r| r.v.len() == r.k.len()), "V rows match K rows");
    assert!(n == 0 || range.start / DECODE_CHUNK == (range.end - 1) / DECODE_CHUNK, "decode range {range:?} crosses a chunk boundary");
    // Q8_0 rows always take the one-pass arithmetic (see `KvRows`).
    let online = n_padded > DECODE_CHUNK || runs.iter().any(|r| matches!(r.k, KvRows::Q8_0(_)));
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 && super::attention_avx512::supports_head_dim(hd) && n > 0 && group <= super::attention_avx512::MAX_GROUP && scores.softcap.is_none() {
        let scale = scores.scale;
        if online {
            // SAFETY: as below.
            unsafe { super::attention_avx512::attend_group_online(runs, n, scale, q, out, lse, &mut scratch.fast) };
            return;
        }
        // SAFETY: AVX-512 F/BW/VL/DQ (with AVX2, FMA, F16C) were detected by `isa()`.
        unsafe { super::attention_avx512::attend_group(runs, range.start, range.end, n_padded, scale, false, q, out, lse, &mut scratch.fast) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 && super::attention_avx2::supports_head_dim(hd) && n > 0 && group <= super::attention_avx2::MAX_GROUP && scores.softcap.is_none() {
        // SAFETY: AVX2, FMA and F16C were detected by `isa()` (and without `online` the rows
        // are f16, as the two-pass kernel needs).
        unsafe {
            if online {
                super::attention_avx2::attend_group_online(runs, n, scores.scale, q, out, lse, &mut scratch.avx2);
            } else {
                super::attention_avx2::attend_group(runs, range.start, range.end, n_padded, scores.scale, false, q, out, lse, &mut scratch.avx2);
            }
        }
        return;
    }
    scratch.k.resize(n * hd, 0.0);
    scratch.v.resize(n * hd, 0.0);
    let mut at = 0;
    for run in runs {
        run.k.widen_into(&mut scratch.k[at..at + run.k.len()]);
        run.v.widen_into(&mut scratch.v[at..at + run.v.len()]);
        at += run.k.len();
    }
    for ((qh, oh), l) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)).zip(lse.iter_mut()) {
        *l = if online {
            decode_attention_online(qh, &scratch.k, &scratch.v, n, scores, oh)
        } else {
            decode_attention_range(qh, &scratch.k, &scratch.v, range.clone(), n_padded, scores, oh)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_of_one_part_is_the_part() {
        let o = [1.0f32, -2.5, f32::MIN_POSITIVE, 3.0e-38];
        assert_eq!(merge_partials(&[(&o, 7.25)]), o.to_vec());
        assert_eq!(merge_lse(&[7.25]), 7.25);
    }

    #[test]
    fn merge_weights_parts_by_their_mass() {
        // Two parts of equal mass average; an empty part weighs nothing.
        let (a, b) = ([1.0f32, 0.0], [0.0f32, 1.0]);
        assert_eq!(merge_partials(&[(&a, 2.0), (&b, 2.0)]), vec![0.5, 0.5]);
        assert!((merge_lse(&[2.0, 2.0]) - (2.0 + 2f32.ln())).abs() < 1e-6);
        assert_eq!(merge_partials(&[(&a, 2.0), (&b, f32::NEG_INFINITY)]), vec![1.0, 0.0]);
        assert_eq!(merge_partials(&[(&a, f32::NEG_INFINITY), (&b, f32::NEG_INFINITY)]), vec![0.0, 0.0]);
        // One live part among empty ones comes back bit for bit (a sliding window's cut).
        let odd = [0.1f32, 0.3];
        assert_eq!(merge_partials(&[(&b, f32::NEG_INFINITY), (&odd, 0.7), (&a, f32::NEG_INFINITY)]), odd.to_vec());
        // Huge log-sum-exps do not overflow.
        let m = merge_partials(&[(&a, 1000.0), (&b, 1001.0)]);
        let wb = 1.0 / (1.0 + (-1f32).exp());
        assert!((m[0] - (1.0 - wb)).abs() < 1e-6 && (m[1] - wb).abs() < 1e-6, "{m:?}");
    }

    /// A token's heads merged at once are each head's merge, bit for bit, and its
    /// log-sum-exps `merge_lse`'s: heads with every part live, one live part, none, and a
    /// part left empty (a sliding window's cut).
    #[test]
    fn merging_a_tokens_heads_is_merging_each_head() {
        let (n_head, hd) = (4usize, 5usize);
        let inf = f32::NEG_INFINITY;
        let lses = [[0.3f32, 1.7, inf, 2.0], [-1.2, inf, inf, 900.0], [4.5, inf, inf, inf]];
        let parts: Vec<Partial> = lses
            .iter()
            .enumerate()
            .map(|(p, l)| ((0..n_head * hd).map(|i| ((i * 7 + p * 13) % 11) as f32 * 0.37 - 1.5).collect(), l.to_vec()))
            .collect();
        let (mut out, mut lse) = (vec![f32::NAN; n_head * hd], vec![f32::NAN; n_head]);
        merge_heads(&parts, &mut out, Some(&mut lse));
        for h in 0..n_head {
            let head: Vec<(&[f32], f32)> = parts.iter().map(|(o, l)| (&o[h * hd..(h + 1) * hd], l[h])).collect();
            let want = merge_partials(&head);
            assert_eq!(out[h * hd..(h + 1) * hd].iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "head {h}");
            assert_eq!(lse[h].to_bits(), merge_lse(&head.iter().map(|p| p.1).collect::<Vec<_>>()).to_bits(), "head {h}");
        }
        let mut alone = vec![0f32; n_head * hd];
        merge_heads(&parts[..1], &mut alone, None);
        assert_eq!(alone, parts[0].0, "one part comes back unchanged");
    }
}

