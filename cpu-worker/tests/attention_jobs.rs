//! The real duet-cpu-worker binary serving attention jobs: this test plays the gpu-worker,
//! attaching to the worker's arena and exchange ring, writing K/V into arena blocks through
//! `ArenaLayout` offsets and posting jobs; results are checked against the single-process
//! `causal_attention` (bit for bit over whole contexts; split ranges merged by log-sum-exp
//! within the f16 weight-rounding bound). Malformed jobs get an error status and the worker
//! keeps serving; SIGTERM removes its segments. Prints the round trip of a small job.

use std::path::Path;
use std::time::{Duration, Instant};

use duet_kernels::attention::{KvHead, KvRows, KV_PADDING};
use duet_kernels::causal::causal_attention;
use duet_kernels::decode_batch::{merge_lse, merge_partials};
use duet_kv::{ArenaLayout, BlockId};
use duet_kv::shm::job::{encode_job, read_results, AttnJob, JobError, SeqJob, SeqResult};
use duet_kv::shm::{Producer, Segment, ShmError, SHM_DIR};
use duet_cpu_worker::{arena_name, ring_name};
use half::f16;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

mod support;

use support::{attach, Worker, BLOCK_SIZE, N_LAYER, SHAPE, WAIT};

const KV_BLOCKS: u32 = 400;
/// The layer the jobs read; the other layer holds different values, to catch wrong offsets.
const LAYER: u32 = 1;
/// Split-and-merged against unsplit: two f16 roundings of the softmax weights, 2 · 2^-11
/// · max|v| with |v| <= 1 (see kv/tests/paged_attention.rs).
const SPLIT_TOL: f32 = 2.0 / 2048.0 * 1.01;

/// One sequence: its K/V (per KV head, contiguous) written into its arena blocks.
struct Sequence {
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    blocks: Vec<BlockId>,
    q: Vec<f32>,
    n: usize,
}

impl Sequence {
    fn new(n: usize, free: &mut Vec<BlockId>, arena: &Segment, layout: &ArenaLayout, rng: &mut StdRng) -> Sequence {
        let hd = SHAPE.head_dim;
        let blocks: Vec<BlockId> = (0..n.div_ceil(BLOCK_SIZE)).map(|_| free.pop().expect("enough blocks")).collect();
        let mut rows = |len: usize| (0..len).map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0))).collect::<Vec<_>>();
        let k: Vec<Vec<f16>> = (0..SHAPE.n_kv_head).map(|_| rows(n * hd)).collect();
        let v: Vec<Vec<f16>> = (0..SHAPE.n_kv_head).map(|_| rows(n * hd)).collect();
        for layer in 0..N_LAYER {
            for h in 0..SHAPE.n_kv_head {
                for p in 0..n {
                    let (block, slot) = (blocks[p / BLOCK_SIZE], p % BLOCK_SIZE);
                    let at = |run: usize| run + slot * hd * 2;
                    let (k_at, v_at) = (at(layout.k_offset(block, layer, h as u32)), at(layout.v_offset(block, layer, h as u32)));
                    // SAFETY: the worker reads arena rows only while serving a job that names
                    // them, and no job is in flight while the test writes.
                    let (kd, vd) = unsafe { (arena.slice_mut::<f16>(k_at, hd), arena.slice_mut::<f16>(v_at, hd)) };
                    let row = p * hd..(p + 1) * hd;
                    if layer == LAYER {
                        kd.copy_from_slice(&k[h][row.clone()]);
                        vd.copy_from_slice(&v[h][row]);
                    } else {
                        kd.fill(f16::from_f32(9.0));
                        vd.fill(f16::from_f32(-9.0));
                    }
                }
            }
        }
        let q = (0..SHAPE.n_head * hd).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        Sequence { k, v, blocks, q, n }
    }

    /// The single-process result for the decode token at position n - 1.
    fn reference(&self) -> Vec<f32> {
        let heads: Vec<KvHead<'_>> = self.k.iter().zip(&self.v).map(|(k, v)| KvHead { k: KvRows::F16(k), v: KvRows::F16(v) }).collect();
        let mut out = vec![0f32; self.q.len()];
        causal_attention(&self.q, &heads, SHAPE, self.n - 1, &mut out);
        out
    }

    /// The job entry for positions `start..end` (blocks from the one holding `start`).
    fn range(&self, start: usize, end: usize) -> SeqJob {
        let first = start / BLOCK_SIZE;
        SeqJob {
            start: start as u32,
            end: end as u32,
            n_ctx: self.n as u32,
            first_pos: (first * BLOCK_SIZE) as u32,
            blocks: self.blocks[first..(end - 1) / BLOCK_SIZE + 1].to_vec(),
            q: self.q.clone(),
        }
    }
}

