//! The routed experts of a step that the cpu-workers serve: per MoE layer, the device's
//! items for experts it does not hold go to their owners ([`expert_owner`] over the attached
//! workers: cpu-worker `i` started with `--experts-of i/N`) as expert jobs in the same
//! exchange rings as attention jobs, cut to fit the slots, while the device computes its own;
//! then the weighted outputs come back in the items' order.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use duet_kv::shm::expert_job::{encode_expert_job, expert_owner, read_expert_results, ExpertItem, ExpertJob};
use duet_proto::pb;

use super::arenas::KvArenas;
use super::plan::{ns, worker_timing};
use crate::device::RemoteExperts;
use crate::error::{GpuWorkerError, Result};

/// One layer's expert jobs on the cpu-workers, started and finished once per MoE layer.
pub(super) struct StepExperts<'a> {
    arenas: &'a mut KvArenas,
    /// The model's experts per layer.
    n_expert: u32,
    job_timeout: Duration,
    timings: &'a mut pb::StepTimings,
    /// Per worker with items: its jobs not yet posted and those in flight.
    queues: Vec<Queue>,
    n_items: usize,
    /// The model's width: the length of a row and of an output.
    n_embd: usize,
}

/// One worker's jobs of the layer: each with the indices of the items it answers.
struct Queue {
    worker: u32,
    waiting: VecDeque<(ExpertJob, Vec<usize>)>,
    in_flight: VecDeque<(u64, Vec<usize>)>,
}

impl<'a> StepExperts<'a> {
    /// The layer's expert jobs on `arenas`' workers; no other job may be in flight in their
    /// rings (the executor runs sub-batches in turn when the experts are remote), so the
    /// layer's jobs may take every slot.
    pub fn new(arenas: &'a mut KvArenas, n_expert: u32, n_embd: usize, job_timeout: Duration, timings: &'a mut pb::StepTimings) -> Self {
        StepExperts { arenas, n_expert, job_timeout, timings, queues: Vec::new(), n_items: 0, n_embd }
    }

    fn fail(worker: u32, what: String) -> GpuWorkerError {
        GpuWorkerError::RemoteExperts { worker: Some(worker), what }
    }

    /// Posts the queue's waiting jobs while the worker's ring has room for them.
    fn post_ready(&mut self, q: usize) -> Result<()> {
        let Queue { worker, waiting, in_flight } = &mut self.queues[q];
        let w = self.arenas.worker_mut(*worker)?;
        // A job's slot is reused only after its answer was read (`finish` reads in order).
        let window = w.producer.ring().slots() as usize;
        while in_flight.len() < window {
            let Some((job, items)) = waiting.pop_front() else { break };
            let mut encoded = Ok(());
            let seqno = w.producer.post(|slot| encoded = encode_expert_job(&job, slot)).map_err(|e| Self::fail(*worker, format!("posting an expert job: {e}")))?;
            encoded.map_err(|e| Self::fail(*worker, format!("encoding an expert job: {e}")))?;
            in_flight.push_back((seqno, items));
        }
        Ok(())
    }
}

/// One job being cut: the job, the indices of its items, and the batch rows its rows are.
struct Cut {
    job: ExpertJob,
    items: Vec<usize>,
    rows: Vec<u32>,
}

impl Cut {
    fn new(layer: u32, d: usize) -> Self {
        Cut { job: ExpertJob { layer, n_embd: d as u32, items: vec![], rows: vec![] }, items: vec![], rows: vec![] }
    }

    /// Adds item `i` (`it`, of batch row `it.row` of `x`), with its row if the job lacks it.
    fn add(&mut self, it: ExpertItem, i: usize, x: &[f32], d: usize) {
        let local = match self.rows.iter().position(|&r| r == it.row) {
            Some(p) => p,
            None => {
                self.rows.push(it.row);
                self.job.rows.extend_from_slice(&x[it.row as usize * d..(it.row as usize + 1) * d]);
                self.rows.len() - 1
            }
        };
        self.job.items.push(ExpertItem { row: local as u32, ..it });
        self.items.push(i);
    }
}

/// Cuts one worker's items (`idx` into `items`, over batch rows `x` of `d`) into jobs that
/// fit `slot_bytes`, each with only the rows its items read.
fn cut_jobs(layer: u32, x: &[f32], d: usize, items: &[ExpertItem], idx: &[usize], slot_bytes: usize) -> Result<Vec<(ExpertJob, Vec<usize>)>, String> {
    let mut jobs = Vec::new();
    let mut cut = Cut::new(layer, d);
    for &i in idx {
        let it = items[i];
        let n_rows = cut.rows.len() + usize::from(!cut.rows.contains(&it.row));
        if ExpertJob::slot_bytes_for(cut.job.items.len() + 1, n_rows, d).is_none_or(|b| b > slot_bytes) {
            if cut.items.is_empty() {
                return Err(format!("one item of {d} values does not fit its {slot_bytes}-byte ring slots (raise its --slot-bytes)"));
            }
            let full = std::mem::replace(&mut cut, Cut::new(layer, d));
            jobs.push((full.job, full.items));
        }
        cut.add(it, i, x, d);
    }
    if !cut.items.is_empty() {
        jobs.push((cut.job, cut.items));
    }
    Ok(jobs)
}

