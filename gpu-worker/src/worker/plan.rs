//! A sequence's part of a step as the executor accepted it: what the layer loop, the
//! attention jobs and the sampler read of it; and a cpu-worker's entry of the step's timings.

use std::ops::Range;
use std::time::Duration;

use duet_kv::BlockId;
use duet_proto::pb;

/// One device's share of a decode token's attention.
#[derive(Debug, Clone)]
pub(crate) struct Share {
    pub cpu_worker: Option<u32>,
    pub range: Range<usize>,
}

/// A sequence's part of the running step.
#[derive(Debug)]
pub(crate) struct Planned {
    pub seq_id: u64,
    /// Its first row in its (sub-)batch.
    pub row0: usize,
    /// Its rows (input tokens).
    pub n: usize,
    /// Position of its first row.
    pub start: usize,
    pub blocks: Vec<(u32, BlockId)>,
    /// Decode attention split by device; empty: attention over the whole context here.
    pub shares: Vec<Share>,
    pub sample: bool,
    /// Score its inputs (`prompt_logprobs`): each input after the first, then `next_token`
    /// after the last where given.
    pub score: bool,
    pub next_token: Option<u32>,
}

impl Planned {
    pub fn n_ctx(&self) -> usize {
        self.start + self.n
    }

    /// How far the gpu-worker's device attends the context (positions `0..end`): all of
    /// it without shares, else to the end of its shares (0 when the cpu-workers have all).
    pub fn device_end(&self) -> usize {
        if self.shares.is_empty() {
            return self.n_ctx();
        }
        self.shares.iter().filter(|s| s.cpu_worker.is_none()).map(|s| s.range.end).max().unwrap_or(0)
    }
}

/// A duration in nanoseconds (saturating), as the step's statistics report it.
pub(crate) fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

/// Worker `worker`'s entry of a step's timings, added on first use.
pub(crate) fn worker_timing(timings: &mut pb::StepTimings, worker: u32) -> &mut pb::CpuWorkerTiming {
    match timings.cpu_workers.iter().position(|t| t.worker == worker) {
        Some(i) => &mut timings.cpu_workers[i],
        None => {
            timings.cpu_workers.push(pb::CpuWorkerTiming { worker, ..Default::default() });
            timings.cpu_workers.last_mut().expect("just pushed")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_attends_the_whole_context_without_shares_else_to_the_end_of_its_own() {
        let planned = |shares: Vec<Share>| Planned { seq_id: 1, row0: 0, n: 1, start: 99, blocks: vec![], shares, sample: true, score: false, next_token: None };
        let share = |cpu_worker, range| Share { cpu_worker, range };
        assert_eq!(planned(vec![]).device_end(), 100);
        assert_eq!(planned(vec![share(None, 0..64), share(Some(0), 64..100)]).device_end(), 64);
        assert_eq!(planned(vec![share(Some(0), 0..64), share(Some(1), 64..100)]).device_end(), 0);
    }
}
