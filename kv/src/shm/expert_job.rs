//! The expert job format carried in an exchange-ring slot beside attention jobs ([`super::job`]):
//! the gpu-worker writes one MoE layer's routed (row, expert, weight) items and the rows they
//! read (the layer's normed hidden rows), a cpu-worker holding those experts answers in the
//! same slot with each item's expert output times its weight, or with an error status. The
//! gpu-worker adds each row's weighted outputs in the order the router chose them.
//!
//! It shares the attention job's header fields for status, error kind and message, request
//! length, layer and busy time (so `write_error`, `busy_ns` and rejections read the same),
//! and differs in its magic, `DEXP`. Every field is bounds-checked on decoding: a malformed
//! slot gives a [`JobError`], never a panic.
//!
//! # Layout (little-endian, offsets in bytes from the start of the slot)
//!
//! Header, [`HEADER_BYTES`] (256): 0 magic `DEXP`; 4 version (1); 8 status; 12 error kind;
//! 16 request bytes; 20 layer; 24 rows; 28 n_embd; 32 items; 48 busy ns; 64.. error message.
//! Then the items, 12 bytes each (u32 expert, u32 row, f32 weight), then from the next
//! multiple of 64 the rows (f32 × n_embd each), which end the request. Results start at the
//! request bytes rounded up to 64: per item, in order, f32 × n_embd.

use super::job::{
    check_done, check_not_rejected, check_preamble, put_u32, results_offset, u32_at, JobError, Reader, Writer, HEADER_BYTES,
    OFF_ERROR_KIND, OFF_LAYER, OFF_REQUEST_BYTES, OFF_STATUS, OFF_VERSION, STATUS_DONE, STATUS_POSTED,
};

/// Magic bytes of an expert job.
pub const EXPERT_MAGIC: [u8; 4] = *b"DEXP";
/// The expert job format version this build writes and reads.
pub const EXPERT_VERSION: u32 = 1;
/// Bytes of one item record.
pub const ITEM_BYTES: usize = 12;
/// Ring slot bytes of a cpu-worker serving experts: one MoE layer's items of a decode step of
/// 64 sequences in one job at a 2048 width (an item takes its output and at most its row).
pub const EXPERT_SLOT_BYTES: usize = 8 << 20;

const OFF_N_ROWS: usize = 24;
const OFF_N_EMBD: usize = 28;
const OFF_N_ITEMS: usize = 32;
const ALIGN: usize = 64;

/// One routed pair: batch row `row` goes through expert `expert`, its output scaled by `weight`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertItem {
    pub expert: u32,
    pub row: u32,
    pub weight: f32,
}

/// One MoE layer's expert work for one cpu-worker: `items` over `rows` (`[row][n_embd]`).
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertJob {
    pub layer: u32,
    pub n_embd: u32,
    pub items: Vec<ExpertItem>,
    pub rows: Vec<f32>,
}

/// What a cpu-worker checks a decoded expert job against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLimits {
    pub n_layer: u32,
    pub n_embd: u32,
    pub n_expert: u32,
}

/// Which of `n_workers` cpu-workers (expert shares) serves expert `expert` of `n_expert`:
/// contiguous ranges, the same rule on both sides (the gpu-worker posting, a cpu-worker
/// loading its share).
pub fn expert_owner(expert: u32, n_expert: u32, n_workers: u32) -> u32 {
    ((expert as u64 * n_workers as u64) / (n_expert.max(1) as u64)) as u32
}

/// Where the rows start after `n_items` item records.
fn rows_offset(n_items: u64) -> Option<u64> {
    let end = n_items.checked_mul(ITEM_BYTES as u64)?.checked_add(HEADER_BYTES as u64)?;
    end.checked_next_multiple_of(ALIGN as u64)
}

/// Bytes of a request and of the whole slot it needs, from its counts (untrusted: u64,
/// `None` on overflow).
fn sizes(n_items: u64, n_rows: u64, n_embd: u64) -> Option<(u64, u64)> {
    let row_bytes = n_embd.checked_mul(4)?;
    let request = rows_offset(n_items)?.checked_add(n_rows.checked_mul(row_bytes)?)?;
    let results = n_items.checked_mul(row_bytes)?;
    let total = request.checked_next_multiple_of(ALIGN as u64)?.checked_add(results)?;
    Some((request, total))
}

