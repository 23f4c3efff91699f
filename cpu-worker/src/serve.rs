//! The job loop: takes jobs from the exchange ring in order — attention jobs (paged decode
//! attention for every (sequence, KV head) of a job in parallel on the worker's pool) and
//! expert jobs (`crate::experts`) — writes the results (or an error status) into the job's
//! slot and completes it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use duet_kernels::attention::AttnShape;
use duet_kernels::decode_batch::{decode_batch, DecodeQuery};
use duet_kv::paged::{rows, ArenaRows, PagedRange};
use duet_kv::ArenaLayout;
use duet_kv::shm::job::{caught, decode_job, write_busy_ns, write_error, write_results, AttnJob, JobError, SeqResult};
use duet_kv::shm::{Consumer, ShmError};

use duet_kv::shm::expert_job::is_expert_job;

use crate::arena::Arena;
use crate::experts::{self, ServedExperts};
use crate::CpuWorkerError;

/// What a worker did until it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServeStats {
    /// Jobs answered with results.
    pub served: u64,
    /// Jobs answered with an error status.
    pub rejected: u64,
}

/// Live job counters, shared by the job loop (which counts) and the control plane (which
/// reports them); one relaxed increment per job.
#[derive(Debug, Default)]
pub struct JobCounters {
    served: AtomicU64,
    rejected: AtomicU64,
}

impl JobCounters {
    /// The counts so far.
    pub fn snapshot(&self) -> ServeStats {
        ServeStats { served: self.served.load(Ordering::Relaxed), rejected: self.rejected.load(Ordering::Relaxed) }
    }
}

/// Serves jobs until `shutdown` is set (checked at least every `poll`) or the producer
/// closes the ring, counting them in `counters`. Call it on the worker's pool
/// (`pool.install`) so that a job's parallel work runs on the pinned threads.
pub fn serve(
    consumer: &mut Consumer,
    arena: &Arena,
    experts: Option<&ServedExperts>,
    shutdown: &AtomicBool,
    poll: Duration,
    counters: &JobCounters,
) -> Result<ServeStats, CpuWorkerError> {
    while !shutdown.load(Ordering::Relaxed) {
        let (seq, slot) = match consumer.next_job_timeout(poll) {
            Ok(job) => job,
            Err(ShmError::TimedOut { .. }) => continue,
            Err(ShmError::Closed { .. }) => {
                tracing::info!("exchange ring closed by the producer");
                break;
            }
            Err(e) => return Err(e.into()),
        };
        // SAFETY: the job is posted and not yet complete, so by the data-plane protocol the
        // gpu-worker does not write the K/V rows it reads until `complete` below.
        let rows = unsafe { arena.rows_of_posted_job() };
        let started = Instant::now();
        let answered = match is_expert_job(slot) {
            true => experts::answer(slot, experts),
            false => answer(slot, &rows, arena.layout()),
        };
        match answered {
            Ok(()) => {
                counters.served.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(job = seq, "rejected job: {e}");
                write_error(slot, &e);
                counters.rejected.fetch_add(1, Ordering::Relaxed);
            }
        }
        write_busy_ns(slot, started.elapsed().as_nanos().min(u64::MAX as u128) as u64);
        consumer.complete(seq);
    }
    Ok(counters.snapshot())
}

/// Decodes the job in `slot`, attends it and writes its results; a malformed job, or a
/// panic while attending it, becomes an error for the slot.
pub fn answer<A: ArenaRows + ?Sized>(slot: &mut [u8], arena: &A, layout: &ArenaLayout) -> Result<(), JobError> {
    let job = decode_job(slot, layout)?;
    let results = caught(|| attend_job(&job, arena, layout))?;
    write_results(slot, &job, &results)
}

/// Paged attention of every (sequence, KV head) of a validated job, in parallel (the decode
/// fan-out every device uses, `decode_batch`: long contexts as one task per `DECODE_CHUNK`,
/// merged), each task reading its KV head's rows in place, once for the query group.
pub fn attend_job<A: ArenaRows + ?Sized>(job: &AttnJob, arena: &A, layout: &ArenaLayout) -> Vec<SeqResult> {
    let shape = AttnShape { n_head: job.n_head as usize, n_kv_head: job.n_kv_head as usize, head_dim: job.head_dim as usize, softcap: job.softcap };
    let queries: Vec<DecodeQuery<'_>> =
        job.seqs.iter().map(|s| DecodeQuery { q: &s.q, range: s.start as usize..s.end as usize, n_ctx: s.n_ctx as usize }).collect();
    let runs = |s: usize, h: usize, chunk: std::ops::Range<usize>| {
        let r = PagedRange { start: chunk.start, end: chunk.end, ..job.seqs[s].paged_range(job.layer, job.kv_padding) };
        Ok::<_, std::convert::Infallible>(rows(arena, layout, &r, h as u32).collect())
    };
    let Ok(parts) = decode_batch(&queries, shape, job.kv_padding as usize, duet_kernels::decode_batch::PARALLEL_MIN_POSITIONS, runs);
    parts.into_iter().map(|(out, lse)| SeqResult { out, lse }).collect()
}
