//! Decode attention over the paged f16 KV blocks of a cpu-worker's arena: one sequence's
//! position range of one KV head, for that head's whole GQA query group, returning each query
//! head's output and log-sum-exp; and the log-sum-exp merge of such partial results.
//!
//! The arithmetic is [`decode_group`]'s, which single-process decode uses too, so a range
//! covering a sequence's whole context gives bit for bit what
//! [`causal_attention`](super::attention::causal_attention) gives for its decode token. The
//! blocks' `[token][head_dim]` runs of a KV head are read in place, once for its whole group.

use half::f16;

use super::attention::{attn_scale, decode_group, padded_len, GroupScratch, KvRun};
use crate::kv::{ArenaLayout, BlockId, KvDtype};

/// Read access to the f16 K/V rows of a KV arena (a byte arena described by an
/// [`ArenaLayout`]; a shared-memory segment in the cpu-worker, a plain slice in tests).
pub trait ArenaRows: Sync {
    /// `count` f16 values starting at byte `offset` of the arena (`offset` is even). May
    /// panic if the range is outside the arena; callers check [`PagedRange::fits`] first.
    fn f16s(&self, offset: usize, count: usize) -> &[f16];
}

/// An arena held as f16 values from byte 0 (header included), e.g. in tests.
impl ArenaRows for [f16] {
    fn f16s(&self, offset: usize, count: usize) -> &[f16] {
        assert!(offset.is_multiple_of(2), "f16 rows at odd byte offset {offset}");
        &self[offset / 2..offset / 2 + count]
    }
}

/// Where one sequence's K/V for the positions `start..end` lie in one layer, and the context
/// it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedRange<'a> {
    pub layer: u32,
    /// Blocks in position order: `blocks[i]` holds positions `first_pos + i * block_size`
    /// onwards, position `p` at slot `(p - first_pos) % block_size`.
    pub blocks: &'a [BlockId],
    /// Position of slot 0 of `blocks[0]`.
    pub first_pos: usize,
    /// First position attended here.
    pub start: usize,
    /// One past the last position attended here.
    pub end: usize,
    /// Length of the sequence's whole context (all ranges, wherever they run): with
    /// `kv_padding` it decides the V lanes, as in single-process decode.
    pub n_ctx: usize,
    /// The KV padding unit ([`KV_PADDING`](super::attention::KV_PADDING)).
    pub kv_padding: usize,
}

impl PagedRange<'_> {
    /// Whether this range can be attended in an arena of `layout`: f16 arena, `layer` in
    /// range, `start < end <= n_ctx`, a non-zero padding, every block id in the arena and
    /// `first_pos <= start`, `end <= first_pos + blocks.len() * block_size`. The functions
    /// below assume it (and panic otherwise); job decoding checks each rule with its own error.
    pub fn fits(&self, layout: &ArenaLayout) -> bool {
        let bs = layout.block_size as usize;
        let covered = self.blocks.len().checked_mul(bs).and_then(|n| n.checked_add(self.first_pos));
        layout.validate().is_ok()
            && layout.dtype == KvDtype::F16
            && self.layer < layout.n_layer
            && self.start < self.end
            && self.end <= self.n_ctx
            && self.kv_padding > 0
            && self.n_ctx.checked_next_multiple_of(self.kv_padding).is_some()
            && self.first_pos <= self.start
            && covered.is_some_and(|c| self.end <= c)
            && self.blocks.iter().all(|b| b.0 < layout.n_blocks)
    }
}

