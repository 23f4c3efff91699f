//! The attention job format carried in one exchange-ring slot: the gpu-worker writes a
//! layer's decode-attention request (sequences, their position ranges and KV blocks, their
//! query vectors), a cpu-worker answers in the same slot with each query head's output and
//! log-sum-exp, or with an error status and message.
//!
//! The bytes cross a process boundary, so both directions are decoded with a bounds check
//! on every field: a malformed slot gives a [`JobError`], never a panic or an out-of-range
//! access, and a decoded request is checked against the worker's [`ArenaLayout`] so that
//! attending it cannot fail ([`PagedRange::fits`] holds for every sequence).
//!
//! # Layout (little-endian, offsets in bytes from the start of the slot)
//!
//! Header, [`HEADER_BYTES`] (256):
//!
//! | offset | type | field | written by |
//! |---|---|---|---|
//! | 0 | `[u8; 4]` | magic `DJOB` | producer |
//! | 4 | u32 | version (2) | producer |
//! | 8 | u32 | status: 0 posted, 1 done, 2 rejected | producer (0), worker |
//! | 12 | u32 | error kind ([`JobError::kind`]) when rejected | worker |
//! | 16 | u32 | request bytes (header + sequence records) | producer |
//! | 20 | u32 | layer | producer |
//! | 24 | u32 | number of sequences | producer |
//! | 28 | u32 | n_head | producer |
//! | 32 | u32 | n_kv_head | producer |
//! | 36 | u32 | head_dim | producer |
//! | 40 | u32 | KV padding unit (32: llama.cpp's) | producer |
//! | 44 | f32 | attention logit soft-cap (Gemma 2), 0 for none | producer |
//! | 48 | u64 | busy ns: the worker's time attending the job, when done | worker |
//! | 56 | 8 bytes | reserved, zero | |
//! | 64 | 192 bytes | error message, UTF-8, zero-padded, when rejected | worker |
//!
//! Then one record per sequence, back to back:
//!
//! | offset | type | field |
//! |---|---|---|
//! | 0 | u32 | start: first position attended here |
//! | 4 | u32 | end: one past the last |
//! | 8 | u32 | n_ctx: the sequence's whole context length (decides the V lanes with the padding) |
//! | 12 | u32 | first_pos: position of slot 0 of the first block |
//! | 16 | u32 | number of blocks |
//! | 20 | u32 | reserved, zero |
//! | 24 | u32 × blocks | block ids in position order |
//! | then | f32 × n_head × head_dim | query vectors, `[head][head_dim]` |
//!
//! Results start at the request bytes rounded up to 64: per sequence, in order, the outputs
//! (f32 × n_head × head_dim, `[head][head_dim]`) then the log-sum-exps (f32 × n_head).

use crate::paged::PagedRange;
use crate::{ArenaLayout, BlockId, KvDtype};

/// Magic bytes of a job.
pub const JOB_MAGIC: [u8; 4] = *b"DJOB";
/// The job format version this build writes and reads.
pub const JOB_VERSION: u32 = 2;
/// Bytes of the job header; the first sequence record starts here.
pub const HEADER_BYTES: usize = 256;
/// Bytes of a sequence record before its block ids.
pub const SEQ_RECORD_BYTES: usize = 24;
/// Status of a job the worker has not answered.
pub const STATUS_POSTED: u32 = 0;
/// Status of a job whose results are in the slot.
pub const STATUS_DONE: u32 = 1;
/// Status of a job the worker refused (error kind and message in the header).
pub const STATUS_REJECTED: u32 = 2;

pub(super) const OFF_VERSION: usize = 4;
pub(super) const OFF_STATUS: usize = 8;
pub(super) const OFF_ERROR_KIND: usize = 12;
pub(super) const OFF_REQUEST_BYTES: usize = 16;
pub(super) const OFF_LAYER: usize = 20;
const OFF_N_SEQ: usize = 24;
const OFF_N_HEAD: usize = 28;
const OFF_N_KV_HEAD: usize = 32;
const OFF_HEAD_DIM: usize = 36;
const OFF_KV_PADDING: usize = 40;
const OFF_SOFTCAP: usize = 44;
const OFF_BUSY_NS: usize = 48;
const OFF_MESSAGE: usize = 64;
const RESULTS_ALIGN: usize = 64;