impl ExpertJob {
    /// Rows in the job.
    pub fn n_rows(&self) -> usize {
        self.rows.len() / (self.n_embd as usize).max(1)
    }

    /// Bytes a slot needs for this job and its results.
    pub fn slot_bytes_needed(&self) -> Option<usize> {
        Self::slot_bytes_for(self.items.len(), self.n_rows(), self.n_embd as usize)
    }

    /// Bytes a slot needs for a job of `n_items` over `n_rows` rows of `n_embd`.
    pub fn slot_bytes_for(n_items: usize, n_rows: usize, n_embd: usize) -> Option<usize> {
        sizes(n_items as u64, n_rows as u64, n_embd as u64).and_then(|(_, t)| usize::try_from(t).ok())
    }

    /// Checks the job against the worker's model: layer, width, and every item's expert, row
    /// and weight.
    pub fn validate(&self, limits: &ExpertLimits) -> Result<(), JobError> {
        if self.layer >= limits.n_layer {
            return Err(JobError::LayerOutOfRange { layer: self.layer, n_layer: limits.n_layer });
        }
        if self.n_embd != limits.n_embd {
            return Err(JobError::ShapeMismatch { field: "n_embd", job: self.n_embd, arena: limits.n_embd });
        }
        let n_rows = self.n_rows() as u32;
        for (item, it) in self.items.iter().enumerate() {
            if it.expert >= limits.n_expert {
                return Err(JobError::BadExpert { item, expert: it.expert, reason: "past the model's experts" });
            }
            if it.row >= n_rows {
                return Err(JobError::RowOutOfRange { item, row: it.row, n_rows });
            }
            if !it.weight.is_finite() {
                return Err(JobError::BadWeight { item, bits: it.weight.to_bits() });
            }
        }
        Ok(())
    }
}

/// Writes `job` into `slot` with status posted. Fails, leaving the slot unchanged, if the
/// rows are not whole rows of `n_embd` or the job and its results do not fit the slot.
pub fn encode_expert_job(job: &ExpertJob, slot: &mut [u8]) -> Result<(), JobError> {
    if job.n_embd == 0 {
        return Err(JobError::ZeroField { field: "n_embd" });
    }
    if !job.rows.len().is_multiple_of(job.n_embd as usize) {
        let (len, need) = (job.rows.len(), job.n_rows() * job.n_embd as usize);
        return Err(JobError::LengthMismatch { stated: need, parsed: len });
    }
    let too_large = |need| JobError::TooLarge { what: "expert job and its results", need, have: slot.len() };
    let (request, total) = sizes(job.items.len() as u64, job.n_rows() as u64, job.n_embd as u64).ok_or(too_large(u64::MAX))?;
    if total > slot.len() as u64 || u32::try_from(request).is_err() || u32::try_from(job.items.len()).is_err() {
        return Err(too_large(total));
    }
    slot[..HEADER_BYTES].fill(0);
    slot[..4].copy_from_slice(&EXPERT_MAGIC);
    let mut w = Writer { buf: slot, at: OFF_VERSION };
    w.u32(EXPERT_VERSION);
    w.u32(STATUS_POSTED);
    w.u32(0);
    w.u32(request as u32);
    for v in [job.layer, job.n_rows() as u32, job.n_embd, job.items.len() as u32] {
        w.u32(v);
    }
    w.at = HEADER_BYTES;
    for it in &job.items {
        w.u32(it.expert);
        w.u32(it.row);
        w.f32(it.weight);
    }
    let rows_at = rows_offset(job.items.len() as u64).expect("sized above") as usize;
    w.buf[w.at..rows_at].fill(0);
    w.at = rows_at;
    for &x in &job.rows {
        w.f32(x);
    }
    debug_assert_eq!(w.at as u64, request);
    Ok(())
}

/// Whether `slot` holds an expert job (by its magic), as opposed to an attention job.
pub fn is_expert_job(slot: &[u8]) -> bool {
    slot.get(..4) == Some(&EXPERT_MAGIC[..])
}

