//! Tests of the attention job format: round trips of requests and results, and every kind
//! of malformed slot (truncated, counts too large, blocks outside the arena, ranges not
//! covered, wrong shape, random corruption) giving its typed error, never a panic.

use duet_kv::{ArenaLayout, BlockId, KvDtype};
use duet_kv::shm::job::{
    decode_job, encode_job, read_results, write_error, write_results, AttnJob, JobError, SeqJob, SeqResult,
    HEADER_BYTES, STATUS_DONE, STATUS_POSTED, STATUS_REJECTED,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

// Header offsets, as documented in the module.
const OFF_STATUS: usize = 8;
const OFF_N_SEQ: usize = 24;
const OFF_HEAD_DIM: usize = 36;

fn layout() -> ArenaLayout {
    ArenaLayout { n_layer: 4, n_kv_head: 2, head_dim: 8, block_size: 16, dtype: KvDtype::F16, n_blocks: 64 }
}

fn seq(start: u32, end: u32, n_ctx: u32, first_pos: u32, blocks: &[u32], q_len: usize, salt: f32) -> SeqJob {
    SeqJob {
        start,
        end,
        n_ctx,
        first_pos,
        blocks: blocks.iter().copied().map(BlockId).collect(),
        q: (0..q_len).map(|i| i as f32 * 0.25 - salt).collect(),
    }
}

/// Three sequences: one spanning several blocks, one partial block, one later range.
fn job() -> AttnJob {
    let q_len = 6 * 8;
    AttnJob {
        layer: 3,
        n_head: 6,
        n_kv_head: 2,
        head_dim: 8,
        kv_padding: 32,
        softcap: None,
        seqs: vec![
            seq(0, 40, 40, 0, &[7, 3, 60], q_len, 1.0),
            seq(0, 5, 5, 0, &[0], q_len, 2.0),
            seq(20, 33, 70, 16, &[9, 10], q_len, 3.0),
        ],
    }
}

fn encoded(job: &AttnJob, slot_len: usize) -> Vec<u8> {
    let mut slot = vec![0xEEu8; slot_len];
    encode_job(job, &mut slot).unwrap();
    slot
}

fn put(slot: &mut [u8], off: usize, v: u32) {
    slot[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

fn results_for(job: &AttnJob) -> Vec<SeqResult> {
    (0..job.seqs.len())
        .map(|i| SeqResult {
            out: (0..job.q_len()).map(|j| (i * 1000 + j) as f32 / 7.0).collect(),
            lse: (0..job.n_head).map(|h| -(h as f32) - i as f32 * 0.5).collect(),
        })
        .collect()
}

#[test]
fn request_and_results_round_trip() {
    let j = job();
    let need = j.slot_bytes_needed().unwrap();
    let request = j.request_bytes().unwrap();
    assert_eq!(request, HEADER_BYTES + 3 * 24 + (3 + 1 + 2) * 4 + 3 * 48 * 4);
    assert_eq!(need, request.next_multiple_of(64) + 3 * 6 * 9 * 4);
    let mut slot = encoded(&j, need);
    assert_eq!(slot[OFF_STATUS], STATUS_POSTED as u8);
    assert_eq!(decode_job(&slot, &layout()), Ok(j.clone()));
    assert_eq!(read_results(&slot), Err(JobError::NotDone));
    let results = results_for(&j);
    write_results(&mut slot, &j, &results).unwrap();
    assert_eq!(slot[OFF_STATUS], STATUS_DONE as u8);
    assert_eq!(read_results(&slot), Ok(results));
    // Writing results leaves the request readable.
    assert_eq!(decode_job(&slot, &layout()), Ok(j.clone()));
    // A soft-cap (Gemma 2) travels in the header; a bad one is refused on both sides.
    let capped = AttnJob { softcap: Some(50.0), ..j.clone() };
    assert_eq!(decode_job(&encoded(&capped, need), &layout()), Ok(capped.clone()));
    for bad in [f32::NAN, -1.0, f32::INFINITY] {
        let job = AttnJob { softcap: Some(bad), ..j.clone() };
        assert_eq!(encode_job(&job, &mut vec![0u8; need]), Err(JobError::BadSoftcap { bits: bad.to_bits() }));
        let mut slot = encoded(&capped, need);
        slot[44..48].copy_from_slice(&bad.to_bits().to_le_bytes());
        assert_eq!(decode_job(&slot, &layout()), Err(JobError::BadSoftcap { bits: bad.to_bits() }));
    }
    // A job of no sequences is valid and has no results.
    let empty = AttnJob { seqs: vec![], ..j };
    let mut slot = encoded(&empty, 4096);
    assert_eq!(decode_job(&slot, &layout()), Ok(empty.clone()));
    write_results(&mut slot, &empty, &[]).unwrap();
    assert_eq!(read_results(&slot), Ok(vec![]));
}

#[test]
fn rejection_carries_kind_and_message() {
    let j = job();
    let mut slot = encoded(&j, 1 << 14);
    let err = JobError::BlockOutOfArena { seq: 1, block: 99, n_blocks: 64 };
    write_error(&mut slot, &err);
    assert_eq!(slot[OFF_STATUS], STATUS_REJECTED as u8);
    assert_eq!(read_results(&slot), Err(JobError::Rejected { kind: err.kind(), message: err.to_string() }));
    // Long messages are cut to the header's 192 bytes at a character boundary.
    let long = JobError::Rejected { kind: 42, message: "é".repeat(200) };
    write_error(&mut slot, &long);
    match read_results(&slot) {
        Err(JobError::Rejected { kind: 42, message }) => assert!(message.len() <= 192 && message.ends_with('é')),
        other => panic!("{other:?}"),
    }
    write_error(&mut [0u8; 10], &err); // too short to answer: left alone, no panic
    // A job with a garbage header still reads back as rejected.
    let mut garbage = vec![0xA5u8; 4096];
    write_error(&mut garbage, &JobError::BadMagic { found: [0xA5; 4] });
    assert!(matches!(read_results(&garbage), Err(JobError::Rejected { kind: 2, .. })));
    put(&mut slot, OFF_STATUS, 7);
    assert_eq!(read_results(&slot), Err(JobError::BadStatus(7)));
}

#[test]
fn truncated_slots_are_refused() {
    let j = job();
    let need = j.slot_bytes_needed().unwrap();
    let request = j.request_bytes().unwrap();
    let slot = encoded(&j, need);
    for len in 0..need {
        let err = decode_job(&slot[..len], &layout()).unwrap_err();
        let ok = match len {
            l if l < HEADER_BYTES => matches!(err, JobError::Truncated { what: "job header", .. }),
            l if l < request => matches!(err, JobError::Truncated { what: "request", .. }),
            _ => matches!(err, JobError::TooLarge { what: "results", .. }),
        };
        assert!(ok, "length {len}: {err:?}");
        assert!(read_results(&slot[..len]).is_err());
    }
}

#[test]
fn counts_too_large_for_the_slot_are_refused() {
    let j = job();
    let layout = layout();
    let big = 1 << 16;
    // One more sequence than the records hold (the results would still fit).
    let mut slot = encoded(&j, big);
    put(&mut slot, OFF_N_SEQ, 4);
    assert!(matches!(decode_job(&slot, &layout), Err(JobError::TooLarge { what: "sequence count", .. })));
    // Far more sequences than any slot holds results for.
    put(&mut slot, OFF_N_SEQ, u32::MAX);
    assert!(matches!(decode_job(&slot, &layout), Err(JobError::TooLarge { what: "results", .. })));
    // A block count past the request.
    let mut slot = encoded(&j, big);
    put(&mut slot, HEADER_BYTES + 16, u32::MAX);
    assert!(matches!(decode_job(&slot, &layout), Err(JobError::TooLarge { what: "block count", .. })));
    // A block count one short: the records no longer add up to the stated length.
    put(&mut slot, HEADER_BYTES + 16, 2);
    assert!(decode_job(&slot, &layout).is_err());
    // Huge head counts: results overflow, not the arithmetic.
    let mut slot = encoded(&j, big);
    put(&mut slot, OFF_HEAD_DIM, u32::MAX);
    assert!(matches!(decode_job(&slot, &layout), Err(JobError::TooLarge { what: "results", .. })));
    put(&mut slot, OFF_N_SEQ, 0);
    assert!(decode_job(&slot, &layout).is_err());
    // The encoder refuses a slot too small for the results.
    let need = j.slot_bytes_needed().unwrap();
    let mut small = vec![0u8; need - 1];
    assert_eq!(
        encode_job(&j, &mut small),
        Err(JobError::TooLarge { what: "job and its results", need: need as u64, have: need - 1 })
    );
    assert!(small.iter().all(|&b| b == 0), "a refused encode writes nothing");
}

#[test]
fn each_invalid_field_gives_its_error() {
    let layout = layout();
    let q_len = 48;
    let check = |j: AttnJob, expected: JobError| {
        assert_eq!(j.validate(&layout), Err(expected.clone()));
        // What the encoder accepts, the decoder refuses with the same error.
        let mut slot = vec![0u8; 1 << 14];
        if encode_job(&j, &mut slot).is_ok() {
            assert_eq!(decode_job(&slot, &layout), Err(expected));
        }
    };
    let with_seq = |s: SeqJob| AttnJob { seqs: vec![s], ..job() };
    check(
        with_seq(seq(0, 20, 20, 0, &[1, 64], q_len, 0.0)),
        JobError::BlockOutOfArena { seq: 0, block: 64, n_blocks: 64 },
    );
    check(
        with_seq(seq(0, 40, 40, 0, &[1, 2], q_len, 0.0)),
        JobError::RangeNotCovered { seq: 0, start: 0, end: 40, first_pos: 0, covered_end: 32 },
    );
    check(
        with_seq(seq(10, 20, 20, 16, &[1], q_len, 0.0)),
        JobError::RangeNotCovered { seq: 0, start: 10, end: 20, first_pos: 16, covered_end: 32 },
    );
    check(
        with_seq(seq(0, 65 * 16, 65 * 16, 0, &[1; 65], q_len, 0.0)),
        JobError::TooManyBlocks { seq: 0, blocks: 65, n_blocks: 64 },
    );
    check(with_seq(seq(5, 5, 20, 0, &[1], q_len, 0.0)), JobError::EmptyRange { seq: 0, start: 5, end: 5 });
    check(with_seq(seq(0, 9, 8, 0, &[1], q_len, 0.0)), JobError::PastContext { seq: 0, end: 9, n_ctx: 8 });
    check(AttnJob { layer: 4, ..job() }, JobError::LayerOutOfRange { layer: 4, n_layer: 4 });
    check(
        AttnJob { head_dim: 4, n_head: 12, ..job() },
        JobError::ShapeMismatch { field: "head_dim", job: 4, arena: 8 },
    );
    check(AttnJob { n_kv_head: 3, ..job() }, JobError::ShapeMismatch { field: "n_kv_head", job: 3, arena: 2 });
    check(AttnJob { n_head: 5, ..job() }, JobError::HeadsNotGrouped { n_head: 5, n_kv_head: 2 });
    check(AttnJob { kv_padding: 0, ..job() }, JobError::ZeroField { field: "kv_padding" });
    let bf16 = ArenaLayout { dtype: KvDtype::BF16, ..layout };
    assert_eq!(job().validate(&bf16), Err(JobError::UnsupportedDtype(KvDtype::BF16)));
    // Wrong query length: refused by the encoder.
    let mut bad_q = job();
    bad_q.seqs[1].q.pop();
    assert_eq!(encode_job(&bad_q, &mut [0u8; 1 << 14]), Err(JobError::QueryLength { seq: 1, len: 47, need: 48 }));
    // Bad magic and version.
    let mut slot = encoded(&job(), 1 << 14);
    slot[0] = b'X';
    assert_eq!(decode_job(&slot, &layout), Err(JobError::BadMagic { found: *b"XJOB" }));
    let mut slot = encoded(&job(), 1 << 14);
    put(&mut slot, 4, 1);
    assert_eq!(decode_job(&slot, &layout), Err(JobError::UnsupportedVersion { found: 1 }), "version 1 had no soft-cap field");
    // Results that do not match the job are not written.
    let j = job();
    let mut slot = encoded(&j, 1 << 14);
    let mut results = results_for(&j);
    results[2].lse.pop();
    assert!(write_results(&mut slot, &j, &results).is_err());
    assert!(write_results(&mut slot, &j, &results[..2]).is_err());
    assert_eq!(read_results(&slot), Err(JobError::NotDone));
}

/// Random corruption never panics, and whatever decodes is attendable.
#[test]
fn corrupted_slots_never_panic() {
    let layout = layout();
    let j = job();
    let clean = encoded(&j, 1 << 13);
    let mut rng = StdRng::seed_from_u64(3);
    let request = j.request_bytes().unwrap();
    let mut decoded = 0;
    for _ in 0..20_000 {
        let mut slot = clean.clone();
        for _ in 0..rng.random_range(1..4) {
            // Mostly the header and the records' fixed fields, where the counts live.
            let at = if rng.random_bool(0.7) { rng.random_range(0..HEADER_BYTES + 64) } else { rng.random_range(0..request) };
            slot[at] = if rng.random_bool(0.5) { rng.random() } else { slot[at] ^ (1 << rng.random_range(0..8)) };
        }
        let len = if rng.random_bool(0.1) { rng.random_range(0..slot.len()) } else { slot.len() };
        if let Ok(job) = decode_job(&slot[..len], &layout) {
            decoded += 1;
            for s in &job.seqs {
                assert!(s.paged_range(job.layer, job.kv_padding).fits(&layout), "{s:?}");
            }
        }
        let _ = read_results(&slot[..len]);
    }
    assert!(decoded > 0, "some corruptions (of query values) still decode");
}

/// The attention-job fuzz target's seed (fuzz/seeds/attn_job/three_seqs.bin: the layout
/// selector bytes the target reads first, then this file's three-sequence job) decodes to that
/// job; `DUET_WRITE_FUZZ_SEEDS=1` writes it anew.
#[test]
fn the_fuzz_seed_is_this_job() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/attn_job/three_seqs.bin");
    // The fuzz target's layout: n_layer = b0 % 4 + 1, n_kv_head = b1 % 4 + 1, head_dim = b2 % 8 * 8 + 8, n_blocks = b3 + 1.
    let mut seed = vec![3u8, 1, 0, 63];
    seed.extend(encoded(&job(), 4096));
    if std::env::var_os("DUET_WRITE_FUZZ_SEEDS").is_some() {
        std::fs::write(&path, &seed).unwrap();
    }
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(decode_job(&on_disk[4..], &layout()).unwrap(), job());
}

#[test]
fn the_slot_bound_covers_every_job_within_it() {
    // The bound for 3 sequences of 3 blocks at most: the test job (blocks 3, 1, 2) needs less,
    // a job whose every sequence reads 3 blocks needs exactly the bound.
    let j = job();
    let bound = AttnJob::slot_bytes_bound(3, 6, 8, 3).unwrap();
    assert!(j.slot_bytes_needed().unwrap() <= bound);
    let mut full = j.clone();
    for s in &mut full.seqs {
        s.blocks = vec![BlockId(1), BlockId(2), BlockId(3)];
    }
    assert_eq!(full.slot_bytes_needed().unwrap(), bound);
    assert!(AttnJob::slot_bytes_bound(usize::MAX, 6, 8, 3).is_none(), "overflow is None, not a wrap");
}