/// Everything wrong a job slot can be, on either side.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    #[error("job slot ends inside the {what}: needs {need} bytes, has {have}")]
    Truncated { what: &'static str, need: usize, have: usize },
    #[error("not an attention job: magic {found:02x?}")]
    BadMagic { found: [u8; 4] },
    #[error("attention job version {found}, this build speaks {JOB_VERSION}")]
    UnsupportedVersion { found: u32 },
    #[error("attention job field {field} is zero")]
    ZeroField { field: &'static str },
    #[error("{n_head} query heads do not divide into {n_kv_head} KV heads")]
    HeadsNotGrouped { n_head: u32, n_kv_head: u32 },
    #[error("job's {field} is {job}, the KV arena's is {arena}")]
    ShapeMismatch { field: &'static str, job: u32, arena: u32 },
    #[error("KV arena holds {0:?}; attention jobs read f16 only")]
    UnsupportedDtype(KvDtype),
    #[error("layer {layer} of a model with {n_layer}")]
    LayerOutOfRange { layer: u32, n_layer: u32 },
    #[error("{what} too large for the slot: needs {need} bytes, the slot has {have}")]
    TooLarge { what: &'static str, need: u64, have: usize },
    #[error("job header says {stated} request bytes, the sequence records take {parsed}")]
    LengthMismatch { stated: usize, parsed: usize },
    #[error("sequence {seq}: {len} query values, {need} expected (n_head × head_dim)")]
    QueryLength { seq: usize, len: usize, need: usize },
    #[error("sequence {seq}: empty position range {start}..{end}")]
    EmptyRange { seq: usize, start: u32, end: u32 },
    #[error("sequence {seq}: range ends at {end}, past its context of {n_ctx}")]
    PastContext { seq: usize, end: u32, n_ctx: u32 },
    #[error("sequence {seq}: block {block} outside the arena's {n_blocks} blocks")]
    BlockOutOfArena { seq: usize, block: u32, n_blocks: u32 },
    #[error("sequence {seq}: {blocks} blocks, more than the arena's {n_blocks}")]
    TooManyBlocks { seq: usize, blocks: usize, n_blocks: u32 },
    #[error("sequence {seq}: blocks cover positions {first_pos}..{covered_end}, not {start}..{end}")]
    RangeNotCovered { seq: usize, start: u32, end: u32, first_pos: u32, covered_end: u64 },
    #[error("attending the job failed inside the cpu-worker: {0}")]
    Internal(String),
    #[error("attention logit soft-cap {} (it must be a finite number > 0, or 0 for none)", f32::from_bits(*bits))]
    BadSoftcap { bits: u32 },
    #[error("cpu-worker rejected the job (kind {kind}): {message}")]
    Rejected { kind: u32, message: String },
    #[error("the job has no result yet (status still posted)")]
    NotDone,
    #[error("unknown job status {0}")]
    BadStatus(u32),
    #[error("this cpu-worker serves no experts (start it with --experts-of)")]
    NoExperts,
    #[error("expert job of layer {layer}: not a mixture-of-experts layer of this model")]
    NotMoeLayer { layer: u32 },
    #[error("expert job item {item}: expert {expert}, {reason}")]
    BadExpert { item: usize, expert: u32, reason: &'static str },
    #[error("expert job item {item}: row {row} of {n_rows}")]
    RowOutOfRange { item: usize, row: u32, n_rows: u32 },
    #[error("expert job item {item}: weight {} is not finite", f32::from_bits(*bits))]
    BadWeight { item: usize, bits: u32 },
}

impl JobError {
    /// A stable number per variant, written into a rejected job's header.
    pub fn kind(&self) -> u32 {
        match self {
            JobError::Truncated { .. } => 1,
            JobError::BadMagic { .. } => 2,
            JobError::UnsupportedVersion { .. } => 3,
            JobError::ZeroField { .. } => 4,
            JobError::HeadsNotGrouped { .. } => 5,
            JobError::ShapeMismatch { .. } => 6,
            JobError::UnsupportedDtype(_) => 7,
            JobError::LayerOutOfRange { .. } => 8,
            JobError::TooLarge { .. } => 9,
            JobError::LengthMismatch { .. } => 10,
            JobError::QueryLength { .. } => 11,
            JobError::EmptyRange { .. } => 12,
            JobError::PastContext { .. } => 13,
            JobError::BlockOutOfArena { .. } => 14,
            JobError::RangeNotCovered { .. } => 15,
            JobError::Internal(_) => 18,
            JobError::TooManyBlocks { .. } => 19,
            JobError::BadSoftcap { .. } => 20,
            JobError::Rejected { kind, .. } => *kind,
            JobError::NotDone => 16,
            JobError::BadStatus(_) => 17,
            JobError::NoExperts => 21,
            JobError::NotMoeLayer { .. } => 22,
            JobError::BadExpert { .. } => 23,
            JobError::RowOutOfRange { .. } => 24,
            JobError::BadWeight { .. } => 25,
        }
    }
}

/// One layer's attention request to a cpu-worker.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnJob {
    pub layer: u32,
    pub n_head: u32,
    pub n_kv_head: u32,
    pub head_dim: u32,
    /// The KV padding unit of the reference (`duet_kernels::attention::KV_PADDING`).
    pub kv_padding: u32,
    /// Scores become `cap * tanh(score / cap)` before the softmax (Gemma 2).
    pub softcap: Option<f32>,
    pub seqs: Vec<SeqJob>,
}

/// One sequence's share of an [`AttnJob`]: positions `start..end` of a context of `n_ctx`.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqJob {
    pub start: u32,
    pub end: u32,
    pub n_ctx: u32,
    /// Position of slot 0 of `blocks[0]`.
    pub first_pos: u32,
    /// The arena blocks holding the range, in position order.
    pub blocks: Vec<BlockId>,
    /// The decode token's query vectors, `[n_head][head_dim]`.
    pub q: Vec<f32>,
}

/// One sequence's answer: outputs `[n_head][head_dim]` and one log-sum-exp per query head.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SeqResult {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
}

impl SeqJob {
    /// The range to attend, in the terms of the paged-attention kernel.
    pub fn paged_range(&self, layer: u32, kv_padding: u32) -> PagedRange<'_> {
        PagedRange {
            layer,
            blocks: &self.blocks,
            first_pos: self.first_pos as usize,
            start: self.start as usize,
            end: self.end as usize,
            n_ctx: self.n_ctx as usize,
            kv_padding: kv_padding as usize,
        }
    }
}