/// Decode attention of the query group of `kv_head` over `r`'s positions: `q` and `out` are
/// `[group][head_dim]` (the query heads `kv_head * group .. (kv_head + 1) * group`), `lse`
/// gets one log-sum-exp per query head. The KV head is gathered once for the whole group.
/// Panics unless `r.fits(layout)`, `r`'s positions lie within one `DECODE_CHUNK` (see
/// `attention::chunk_tasks`) and the slices agree (`q.len() == out.len() ==
/// lse.len() * head_dim`).
#[allow(clippy::too_many_arguments)] // the arena, the range and the group's three slices
pub fn attend_group<A: ArenaRows + ?Sized>(
    arena: &A,
    layout: &ArenaLayout,
    r: &PagedRange<'_>,
    kv_head: u32,
    q: &[f32],
    out: &mut [f32],
    lse: &mut [f32],
    scratch: &mut GroupScratch,
) {
    let hd = layout.head_dim as usize;
    assert!(q.len() == out.len() && out.len() == lse.len() * hd, "query group slice sizes");
    assert!(r.fits(layout), "paged range {r:?} does not fit arena {layout:?}");
    assert!(kv_head < layout.n_kv_head, "kv head {kv_head} of {}", layout.n_kv_head);
    let runs: Vec<KvRun<'_>> = block_runs(layout, r)
        .map(|(block, lo, rows)| KvRun {
            k: arena.f16s(layout.k_offset(block, r.layer, kv_head) + lo * hd * 2, rows * hd),
            v: arena.f16s(layout.v_offset(block, r.layer, kv_head) + lo * hd * 2, rows * hd),
        })
        .collect();
    decode_group(&runs, r.start..r.end, padded_len(r.n_ctx, r.kv_padding), attn_scale(hd), q, out, lse, scratch);
}

/// The blocks of `r` in position order, each with the first slot attended in it and the
/// number of slots: `(block, lo, rows)`.
fn block_runs<'a>(layout: &ArenaLayout, r: &'a PagedRange<'_>) -> impl Iterator<Item = (BlockId, usize, usize)> + 'a {
    let bs = layout.block_size as usize;
    let first = (r.start - r.first_pos) / bs;
    let last = (r.end - 1 - r.first_pos) / bs;
    r.blocks.iter().enumerate().take(last + 1).skip(first).map(move |(i, &block)| {
        let block_pos = r.first_pos + i * bs;
        let lo = r.start.max(block_pos) - block_pos;
        let hi = r.end.min(block_pos + bs) - block_pos;
        (block, lo, hi - lo)
    })
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
    if let [(o, _)] = parts {
        return o.to_vec();
    }
    let total = merge_lse_f64(parts.iter().map(|p| p.1));
    if total == f64::NEG_INFINITY {
        return vec![0.0; dim];
    }
    let mut acc = vec![0f64; dim];
    for (o, l) in parts {
        let w = (*l as f64 - total).exp();
        if w == 0.0 {
            continue;
        }
        for (a, &x) in acc.iter_mut().zip(o.iter()) {
            *a += x as f64 * w;
        }
    }
    acc.into_iter().map(|a| a as f32).collect()
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
        // Huge log-sum-exps do not overflow.
        let m = merge_partials(&[(&a, 1000.0), (&b, 1001.0)]);
        let wb = 1.0 / (1.0 + (-1f32).exp());
        assert!((m[0] - (1.0 - wb)).abs() < 1e-6 && (m[1] - wb).abs() < 1e-6, "{m:?}");
    }

    #[test]
    fn fits_checks_every_rule() {
        let layout = ArenaLayout {
            n_layer: 2,
            n_kv_head: 1,
            head_dim: 4,
            block_size: 4,
            dtype: KvDtype::F16,
            n_blocks: 8,
        };
        let blocks = [BlockId(3), BlockId(5)];
        let good = PagedRange { layer: 1, blocks: &blocks, first_pos: 4, start: 5, end: 12, n_ctx: 12, kv_padding: 32 };
        assert!(good.fits(&layout));
        let bad_blocks = [BlockId(3), BlockId(8)];
        for bad in [
            PagedRange { layer: 2, ..good },
            PagedRange { start: 12, ..good },
            PagedRange { n_ctx: 11, ..good },
            PagedRange { kv_padding: 0, ..good },
            PagedRange { first_pos: 6, ..good },
            PagedRange { end: 13, n_ctx: 13, ..good },
            PagedRange { blocks: &bad_blocks, ..good },
        ] {
            assert!(!bad.fits(&layout), "{bad:?}");
        }
        assert!(!good.fits(&ArenaLayout { dtype: KvDtype::BF16, ..layout }));
    }
}