impl RemoteExperts for StepExperts<'_> {
    fn start(&mut self, layer: usize, x: &[f32], items: &[ExpertItem]) -> Result<()> {
        let n_workers = self.arenas.worker_slots() as u32;
        if n_workers == 0 {
            return Err(GpuWorkerError::RemoteExperts { worker: None, what: "no cpu-worker is attached to serve them".into() });
        }
        let mut by_worker: Vec<(u32, Vec<usize>)> = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let w = expert_owner(it.expert, self.n_expert, n_workers);
            match by_worker.iter_mut().find(|(x, _)| *x == w) {
                Some((_, v)) => v.push(i),
                None => by_worker.push((w, vec![i])),
            }
        }
        self.queues.clear();
        self.n_items = items.len();
        for (worker, idx) in by_worker {
            let slot_bytes = self.arenas.worker(worker)?.producer.ring().slot_bytes();
            let jobs = cut_jobs(layer as u32, x, self.n_embd, items, &idx, slot_bytes).map_err(|e| Self::fail(worker, e))?;
            self.queues.push(Queue { worker, waiting: jobs.into(), in_flight: VecDeque::new() });
            let q = self.queues.len() - 1;
            self.post_ready(q)?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<Vec<f32>> {
        let d = self.n_embd;
        let mut out = vec![0f32; self.n_items * d];
        let t = Instant::now();
        for q in 0..self.queues.len() {
            let worker = self.queues[q].worker;
            while let Some((seqno, idx)) = self.queues[q].in_flight.pop_front() {
                let w = self.arenas.worker_mut(worker)?;
                let read = w.wait_answer(seqno, self.job_timeout).and_then(|()| {
                    let slot = w.producer.wait_done_timeout(seqno, Duration::ZERO).map_err(|e| e.to_string())?;
                    let busy = duet_kv::shm::job::busy_ns(slot);
                    read_expert_results(slot).map(|r| (r, busy)).map_err(|e| e.to_string())
                });
                let (values, busy) = match read {
                    Ok(r) if r.0.len() == idx.len() * d => r,
                    Ok(r) => {
                        self.arenas.detach(worker);
                        return Err(Self::fail(worker, format!("{} values back for {} items", r.0.len(), idx.len())));
                    }
                    Err(e) => {
                        // Its ring can no longer be trusted: steps fail until it is attached again.
                        self.arenas.detach(worker);
                        return Err(Self::fail(worker, e));
                    }
                };
                worker_timing(self.timings, worker).experts_busy_ns += busy;
                for (&i, v) in idx.iter().zip(values.chunks_exact(d)) {
                    out[i * d..(i + 1) * d].copy_from_slice(v);
                }
                self.post_ready(q)?;
            }
        }
        self.timings.experts_wait_ns += ns(t.elapsed());
        self.queues.clear();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(expert: u32, row: u32) -> ExpertItem {
        ExpertItem { expert, row, weight: 0.5 + row as f32 }
    }

    #[test]
    fn items_are_cut_into_jobs_that_fit_the_slot_each_with_only_its_rows() {
        let d = 4;
        let x: Vec<f32> = (0..3 * d).map(|v| v as f32).collect();
        let items = [item(0, 2), item(1, 0), item(0, 0), item(2, 1)];
        let idx = [0, 1, 2, 3];
        // Room for two items over two rows per job.
        let slot = ExpertJob::slot_bytes_for(2, 2, d).unwrap();
        let jobs = cut_jobs(5, &x, d, &items, &idx, slot).unwrap();
        assert_eq!(jobs.len(), 2);
        let (first, of_first) = &jobs[0];
        assert_eq!(of_first, &[0, 1]);
        assert_eq!(first.layer, 5);
        assert_eq!(first.rows, [&x[8..12], &x[0..4]].concat(), "rows 2 and 0, in first use");
        assert_eq!(first.items, [ExpertItem { row: 0, ..items[0] }, ExpertItem { row: 1, ..items[1] }]);
        let (second, of_second) = &jobs[1];
        assert_eq!(of_second, &[2, 3]);
        assert_eq!(second.rows, [&x[0..4], &x[4..8]].concat());
        assert!(jobs.iter().all(|(j, _)| j.slot_bytes_needed().unwrap() <= slot));
        // Everything in one job when the slot is large; an item that fits no slot is an error.
        assert_eq!(cut_jobs(5, &x, d, &items, &idx, 1 << 20).unwrap().len(), 1);
        assert!(cut_jobs(5, &x, d, &items, &idx, 300).is_err());
    }
}