impl AttnJob {
    /// Query values per sequence (`n_head × head_dim`).
    pub fn q_len(&self) -> usize {
        self.n_head as usize * self.head_dim as usize
    }

    /// Bytes of the request part: header and sequence records (`None` on overflow).
    pub fn request_bytes(&self) -> Option<usize> {
        self.seqs.iter().try_fold(HEADER_BYTES, |acc, s| {
            let rec = s.blocks.len().checked_add(s.q.len())?.checked_mul(4)?.checked_add(SEQ_RECORD_BYTES)?;
            acc.checked_add(rec)
        })
    }

    /// Bytes a slot needs for this job and its results.
    pub fn slot_bytes_needed(&self) -> Option<usize> {
        let results = results_bytes(self.seqs.len() as u64, self.n_head, self.head_dim)?;
        results_offset(self.request_bytes()?)?.checked_add(usize::try_from(results).ok()?)
    }

    /// The most bytes a slot needs for a job of `n_seqs` sequences of `n_head` heads of
    /// `head_dim`, each reading at most `blocks_per_seq` blocks: what ring slots are sized to
    /// so that a step of that many sequences never finds its job too large.
    pub fn slot_bytes_bound(n_seqs: usize, n_head: u32, head_dim: u32, blocks_per_seq: usize) -> Option<usize> {
        let q = (n_head as usize).checked_mul(head_dim as usize)?;
        let seq = blocks_per_seq.checked_add(q)?.checked_mul(4)?.checked_add(SEQ_RECORD_BYTES)?;
        let request = n_seqs.checked_mul(seq)?.checked_add(HEADER_BYTES)?;
        let results = results_bytes(n_seqs as u64, n_head, head_dim)?;
        results_offset(request)?.checked_add(usize::try_from(results).ok()?)
    }

