//! The attention of a step on the gpu-worker: per layer, the batch's new K/V rows go into
//! the arena slots the gateway allocated, each cpu-worker with shares gets one job, the
//! gpu-worker computes prefill attention and its own decode shares meanwhile, and the
//! partial results are merged by log-sum-exp. Split into begin (write, post) and finish
//! (own part, wait, merge) so that two sub-batches' layers can interleave.

use std::ops::Range;
use std::time::{Duration, Instant};

use duet_common::kernels::attention::{
    attn_scale, causal_attention, chunk_tasks, decode_group, merge_chunk_tasks, padded_len, AttnShape, ChunkTask, GroupScratch, KvHead, KV_PADDING,
};
use duet_common::kernels::paged_attention::merge_partials;
use duet_common::rpc::pb;
use duet_common::shm::job::{busy_ns, encode_job, read_results, AttnJob, SeqJob, SeqResult};
use rayon::prelude::*;

use super::arenas::KvArenas;
use super::executor::{ns, Planned};
use super::StepError;
use crate::device::cpu::Attention;
use crate::error::WorkerError;

/// A partial attention result: the output (`[head][head_dim]`) and each head's log-sum-exp.
type Partial = (Vec<f32>, Vec<f32>);

/// Decode work read in place: (plan index, the share or `None` for a whole context, positions).
type InPlace = (usize, Option<usize>, Range<usize>);

/// How often a wait for a cpu-worker's answer checks that the worker is still alive.
const LIVENESS_CHECK: Duration = Duration::from_millis(50);

/// Waits until job `seqno` of `w` is answered: fails once `timeout` passes or as soon as
/// the worker's process is gone.
fn wait_for(w: &mut super::arenas::AttachedWorker, seqno: u64, timeout: Duration) -> Result<(), String> {
    let start = Instant::now();
    loop {
        match w.producer.wait_done_timeout(seqno, LIVENESS_CHECK.min(timeout)) {
            Ok(_) => return Ok(()),
            Err(duet_common::shm::ShmError::TimedOut { .. }) => {}
            Err(e) => return Err(format!("no answer to its attention job ({e})")),
        }
        if !w.alive() {
            return Err(format!("its process {} is gone", w.pid.unwrap_or(0)));
        }
        if start.elapsed() >= timeout {
            return Err(format!("no answer to its attention job within {timeout:?}"));
        }
    }
}

/// The attention of one step, layer by layer, for one batch (`plan`) or two sub-batches
/// whose layers interleave: [`Self::begin`] writes a layer's new K/V rows and posts the
/// cpu-workers' jobs, [`Self::finish`] computes the gpu-worker's own part, waits for the
/// jobs and merges.
pub(super) struct StepAttention<'a> {
    pub arenas: &'a mut KvArenas,
    pub block_size: usize,
    /// The model's attention heads: the rows of q, k, v and out are `n_head · head_dim`
    /// and `n_kv_head · head_dim` wide.
    pub shape: AttnShape,
    pub job_timeout: Duration,
    pub timings: &'a mut pb::StepTimings,
}

/// Jobs posted for one layer of one (sub-)batch, to be finished.
pub(super) struct Begun {
    layer: u32,
    posted: Vec<Posted>,
}

/// A job posted to a cpu-worker: its sequence number in the ring and, per job sequence,
/// the (plan index, share index) it answers.
struct Posted {
    worker: u32,
    seqno: u64,
    members: Vec<(usize, usize)>,
    /// KV positions the job attends.
    positions: u64,
}

/// One batch's attention through the model's [`Attention`] interface, layer after layer.
pub(super) struct WholeBatch<'s, 'a> {
    pub attention: &'s mut StepAttention<'a>,
    pub plan: &'s [Planned],
}

impl Attention for WholeBatch<'_, '_> {
    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) -> Result<(), WorkerError> {
        let begun = self.attention.begin(self.plan, layer as u32, q, k, v).map_err(to_worker_error)?;
        self.attention.finish(self.plan, begun, q, out).map_err(to_worker_error)
    }
}

pub(super) fn to_worker_error(e: StepError) -> WorkerError {
    match e {
        StepError::Model(m) => m,
        other => WorkerError::Step(other.to_string()),
    }
}