fn job(seqs: Vec<SeqJob>) -> AttnJob {
    AttnJob {
        layer: LAYER,
        n_head: SHAPE.n_head as u32,
        n_kv_head: SHAPE.n_kv_head as u32,
        head_dim: SHAPE.head_dim as u32,
        kv_padding: KV_PADDING as u32,
        softcap: None,
        seqs,
    }
}

/// Posts `job`, waits for it and reads its results.
fn round_trip(p: &mut Producer, job: &AttnJob) -> Result<Vec<SeqResult>, JobError> {
    let mut encoded = Ok(());
    let seq = p.post(|slot| encoded = encode_job(job, slot)).unwrap();
    encoded.expect("the test's jobs fit the slot");
    read_results(p.wait_done_timeout(seq, WAIT).unwrap())
}

/// Median, p99 and max round trip of `job` in µs, over `n` trips after n/10 warm-up trips.
fn time_round_trips(p: &mut Producer, job: &AttnJob, n: usize) -> (f64, f64, f64) {
    let mut times: Vec<Duration> = (0..n + n / 10)
        .map(|_| {
            let t = Instant::now();
            round_trip(p, job).unwrap();
            t.elapsed()
        })
        .skip(n / 10)
        .collect();
    times.sort_unstable();
    let pct = |q: f64| times[((times.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    (pct(0.5), pct(0.99), pct(1.0))
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn worker_serves_attention_jobs() {
    let instance = format!("test{}", std::process::id());
    let mut worker = Worker::start(&instance, 0, KV_BLOCKS, &[]);
    let (arena, layout, mut producer) = attach(&mut worker);
    assert_eq!((layout.n_layer, layout.n_kv_head, layout.head_dim), (N_LAYER, 2, 64));
    assert_eq!((layout.block_size as usize, layout.n_blocks), (BLOCK_SIZE, KV_BLOCKS));

    let mut rng = StdRng::seed_from_u64(11);
    let mut free: Vec<BlockId> = (0..KV_BLOCKS).map(BlockId).collect();
    free.shuffle(&mut rng);
    // One sequence over several blocks, one partial block, one just past a block boundary, and
    // one longer than two attention chunks (`DECODE_CHUNK`), whose chunks run as tasks of
    // their own and are merged as single-process decode merges them.
    let seqs: Vec<Sequence> = [100, 5, 33, 4500].map(|n| Sequence::new(n, &mut free, &arena, &layout, &mut rng)).into();
    let references: Vec<Vec<f32>> = seqs.iter().map(Sequence::reference).collect();

    // Whole contexts: bit for bit the single-process result.
    let whole = round_trip(&mut producer, &job(seqs.iter().map(|s| s.range(0, s.n)).collect())).unwrap();
    for (i, (r, reference)) in whole.iter().zip(&references).enumerate() {
        assert_eq!(bits(&r.out), bits(reference), "sequence {i} (n = {}): worker != causal_attention", seqs[i].n);
    }

    // Split ranges in one job, merged per query head by log-sum-exp.
    let cuts: [&[usize]; 4] = [&[40], &[2], &[16, 17], &[3000]];
    let mut entries = Vec::new();
    for (s, cut) in seqs.iter().zip(cuts) {
        let bounds: Vec<usize> = std::iter::once(0).chain(cut.iter().copied()).chain([s.n]).collect();
        entries.extend(bounds.windows(2).map(|w| s.range(w[0], w[1])));
    }
    let parts = round_trip(&mut producer, &job(entries)).unwrap();
    let mut parts = parts.iter();
    let hd = SHAPE.head_dim;
    for (i, cut) in cuts.iter().enumerate() {
        let mine: Vec<&SeqResult> = parts.by_ref().take(cut.len() + 1).collect();
        for h in 0..SHAPE.n_head {
            let heads = h * hd..(h + 1) * hd;
            let ps: Vec<(&[f32], f32)> = mine.iter().map(|r| (&r.out[heads.clone()], r.lse[h])).collect();
            let merged = merge_partials(&ps);
            let d = merged.iter().zip(&whole[i].out[heads]).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
            assert!(d <= SPLIT_TOL, "sequence {i} head {h}: |merged - whole| = {d:e}");
            let lses: Vec<f32> = mine.iter().map(|r| r.lse[h]).collect();
            let l = merge_lse(&lses);
            assert!((l - whole[i].lse[h]).abs() <= 1e-5 * l.abs().max(1.0), "sequence {i} head {h}: lse {l}");
        }
    }

    // Malformed jobs: an error status each, and the worker keeps serving.
    let mut bad = seqs[0].range(0, seqs[0].n);
    bad.blocks[3] = BlockId(9999);
    match round_trip(&mut producer, &job(vec![bad])) {
        Err(JobError::Rejected { kind, message }) => {
            assert_eq!(kind, JobError::BlockOutOfArena { seq: 0, block: 0, n_blocks: 0 }.kind());
            assert!(message.contains("9999"), "{message}");
        }
        other => panic!("expected a rejected job, got {other:?}"),
    }
    let seq = producer.post(|slot| slot[..4096].fill(0xA5)).unwrap();
    match read_results(producer.wait_done_timeout(seq, WAIT).unwrap()) {
        Err(JobError::Rejected { kind, .. }) => assert_eq!(kind, JobError::BadMagic { found: [0; 4] }.kind()),
        other => panic!("expected a rejected job, got {other:?}"),
    }
    let again = round_trip(&mut producer, &job(vec![seqs[2].range(0, seqs[2].n)])).unwrap();
    assert_eq!(bits(&again[0].out), bits(&references[2]), "after malformed jobs");

    // Round trip of a small job: one sequence of one block.
    let small = job(vec![seqs[1].range(0, seqs[1].n)]);
    if let Some(allowed) = duet_cpu_worker::numa::allowed_cpus() {
        if allowed.contains(&0) {
            let _ = duet_cpu_worker::numa::pin_current_thread(&[0]); // off the worker's CPU
        }
    }
    let (median, p99, max) = time_round_trips(&mut producer, &small, 3000);
    println!(
        "round trip of a small job (1 sequence, 5 positions, 6 query heads of 64): median {median:.1} µs, p99 {p99:.1} µs, max {max:.1} µs"
    );
    let (median, p99, max) = time_round_trips(&mut producer, &job(vec![]), 3000);
    println!("round trip of an empty job (data plane only): median {median:.1} µs, p99 {p99:.1} µs, max {max:.1} µs");

    // SIGTERM: the worker stops, exits cleanly and removes its segments.
    worker.signal(libc::SIGTERM);
    let status = worker.wait_exit(WAIT);
    assert!(status.success(), "worker exit status after SIGTERM: {status}");
    for name in [arena_name(&instance, 0), ring_name(&instance, 0)] {
        assert!(!Path::new(SHM_DIR).join(&name).exists(), "{name} was not removed");
    }
    // The ring was closed on the way out: a producer still holding it is told so.
    assert!(matches!(producer.post(|_| {}), Err(ShmError::Closed { .. })));
}