    /// Checks the job against the worker's arena: shape, layer, and every sequence's range
    /// and blocks (at most the arena's block count, each inside it). After it, every
    /// sequence's [`SeqJob::paged_range`] fits the layout.
    pub fn validate(&self, layout: &ArenaLayout) -> Result<(), JobError> {
        check_shape(self.n_head, self.n_kv_head, self.head_dim, self.kv_padding)?;
        check_softcap(self.softcap)?;
        if !layout.dtype.attended() {
            return Err(JobError::UnsupportedDtype(layout.dtype));
        }
        for (field, job, arena) in
            [("n_kv_head", self.n_kv_head, layout.n_kv_head), ("head_dim", self.head_dim, layout.head_dim)]
        {
            if job != arena {
                return Err(JobError::ShapeMismatch { field, job, arena });
            }
        }
        if self.layer >= layout.n_layer {
            return Err(JobError::LayerOutOfRange { layer: self.layer, n_layer: layout.n_layer });
        }
        for (i, s) in self.seqs.iter().enumerate() {
            if s.q.len() != self.q_len() {
                return Err(JobError::QueryLength { seq: i, len: s.q.len(), need: self.q_len() });
            }
            if s.start >= s.end {
                return Err(JobError::EmptyRange { seq: i, start: s.start, end: s.end });
            }
            if s.end > s.n_ctx {
                return Err(JobError::PastContext { seq: i, end: s.end, n_ctx: s.n_ctx });
            }
            // Bounds the work and the gather buffers of a job by the arena's size.
            if s.blocks.len() > layout.n_blocks as usize {
                return Err(JobError::TooManyBlocks { seq: i, blocks: s.blocks.len(), n_blocks: layout.n_blocks });
            }
            if let Some(b) = s.blocks.iter().find(|b| b.0 >= layout.n_blocks) {
                return Err(JobError::BlockOutOfArena { seq: i, block: b.0, n_blocks: layout.n_blocks });
            }
            let covered_end = s.first_pos as u64 + s.blocks.len() as u64 * layout.block_size as u64;
            if s.first_pos > s.start || (s.end as u64) > covered_end {
                let (start, end, first_pos) = (s.start, s.end, s.first_pos);
                return Err(JobError::RangeNotCovered { seq: i, start, end, first_pos, covered_end });
            }
        }
        Ok(())
    }
}

fn check_shape(n_head: u32, n_kv_head: u32, head_dim: u32, kv_padding: u32) -> Result<(), JobError> {
    for (field, v) in [("n_head", n_head), ("n_kv_head", n_kv_head), ("head_dim", head_dim), ("kv_padding", kv_padding)]
    {
        if v == 0 {
            return Err(JobError::ZeroField { field });
        }
    }
    if !n_head.is_multiple_of(n_kv_head) {
        return Err(JobError::HeadsNotGrouped { n_head, n_kv_head });
    }
    Ok(())
}

fn check_softcap(softcap: Option<f32>) -> Result<(), JobError> {
    match softcap {
        Some(c) if !(c.is_finite() && c > 0.0) => Err(JobError::BadSoftcap { bits: c.to_bits() }),
        _ => Ok(()),
    }
}

/// Where the results start for a request of `request_bytes`.
pub(super) fn results_offset(request_bytes: usize) -> Option<usize> {
    request_bytes.checked_next_multiple_of(RESULTS_ALIGN)
}