/// The header's counts, checked against the slot's size.
struct Header {
    request_bytes: usize,
    layer: u32,
    n_rows: u32,
    n_embd: u32,
    n_items: u32,
}

fn read_header(slot: &[u8]) -> Result<(Header, u32), JobError> {
    check_preamble(slot, "expert job header", EXPERT_MAGIC, EXPERT_VERSION)?;
    let u = |off: usize| u32_at(slot, off);
    let h = Header { request_bytes: u(OFF_REQUEST_BYTES) as usize, layer: u(OFF_LAYER), n_rows: u(OFF_N_ROWS), n_embd: u(OFF_N_EMBD), n_items: u(OFF_N_ITEMS) };
    if h.n_embd == 0 {
        return Err(JobError::ZeroField { field: "n_embd" });
    }
    let (request, total) = sizes(h.n_items as u64, h.n_rows as u64, h.n_embd as u64).unwrap_or((u64::MAX, u64::MAX));
    if request != h.request_bytes as u64 {
        return Err(JobError::LengthMismatch { stated: h.request_bytes, parsed: usize::try_from(request).unwrap_or(usize::MAX) });
    }
    if total > slot.len() as u64 {
        return Err(JobError::TooLarge { what: "expert job and its results", need: total, have: slot.len() });
    }
    Ok((h, u(OFF_STATUS)))
}

/// Reads and checks a posted expert job (the cpu-worker's side).
pub fn decode_expert_job(slot: &[u8], limits: &ExpertLimits) -> Result<ExpertJob, JobError> {
    let (h, _) = read_header(slot)?;
    let mut r = Reader { buf: &slot[..h.request_bytes], at: HEADER_BYTES };
    let mut items = Vec::with_capacity(h.n_items as usize);
    for _ in 0..h.n_items {
        let [expert, row, weight] = r.u32s::<3>("expert items")?;
        items.push(ExpertItem { expert, row, weight: f32::from_bits(weight) });
    }
    r.at = rows_offset(h.n_items as u64).unwrap_or(u64::MAX) as usize;
    let rows = r.f32_vec(h.n_rows as usize * h.n_embd as usize, "expert rows")?;
    let job = ExpertJob { layer: h.layer, n_embd: h.n_embd, items, rows };
    job.validate(limits)?;
    Ok(job)
}

/// Writes the results of `job` (as decoded from `slot`): `outputs` is `[item][n_embd]`, each
/// item's expert output times its weight; sets the status to done.
pub fn write_expert_results(slot: &mut [u8], job: &ExpertJob, outputs: &[f32]) -> Result<(), JobError> {
    let d = job.n_embd as usize;
    if outputs.len() != job.items.len() * d {
        return Err(JobError::LengthMismatch { stated: job.items.len() * d, parsed: outputs.len() });
    }
    let (request, total) = sizes(job.items.len() as u64, job.n_rows() as u64, d as u64).unwrap_or((u64::MAX, u64::MAX));
    if total > slot.len() as u64 {
        return Err(JobError::TooLarge { what: "expert results", need: total, have: slot.len() });
    }
    let start = results_offset(request as usize).expect("sized above");
    let mut w = Writer { buf: slot, at: start };
    for &x in outputs {
        w.f32(x);
    }
    put_u32(slot, OFF_ERROR_KIND, 0);
    put_u32(slot, OFF_STATUS, STATUS_DONE);
    Ok(())
}