impl StepAttention<'_> {
    /// Writes layer `layer`'s new K/V rows of `plan` into the arenas and posts one job per
    /// cpu-worker with shares.
    pub fn begin(&mut self, plan: &[Planned], layer: u32, q: &[f32], k: &[f32], v: &[f32]) -> Result<Begun, StepError> {
        let bs = self.block_size;
        let kv_dim = self.shape.n_kv_head * self.shape.head_dim;
        let t = Instant::now();
        for p in plan {
            for i in 0..p.n {
                let (pos, row) = (p.start + i, p.row0 + i);
                let (w, b) = p.blocks[pos / bs];
                self.arenas.write_token(w, b, pos % bs, layer, &k[row * kv_dim..(row + 1) * kv_dim], &v[row * kv_dim..(row + 1) * kv_dim])?;
            }
        }
        self.timings.kv_write_ns += ns(t.elapsed());
        let posted = self.post_jobs(plan, layer, q)?;
        Ok(Begun { layer, posted })
    }

    /// The gpu-worker's own part of a begun layer (prefill chunks, unsplit decode tokens,
    /// its decode shares), then the cpu-workers' results, merged by log-sum-exp into `out`.
    pub fn finish(&mut self, plan: &[Planned], begun: Begun, q: &[f32], out: &mut [f32]) -> Result<(), StepError> {
        let Begun { layer, posted } = begun;
        let shape = self.shape;
        let (hd, n_kv) = (shape.head_dim, shape.n_kv_head);
        let q_dim = shape.n_head * hd;
        // The gpu-worker's own part: prefill chunks (and unsplit decode tokens) over the
        // whole context, and its decode shares.
        let t = Instant::now();
        let mut partials: Vec<Vec<Partial>> = plan.iter().map(|p| vec![Default::default(); p.shares.len()]).collect();
        // Decode work read in place, all of it in one parallel loop: unsplit tokens over their
        // whole context (`None`) and the gpu-worker's shares (`Some(share)`).
        let mut in_place: Vec<InPlace> = Vec::new();
        let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
        for (pi, p) in plan.iter().enumerate() {
            if p.shares.is_empty() && p.n == 1 {
                if layer == 0 {
                    self.timings.gpu_attention_positions += p.n_ctx() as u64;
                }
                in_place.push((pi, None, 0..p.n_ctx()));
                continue;
            }
            if p.shares.is_empty() {
                let mut heads = Vec::with_capacity(n_kv);
                for h in 0..n_kv {
                    self.arenas.gather(&p.blocks, layer, h as u32, 0..p.n_ctx(), &mut kbuf, &mut vbuf)?;
                    heads.push((std::mem::take(&mut kbuf), std::mem::take(&mut vbuf)));
                }
                let views: Vec<KvHead<'_>> = heads.iter().map(|(k, v)| KvHead { k, v }).collect();
                let rows = p.row0 * q_dim..(p.row0 + p.n) * q_dim;
                causal_attention(&q[rows.clone()], &views, shape, p.start, &mut out[rows]);
                continue;
            }
            for (si, sh) in p.shares.iter().enumerate() {
                if sh.cpu_worker.is_some() {
                    continue;
                }
                if layer == 0 {
                    self.timings.gpu_attention_positions += sh.range.len() as u64;
                }
                in_place.push((pi, Some(si), sh.range.clone()));
            }
        }
        let results = self.attend_in_place(plan, layer, &in_place, q)?;
        for ((pi, share, _), (o, l)) in in_place.into_iter().zip(results) {
            match share {
                Some(si) => partials[pi][si] = (o, l),
                None => out[plan[pi].row0 * q_dim..(plan[pi].row0 + 1) * q_dim].copy_from_slice(&o),
            }
        }
        self.timings.attention_gpu_ns += ns(t.elapsed());

        let t = Instant::now();
        for job in posted {
            let worker = job.worker;
            let fail = |what: String| StepError::CpuWorker { worker, what: format!("layer {layer}: {what}") };
            let w = self.arenas.worker_mut(worker)?;
            let mut busy = 0;
            let results = match wait_for(w, job.seqno, self.job_timeout) {
                Ok(()) => {
                    let slot = w.producer.wait_done_timeout(job.seqno, Duration::ZERO).map_err(|e| fail(e.to_string()))?;
                    busy = busy_ns(slot);
                    read_results(slot).map_err(|e| fail(e.to_string()))
                }
                Err(e) => Err(fail(e)),
            };
            match self.timings.cpu_workers.iter_mut().find(|t| t.worker == worker) {
                Some(t) => {
                    t.busy_ns += busy;
                    t.positions += job.positions;
                }
                None => self.timings.cpu_workers.push(pb::CpuWorkerTiming { worker, busy_ns: busy, positions: job.positions }),
            }
            let results: Vec<SeqResult> = match results {
                Ok(r) if r.len() == job.members.len() => r,
                Ok(r) => Err(fail(format!("{} results for {} sequences", r.len(), job.members.len())))?,
                Err(e) => {
                    // Its ring can no longer be trusted: steps fail until it is attached again.
                    self.arenas.detach(worker);
                    return Err(e);
                }
            };
            for ((pi, si), r) in job.members.into_iter().zip(results) {
                partials[pi][si] = (r.out, r.lse);
            }
        }
        self.timings.attention_wait_ns += ns(t.elapsed());

        let t = Instant::now();
        for (p, parts) in plan.iter().zip(&partials) {
            if p.shares.is_empty() {
                continue;
            }
            let o = &mut out[p.row0 * q_dim..(p.row0 + 1) * q_dim];
            for (h, oh) in o.chunks_exact_mut(hd).enumerate() {
                let head_parts: Vec<(&[f32], f32)> = parts.iter().map(|(po, pl)| (&po[h * hd..(h + 1) * hd], pl[h])).collect();
                oh.copy_from_slice(&merge_partials(&head_parts));
            }
        }
        self.timings.merge_ns += ns(t.elapsed());
        Ok(())
    }

    /// Posts one attention job per cpu-worker that has shares in this step.
    fn post_jobs(&mut self, plan: &[Planned], layer: u32, q: &[f32]) -> Result<Vec<Posted>, StepError> {
        let AttnShape { n_head, n_kv_head, head_dim } = self.shape;
        let q_dim = n_head * head_dim;
        let bs = self.block_size;
        // Per cpu-worker: its job and what each of the job's sequences answers.
        type Building = (u32, AttnJob, Vec<(usize, usize)>, u64);
        let mut by_worker: Vec<Building> = Vec::new();
        for (pi, p) in plan.iter().enumerate() {
            for (si, sh) in p.shares.iter().enumerate() {
                let Some(w) = sh.cpu_worker else { continue };
                let idx = match by_worker.iter().position(|(x, _, _, _)| *x == w) {
                    Some(i) => i,
                    None => {
                        let job = AttnJob { layer, n_head: n_head as u32, n_kv_head: n_kv_head as u32, head_dim: head_dim as u32, kv_padding: KV_PADDING as u32, seqs: vec![] };
                        by_worker.push((w, job, vec![], 0));
                        by_worker.len() - 1
                    }
                };
                let first_block = sh.range.start / bs;
                let blocks = p.blocks[first_block..sh.range.end.div_ceil(bs)].iter().map(|b| b.1).collect();
                by_worker[idx].1.seqs.push(SeqJob {
                    start: sh.range.start as u32,
                    end: sh.range.end as u32,
                    n_ctx: p.n_ctx() as u32,
                    first_pos: (first_block * bs) as u32,
                    blocks,
                    q: q[p.row0 * q_dim..(p.row0 + 1) * q_dim].to_vec(),
                });
                by_worker[idx].2.push((pi, si));
                if layer == 0 {
                    by_worker[idx].3 += sh.range.len() as u64;
                    self.timings.cpu_attention_positions += sh.range.len() as u64;
                }
            }
        }
        let mut posted = Vec::with_capacity(by_worker.len());
        for (worker, job, members, positions) in by_worker {
            let w = self.arenas.worker_mut(worker)?;
            let need = job.slot_bytes_needed().unwrap_or(usize::MAX);
            if need > w.producer.ring().slot_bytes() {
                return Err(StepError::Invalid(format!(
                    "layer {layer}'s attention job for cpu-worker {worker} needs {need} bytes, its ring slots hold {} (raise its --slot-bytes)",
                    w.producer.ring().slot_bytes()
                )));
            }
            let mut encoded = Ok(());
            let seqno = w
                .producer
                .post(|slot| encoded = encode_job(&job, slot))
                .map_err(|e| StepError::CpuWorker { worker, what: format!("posting layer {layer}'s job: {e}") })?;
            encoded.map_err(|e| StepError::Invalid(format!("encoding layer {layer}'s job: {e}")))?;
            posted.push(Posted { worker, seqno, members, positions });
        }
        Ok(posted)
    }

    /// Decode attention of one token per item `(plan index, _, range)` over `range` of its
    /// context, straight from the arenas: every (item, KV head, chunk of the range) in one
    /// parallel loop, each KV head's query group in one pass over its rows, the chunks merged
    /// as `decode_group` merges them. Returns each item's output (`[head][head_dim]`) and the
    /// log-sum-exp of every query head.
    fn attend_in_place(&self, plan: &[Planned], layer: u32, items: &[InPlace], q: &[f32]) -> Result<Vec<Partial>, StepError> {
        let AttnShape { n_head, n_kv_head: n_kv, head_dim: hd } = self.shape;
        let group = n_head / n_kv;
        let scale = attn_scale(hd);
        let tasks = chunk_tasks(items.iter().map(|(_, _, range)| range.clone()), n_kv);
        let runs = tasks
            .iter()
            .map(|t| self.arenas.runs(&plan[items[t.item].0].blocks, layer, t.kv_head as u32, t.chunk.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        let parts: Vec<Partial> = tasks
            .par_iter()
            .zip(&runs)
            .map_init(GroupScratch::default, |scratch, (ChunkTask { item, kv_head: h, chunk }, runs)| {
                let p = &plan[items[*item].0];
                let q = &q[(p.row0 * n_head + h * group) * hd..(p.row0 * n_head + (h + 1) * group) * hd];
                let (mut o, mut l) = (vec![0f32; group * hd], vec![0f32; group]);
                decode_group(runs, chunk.clone(), padded_len(p.n_ctx(), KV_PADDING), scale, q, &mut o, &mut l, scratch);
                (o, l)
            })
            .collect();
        Ok(merge_chunk_tasks(&tasks, &parts, items.len(), n_kv, group, hd))
    }
}