/// Bytes of the results of `n_seq` sequences (u64: computed from untrusted counts).
fn results_bytes(n_seq: u64, n_head: u32, head_dim: u32) -> Option<u64> {
    (head_dim as u64 + 1).checked_mul(n_head as u64)?.checked_mul(4)?.checked_mul(n_seq)
}

/// A cpu-worker's ring slot bytes when nothing says more: a step of a few sequences.
pub const DEFAULT_SLOT_BYTES: usize = 1 << 20;

/// Ring slot bytes for steps of up to `n_seqs` sequences of a model with `n_head` query heads
/// of `head_dim`, each attending its whole context of up to `n_ctx` positions in blocks of
/// `block_size`: one layer's attention job for all of them fits. Rounded up to a MiB, at least
/// [`DEFAULT_SLOT_BYTES`] (and that on an overflow, which no real shape reaches).
pub fn slot_bytes_for(n_seqs: usize, n_head: u32, head_dim: u32, n_ctx: usize, block_size: usize) -> usize {
    let blocks = n_ctx.div_ceil(block_size.max(1)) + 1;
    AttnJob::slot_bytes_bound(n_seqs, n_head, head_dim, blocks).map_or(DEFAULT_SLOT_BYTES, |b| b.next_multiple_of(1 << 20).max(DEFAULT_SLOT_BYTES))
}

/// Writes `job` into `slot` with status posted. Fails if a sequence's query length is wrong
/// or the job with its results does not fit the slot; the slot is then left unchanged.
pub fn encode_job(job: &AttnJob, slot: &mut [u8]) -> Result<(), JobError> {
    check_shape(job.n_head, job.n_kv_head, job.head_dim, job.kv_padding)?;
    check_softcap(job.softcap)?;
    if let Some((i, s)) = job.seqs.iter().enumerate().find(|(_, s)| s.q.len() != job.q_len()) {
        return Err(JobError::QueryLength { seq: i, len: s.q.len(), need: job.q_len() });
    }
    let too_large = |need| JobError::TooLarge { what: "job and its results", need, have: slot.len() };
    let need = job.slot_bytes_needed().ok_or(too_large(u64::MAX))?;
    let request = job.request_bytes().ok_or(too_large(u64::MAX))?;
    if need > slot.len() || u32::try_from(request).is_err() || u32::try_from(job.seqs.len()).is_err() {
        return Err(too_large(need as u64));
    }
    slot[..HEADER_BYTES].fill(0);
    slot[..4].copy_from_slice(&JOB_MAGIC);
    let mut w = Writer { buf: slot, at: OFF_VERSION };
    w.u32(JOB_VERSION);
    w.u32(STATUS_POSTED);
    w.u32(0);
    w.u32(request as u32);
    for v in [job.layer, job.seqs.len() as u32, job.n_head, job.n_kv_head, job.head_dim, job.kv_padding] {
        w.u32(v);
    }
    w.f32(job.softcap.unwrap_or(0.0));
    w.at = HEADER_BYTES;
    for s in &job.seqs {
        for v in [s.start, s.end, s.n_ctx, s.first_pos, s.blocks.len() as u32, 0] {
            w.u32(v);
        }
        for b in &s.blocks {
            w.u32(b.0);
        }
        for &x in &s.q {
            w.f32(x);
        }
    }
    debug_assert_eq!(w.at, request);
    Ok(())
}

/// The job's header fields, read and checked against the slot's size.
struct Header {
    request_bytes: usize,
    layer: u32,
    n_seq: u32,
    n_head: u32,
    n_kv_head: u32,
    head_dim: u32,
    kv_padding: u32,
    softcap: Option<f32>,
}