/// Reads a completed expert job's results (the gpu-worker's side): `[item][n_embd]`.
pub fn read_expert_results(slot: &[u8]) -> Result<Vec<f32>, JobError> {
    check_not_rejected(slot)?;
    let (h, status) = read_header(slot)?;
    check_done(status)?;
    let start = results_offset(h.request_bytes).unwrap_or(usize::MAX);
    Reader { buf: slot, at: start }.f32_vec(h.n_items as usize * h.n_embd as usize, "expert results")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::job::write_error;

    fn job() -> ExpertJob {
        ExpertJob {
            layer: 1,
            n_embd: 4,
            items: vec![ExpertItem { expert: 3, row: 0, weight: 0.75 }, ExpertItem { expert: 0, row: 1, weight: 0.25 }],
            rows: (0..8).map(|i| i as f32 * 0.5).collect(),
        }
    }

    const LIMITS: ExpertLimits = ExpertLimits { n_layer: 2, n_embd: 4, n_expert: 4 };

    #[test]
    fn a_job_round_trips_and_its_results_come_back() {
        let j = job();
        let mut slot = vec![0xAAu8; j.slot_bytes_needed().unwrap()];
        encode_expert_job(&j, &mut slot).unwrap();
        assert!(is_expert_job(&slot));
        assert_eq!(decode_expert_job(&slot, &LIMITS).unwrap(), j);
        assert_eq!(read_expert_results(&slot), Err(JobError::NotDone));
        let out: Vec<f32> = (0..8).map(|i| -(i as f32)).collect();
        write_expert_results(&mut slot, &j, &out).unwrap();
        assert_eq!(read_expert_results(&slot).unwrap(), out);
    }

    #[test]
    fn a_job_too_large_for_the_slot_is_refused_and_the_slot_left_alone() {
        let j = job();
        let mut slot = vec![7u8; j.slot_bytes_needed().unwrap() - 1];
        assert!(matches!(encode_expert_job(&j, &mut slot), Err(JobError::TooLarge { .. })));
        assert!(slot.iter().all(|&b| b == 7));
    }

    #[test]
    fn every_bad_field_is_named() {
        let encode = |j: &ExpertJob| {
            let mut slot = vec![0u8; j.slot_bytes_needed().unwrap()];
            encode_expert_job(j, &mut slot).unwrap();
            decode_expert_job(&slot, &LIMITS)
        };
        let mut j = job();
        j.items[1].expert = 4;
        assert!(matches!(encode(&j), Err(JobError::BadExpert { item: 1, expert: 4, .. })));
        let mut j = job();
        j.items[0].row = 2;
        assert!(matches!(encode(&j), Err(JobError::RowOutOfRange { item: 0, row: 2, n_rows: 2 })));
        let mut j = job();
        j.items[0].weight = f32::NAN;
        assert!(matches!(encode(&j), Err(JobError::BadWeight { item: 0, .. })));
        let mut j = job();
        j.layer = 2;
        assert!(matches!(encode(&j), Err(JobError::LayerOutOfRange { layer: 2, n_layer: 2 })));
        let j = ExpertJob { n_embd: 2, rows: vec![0.0; 4], ..job() };
        assert!(matches!(encode(&j), Err(JobError::ShapeMismatch { field: "n_embd", .. })));
    }

    #[test]
    fn corrupt_counts_are_errors_not_panics() {
        let j = job();
        let mut slot = vec![0u8; j.slot_bytes_needed().unwrap()];
        encode_expert_job(&j, &mut slot).unwrap();
        for (off, v) in [(OFF_N_ITEMS, u32::MAX), (OFF_N_ROWS, u32::MAX), (OFF_N_EMBD, 0), (OFF_REQUEST_BYTES, 3), (OFF_VERSION, 9)] {
            let mut bad = slot.clone();
            put_u32(&mut bad, off, v);
            assert!(decode_expert_job(&bad, &LIMITS).is_err(), "field at {off} = {v}");
            assert!(read_expert_results(&bad).is_err());
        }
        assert!(decode_expert_job(&slot[..100], &LIMITS).is_err());
    }

    #[test]
    fn experts_split_into_contiguous_shares() {
        let owners: Vec<u32> = (0..8).map(|e| expert_owner(e, 8, 3)).collect();
        assert_eq!(owners, [0, 0, 0, 1, 1, 1, 2, 2]);
        assert!((0..64).all(|e| expert_owner(e, 64, 1) == 0));
    }

    #[test]
    fn a_rejection_reads_back_as_the_workers_error() {
        let j = job();
        let mut slot = vec![0u8; j.slot_bytes_needed().unwrap()];
        encode_expert_job(&j, &mut slot).unwrap();
        write_error(&mut slot, &JobError::NoExperts);
        match read_expert_results(&slot) {
            Err(JobError::Rejected { kind: 21, message }) => assert!(message.contains("--experts-of"), "{message}"),
            other => panic!("{other:?}"),
        }
    }
}