/// Checks the start every job format shares: a whole header (`what` names it), the format's
/// `magic` and `version`.
pub(super) fn check_preamble(slot: &[u8], what: &'static str, magic: [u8; 4], version: u32) -> Result<(), JobError> {
    if slot.len() < HEADER_BYTES {
        return Err(JobError::Truncated { what, need: HEADER_BYTES, have: slot.len() });
    }
    let found = [slot[0], slot[1], slot[2], slot[3]];
    if found != magic {
        return Err(JobError::BadMagic { found });
    }
    let found = u32_at(slot, OFF_VERSION);
    if found != version {
        return Err(JobError::UnsupportedVersion { found });
    }
    Ok(())
}

/// A completed job's status, checked: done, or why its results cannot be read.
pub(super) fn check_done(status: u32) -> Result<(), JobError> {
    match status {
        STATUS_DONE => Ok(()),
        STATUS_POSTED => Err(JobError::NotDone),
        other => Err(JobError::BadStatus(other)),
    }
}

/// Runs a job's computation, a panic in it becoming [`JobError::Internal`] with its message
/// (the worker answers the job and goes on serving).
pub fn caught<T>(compute: impl FnOnce() -> T) -> Result<T, JobError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(compute)).map_err(|panic| {
        let what = panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
        JobError::Internal(what.unwrap_or_else(|| "panic".into()))
    })
}

fn read_header(slot: &[u8]) -> Result<(Header, u32), JobError> {
    check_preamble(slot, "job header", JOB_MAGIC, JOB_VERSION)?;
    let u = |off: usize| u32_at(slot, off);
    let h = Header {
        request_bytes: u(OFF_REQUEST_BYTES) as usize,
        layer: u(OFF_LAYER),
        n_seq: u(OFF_N_SEQ),
        n_head: u(OFF_N_HEAD),
        n_kv_head: u(OFF_N_KV_HEAD),
        head_dim: u(OFF_HEAD_DIM),
        kv_padding: u(OFF_KV_PADDING),
        softcap: Some(f32::from_bits(u(OFF_SOFTCAP))).filter(|&c| c != 0.0),
    };
    check_shape(h.n_head, h.n_kv_head, h.head_dim, h.kv_padding)?;
    check_softcap(h.softcap)?;
    if h.request_bytes < HEADER_BYTES {
        return Err(JobError::LengthMismatch { stated: h.request_bytes, parsed: HEADER_BYTES });
    }
    if h.request_bytes > slot.len() {
        return Err(JobError::Truncated { what: "request", need: h.request_bytes, have: slot.len() });
    }
    // The results must fit after the request: this also bounds the sequence count.
    let results = results_bytes(h.n_seq as u64, h.n_head, h.head_dim).unwrap_or(u64::MAX);
    let need = (results_offset(h.request_bytes).unwrap_or(usize::MAX) as u64).saturating_add(results);
    if need > slot.len() as u64 {
        return Err(JobError::TooLarge { what: "results", need, have: slot.len() });
    }
    Ok((h, u(OFF_STATUS)))
}

/// Reads and checks a posted job (the cpu-worker's side): every count against the slot and
/// the request length, then [`AttnJob::validate`] against the worker's arena.
pub fn decode_job(slot: &[u8], layout: &ArenaLayout) -> Result<AttnJob, JobError> {
    let (h, _) = read_header(slot)?;
    let request = &slot[..h.request_bytes];
    // u32 × u32 fits u64 (and usize on the 64-bit targets Duet runs on); byte counts
    // derived from it saturate instead of overflowing.
    let q_len64 = h.n_head as u64 * h.head_dim as u64;
    let q_bytes = q_len64.saturating_mul(4);
    let q_len = usize::try_from(q_len64).unwrap_or(usize::MAX);
    // Every record takes at least this much: refuse absurd counts before allocating.
    let min_record = q_bytes.saturating_add(SEQ_RECORD_BYTES as u64);
    let records = (h.request_bytes - HEADER_BYTES) as u64;
    if (h.n_seq as u64).saturating_mul(min_record) > records {
        let need = (h.n_seq as u64).saturating_mul(min_record).saturating_add(HEADER_BYTES as u64);
        return Err(JobError::TooLarge { what: "sequence count", need, have: h.request_bytes });
    }
    let mut r = Reader { buf: request, at: HEADER_BYTES };
    let mut seqs = Vec::with_capacity(h.n_seq as usize);
    for _ in 0..h.n_seq {
        let [start, end, n_ctx, first_pos, n_blocks, _] = r.u32s::<6>("sequence record")?;
        let need = (n_blocks as u64 * 4).saturating_add(q_bytes);
        if need > r.remaining() as u64 {
            let need = (r.at as u64).saturating_add(need);
            return Err(JobError::TooLarge { what: "block count", need, have: h.request_bytes });
        }
        let blocks = r.u32_vec(n_blocks as usize, "block ids")?.into_iter().map(BlockId).collect();
        let q = r.f32_vec(q_len, "query vectors")?;
        seqs.push(SeqJob { start, end, n_ctx, first_pos, blocks, q });
    }
    if r.at != h.request_bytes {
        return Err(JobError::LengthMismatch { stated: h.request_bytes, parsed: r.at });
    }
    let job = AttnJob {
        layer: h.layer,
        n_head: h.n_head,
        n_kv_head: h.n_kv_head,
        head_dim: h.head_dim,
        kv_padding: h.kv_padding,
        softcap: h.softcap,
        seqs,
    };
    job.validate(layout)?;
    Ok(job)
}

/// Writes the results of `job` (as decoded from `slot`) and sets the status to done. Fails,
/// writing nothing, if the results do not match the job's shape or do not fit the slot.
pub fn write_results(slot: &mut [u8], job: &AttnJob, results: &[SeqResult]) -> Result<(), JobError> {
    let q_len = job.q_len();
    let n_head = job.n_head as usize;
    if results.len() != job.seqs.len() {
        let (len, need) = (results.len(), job.seqs.len());
        return Err(JobError::LengthMismatch { stated: need, parsed: len });
    }
    if let Some((i, r)) = results.iter().enumerate().find(|(_, r)| r.out.len() != q_len || r.lse.len() != n_head) {
        return Err(JobError::QueryLength { seq: i, len: r.out.len(), need: q_len });
    }
    let too_large = |need| JobError::TooLarge { what: "results", need, have: slot.len() };
    let need = job.slot_bytes_needed().ok_or(too_large(u64::MAX))?;
    let start = job.request_bytes().and_then(results_offset).ok_or(too_large(u64::MAX))?;
    if need > slot.len() || slot.len() < HEADER_BYTES {
        return Err(too_large(need as u64));
    }
    let mut w = Writer { buf: slot, at: start };
    for r in results {
        for &x in r.out.iter().chain(&r.lse) {
            w.f32(x);
        }
    }
    put_u32(slot, OFF_ERROR_KIND, 0);
    put_u32(slot, OFF_STATUS, STATUS_DONE);
    Ok(())
}

/// Marks the job in `slot` rejected with `err`'s kind and message (cut to 192 bytes). A
/// slot shorter than a header cannot carry an answer and is left alone.
pub fn write_error(slot: &mut [u8], err: &JobError) {
    if slot.len() < HEADER_BYTES {
        return;
    }
    let text = err.to_string();
    let mut cut = text.len().min(HEADER_BYTES - OFF_MESSAGE);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let message = &mut slot[OFF_MESSAGE..HEADER_BYTES];
    message.fill(0);
    message[..cut].copy_from_slice(&text.as_bytes()[..cut]);
    put_u32(slot, OFF_ERROR_KIND, err.kind());
    put_u32(slot, OFF_STATUS, STATUS_REJECTED);
}

/// Reads a completed job's results (the gpu-worker's side), checking the header and every
/// size against the slot: [`JobError::Rejected`] carries the worker's error (whatever the
/// rest of the header holds).
pub fn read_results(slot: &[u8]) -> Result<Vec<SeqResult>, JobError> {
    check_not_rejected(slot)?;
    let (h, status) = read_header(slot)?;
    check_done(status)?;
    // read_header checked that the results fit the slot.
    let start = results_offset(h.request_bytes).unwrap_or(usize::MAX);
    let mut r = Reader { buf: slot, at: start };
    let (q_len, n_head) = (h.n_head as usize * h.head_dim as usize, h.n_head as usize);
    (0..h.n_seq)
        .map(|_| Ok(SeqResult { out: r.f32_vec(q_len, "results")?, lse: r.f32_vec(n_head, "results")? }))
        .collect()
}

/// The worker's rejection of the job in `slot`, if it rejected it. Read before anything
/// else: the worker's answer to a job whose own header was bad (wrong magic, say) still gets
/// through. Every job format shares the header fields this reads.
pub(super) fn check_not_rejected(slot: &[u8]) -> Result<(), JobError> {
    if slot.len() >= HEADER_BYTES && u32_at(slot, OFF_STATUS) == STATUS_REJECTED {
        let raw = &slot[OFF_MESSAGE..HEADER_BYTES];
        let len = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
        let message = String::from_utf8_lossy(&raw[..len]).into_owned();
        return Err(JobError::Rejected { kind: u32_at(slot, OFF_ERROR_KIND), message });
    }
    Ok(())
}

/// Records the worker's time on the job in `slot` (with its results or its error).
pub fn write_busy_ns(slot: &mut [u8], ns: u64) {
    if slot.len() >= HEADER_BYTES {
        slot[OFF_BUSY_NS..OFF_BUSY_NS + 8].copy_from_slice(&ns.to_le_bytes());
    }
}

/// The worker's time on the completed job in `slot` (0 if it did not say).
pub fn busy_ns(slot: &[u8]) -> u64 {
    slot.get(OFF_BUSY_NS..OFF_BUSY_NS + 8).map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
}

/// The layer and sequence count of the job in `slot`, if its header reads (for logs).
pub fn peek_layer_and_seqs(slot: &[u8]) -> Option<(u32, u32)> {
    read_header(slot).ok().map(|(h, _)| (h.layer, h.n_seq))
}

pub(super) fn u32_at(buf: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]])
}

pub(super) fn put_u32(buf: &mut [u8], off: usize, v: u32) {
    buf[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

/// Sequential writes into a buffer already checked to be large enough.
pub(super) struct Writer<'a> {
    pub(super) buf: &'a mut [u8],
    pub(super) at: usize,
}

impl Writer<'_> {
    pub(super) fn u32(&mut self, v: u32) {
        put_u32(self.buf, self.at, v);
        self.at += 4;
    }

    pub(super) fn f32(&mut self, v: f32) {
        self.u32(v.to_bits());
    }
}

/// Sequential, bounds-checked reads.
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
    pub(super) at: usize,
}

impl Reader<'_> {
    pub(super) fn remaining(&self) -> usize {
        self.buf.len() - self.at
    }

    pub(super) fn take(&mut self, n_bytes: usize, what: &'static str) -> Result<&[u8], JobError> {
        let end = self.at.checked_add(n_bytes).filter(|&e| e <= self.buf.len());
        let end = end.ok_or(JobError::Truncated { what, need: self.at.saturating_add(n_bytes), have: self.buf.len() })?;
        let bytes = &self.buf[self.at..end];
        self.at = end;
        Ok(bytes)
    }

    pub(super) fn u32s<const N: usize>(&mut self, what: &'static str) -> Result<[u32; N], JobError> {
        let bytes = self.take(4 * N, what)?;
        Ok(std::array::from_fn(|i| u32_at(bytes, 4 * i)))
    }

    pub(super) fn u32_vec(&mut self, n: usize, what: &'static str) -> Result<Vec<u32>, JobError> {
        let bytes = self.take(n.saturating_mul(4), what)?;
        Ok(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    pub(super) fn f32_vec(&mut self, n: usize, what: &'static str) -> Result<Vec<f32>, JobError> {
        Ok(self.u32_vec(n, what)?.into_iter().map(f32::from_bits).collect())
    }
}
