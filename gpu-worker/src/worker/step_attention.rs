//! The attention of a step on the gpu-worker: per layer, the device stores the batch's new
//! K/V rows into the arena slots the gateway allocated, each cpu-worker with shares gets one
//! job, the device computes prefill attention and its own decode shares meanwhile, and the
//! partial results are merged by log-sum-exp. Split into begin (store, post) and finish (own
//! part, wait, merge) so that the layer loop (`crate::forward`) can interleave two
//! sub-batches' layers.

use std::ops::Range;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use duet_kernels::attention::{windowed, AttnShape, KvRun, KV_PADDING};
use duet_kernels::decode_batch::merge_heads;
use duet_proto::pb;
use duet_kv::shm::job::{busy_ns, encode_job, read_results, AttnJob, SeqJob, SeqResult};

use super::arenas::KvArenas;
use super::plan::{ns, worker_timing, Planned};
use super::StepError;
use crate::device::{DecodeItem, Device, InPlaceRow, KvAccessError, KvSink, KvSource, NoRemoteExperts, Partial, PrefillItem, Qkv};
use super::step_experts::StepExperts;
use crate::forward::LayerAttention;

/// The attention of one step, layer by layer, for one batch or two sub-batches whose layers
/// interleave (`plans[sub]`): [`LayerAttention::begin`] stores a layer's new K/V rows and
/// posts the cpu-workers' jobs, [`LayerAttention::finish`] computes the device's own part,
/// waits for the jobs and merges.
pub(super) struct StepAttention<'a> {
    pub plans: Vec<&'a [Planned]>,
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

/// The arena slots of a (sub-)batch's rows: row `r` is position `start + (r - row0)` of the
/// plan entry holding it.
struct PlanSlots<'s> {
    arenas: &'s KvArenas,
    plan: &'s [Planned],
    block_size: usize,
}

impl PlanSlots<'_> {
    /// The plan entry holding batch row `row`, and the row's position.
    fn entry(&self, row: usize) -> Option<(&Planned, usize)> {
        let p = self.plan.get(self.plan.partition_point(|p| p.row0 + p.n <= row)).filter(|p| p.row0 <= row)?;
        Some((p, p.start + (row - p.row0)))
    }

    /// Row `row`'s K and V of `layer` into its slots.
    fn write_row(&self, layer: usize, row: usize, k: &[f32], v: &[f32]) -> Result<(), KvAccessError> {
        let (p, pos) = self.entry(row).ok_or(KvAccessError::NoRow { row })?;
        let (w, b) = *p.blocks.get(pos / self.block_size).ok_or(KvAccessError::NoBlock { position: pos })?;
        self.arenas.write_token(w, b, pos % self.block_size, layer as u32, k, v)
    }
}

/// Rows a batch must have for its K/V to be stored in parallel (a row is a few microseconds).
const PARALLEL_WRITE_ROWS: usize = 16;
/// Split rows a step must have for their partial attention results to be merged in parallel.
const PARALLEL_MERGE_ROWS: usize = 16;

impl KvSink for PlanSlots<'_> {
    fn write(&mut self, layer: usize, row: usize, k: &[f32], v: &[f32]) -> Result<(), KvAccessError> {
        self.write_row(layer, row, k, v)
    }

    /// In parallel from [`PARALLEL_WRITE_ROWS`] rows: each row's slots are its own (the plan
    /// gives each position to one sequence).
    fn write_rows(&mut self, layer: usize, kv_dim: usize, k: &[f32], v: &[f32]) -> Result<(), KvAccessError> {
        let rows = k.chunks_exact(kv_dim).zip(v.chunks_exact(kv_dim));
        if k.len() < PARALLEL_WRITE_ROWS * kv_dim {
            return rows.enumerate().try_for_each(|(row, (k, v))| self.write_row(layer, row, k, v));
        }
        let this = &*self;
        k.par_chunks_exact(kv_dim).zip(v.par_chunks_exact(kv_dim)).enumerate().try_for_each(|(row, (k, v))| this.write_row(layer, row, k, v))
    }

    fn position_of(&self, row: usize) -> Option<(u64, usize)> {
        self.entry(row).map(|(p, pos)| (p.seq_id, pos))
    }

    fn in_place(&self, row: usize) -> Option<InPlaceRow> {
        let (p, pos) = self.entry(row)?;
        let (w, b) = *p.blocks.get(pos / self.block_size)?;
        self.arenas.in_place(w, b, pos % self.block_size)
    }
}

/// The KV of a (sub-)batch's sequences, by plan index, read in place from the arenas.
impl KvSource for PlanSlots<'_> {
    fn runs(&self, seq: usize, layer: usize, kv_head: usize, range: Range<usize>) -> Result<Vec<KvRun<'_>>, KvAccessError> {
        self.arenas.runs(&self.plan[seq].blocks, layer as u32, kv_head as u32, range)
    }

    fn seq_key(&self, seq: usize) -> Option<u64> {
        self.plan.get(seq).map(|p| p.seq_id)
    }

    fn in_place_at(&self, seq: usize, pos: usize) -> Option<InPlaceRow> {
        let (w, b) = *self.plan.get(seq)?.blocks.get(pos / self.block_size)?;
        self.arenas.in_place(w, b, pos % self.block_size)
    }
}

impl<D: Device + ?Sized> LayerAttention<D> for StepAttention<'_> {
    type Begun = Begun;
    type Error = StepError;

    /// The whole layer on the device when no cpu-worker shares the sub-batch's attention and
    /// the device holds every routed expert it needs (an expert job would need the arenas'
    /// rings while the device reads their KV).
    fn on_device(&mut self, device: &D, sub: usize, layer: usize, batch: &mut D::Batch) -> Result<bool, StepError> {
        let plan = self.plans[sub];
        if plan.iter().any(|p| !p.shares.is_empty()) || !device.holds_all_experts() {
            return Ok(false);
        }
        let items: Vec<PrefillItem> = plan.iter().enumerate().map(|(pi, p)| PrefillItem { seq: pi, row0: p.row0, n: p.n, start: p.start }).collect();
        let mut kv = PlanSlots { arenas: self.arenas, plan, block_size: self.block_size };
        if !device.layer_on_device(layer, batch, &items, &mut kv, &mut NoRemoteExperts)? {
            return Ok(false);
        }
        if layer == 0 {
            self.timings.gpu_attention_positions += plan.iter().filter(|p| p.n == 1).map(|p| p.n_ctx() as u64).sum::<u64>();
        }
        // The layer's attention time comes from the device after the step
        // (`Device::take_attention_ns`), timed on the GPU.
        Ok(true)
    }

    /// Writes layer `layer`'s new K/V rows of sub-batch `sub` into the arenas and posts one
    /// job per cpu-worker with shares.
    fn begin(&mut self, device: &D, sub: usize, layer: usize, qkv: &Qkv) -> Result<Begun, StepError> {
        let plan = self.plans[sub];
        let t = Instant::now();
        device.store_kv(layer, qkv, &mut PlanSlots { arenas: self.arenas, plan, block_size: self.block_size })?;
        self.timings.kv_write_ns += ns(t.elapsed());
        let posted = self.post_jobs(plan, layer as u32, device.config().window(layer), &qkv.q)?;
        Ok(Begun { posted })
    }

    /// The rest of the layer on the device, the routed experts it does not hold sent to the
    /// cpu-workers as expert jobs (only ever in a step of one sub-batch: see the executor).
    fn finish_layer(&mut self, device: &D, layer: usize, batch: &mut D::Batch, attn: &[f32]) -> Result<(), StepError> {
        let c = device.config();
        let n_expert = c.experts.map_or(0, |e| e.n_expert as u32);
        let mut remote = StepExperts::new(&mut *self.arenas, n_expert, c.n_embd, self.job_timeout, &mut *self.timings);
        Ok(device.finish_layer(layer, batch, attn, &mut remote)?)
    }

    /// The device's own part of a begun layer (prefill chunks, unsplit decode tokens, its
    /// decode shares), then the cpu-workers' results, merged by log-sum-exp into `out`.
    fn finish(&mut self, device: &D, sub: usize, layer: usize, begun: Begun, qkv: &Qkv, out: &mut [f32]) -> Result<(), StepError> {
        let plan = self.plans[sub];
        let Begun { posted } = begun;
        let layer = layer as u32;
        let hd = self.shape.head_dim;
        let q_dim = self.shape.n_head * hd;
        let t = Instant::now();
        // A share the layer's sliding window cuts away entirely counts as nothing; the others
        // are filled in below.
        let nothing: Partial = (vec![0.0; q_dim], vec![f32::NEG_INFINITY; self.shape.n_head]);
        let mut partials: Vec<Vec<Partial>> = plan.iter().map(|p| vec![nothing.clone(); p.shares.len()]).collect();
        // The device's own part: prefill chunks over their whole context, and decode read in
        // place — unsplit tokens over their whole context (`None`) and the device's shares.
        let (mut prefill, mut decode, mut decode_of) = (Vec::new(), Vec::new(), Vec::new());
        for (pi, p) in plan.iter().enumerate() {
            if p.shares.is_empty() && p.n > 1 {
                prefill.push(PrefillItem { seq: pi, row0: p.row0, n: p.n, start: p.start });
                continue;
            }
            if p.shares.is_empty() {
                if layer == 0 {
                    self.timings.gpu_attention_positions += p.n_ctx() as u64;
                }
                decode.push(DecodeItem { seq: pi, row: p.row0, range: 0..p.n_ctx(), n_ctx: p.n_ctx() });
                decode_of.push((pi, None));
                continue;
            }
            for (si, sh) in p.shares.iter().enumerate().filter(|(_, sh)| sh.cpu_worker.is_none()) {
                if layer == 0 {
                    self.timings.gpu_attention_positions += sh.range.len() as u64;
                }
                decode.push(DecodeItem { seq: pi, row: p.row0, range: sh.range.clone(), n_ctx: p.n_ctx() });
                decode_of.push((pi, Some(si)));
            }
        }
        let kv = PlanSlots { arenas: self.arenas, plan, block_size: self.block_size };
        if !prefill.is_empty() {
            device.prefill_attention(layer as usize, qkv, &prefill, &kv, out)?;
        }
        let results = if decode.is_empty() { Vec::new() } else { device.decode_attention(layer as usize, qkv, &decode, &kv)? };
        for ((pi, share), (o, l)) in decode_of.into_iter().zip(results) {
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
            let results = match w.wait_answer(job.seqno, self.job_timeout) {
                Ok(()) => {
                    let slot = w.producer.wait_done_timeout(job.seqno, Duration::ZERO).map_err(|e| fail(e.to_string()))?;
                    busy = busy_ns(slot);
                    read_results(slot).map_err(|e| fail(e.to_string()))
                }
                Err(e) => Err(fail(e)),
            };
            let t = worker_timing(self.timings, worker);
            t.busy_ns += busy;
            t.positions += job.positions;
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
        // Each split row's heads merged from its parts straight into its row of `out` (decode
        // rows: one row each), the rows in parallel when there are many.
        let mut parts_of: Vec<Option<&Vec<Partial>>> = vec![None; out.len() / q_dim];
        for (p, parts) in plan.iter().zip(&partials).filter(|(p, _)| !p.shares.is_empty()) {
            parts_of[p.row0] = Some(parts);
        }
        let merge_row = |(o, parts): (&mut [f32], &Option<&Vec<Partial>>)| {
            if let Some(parts) = parts {
                merge_heads(parts, o, None);
            }
        };
        if parts_of.iter().flatten().count() >= PARALLEL_MERGE_ROWS {
            out.par_chunks_mut(q_dim).zip(&parts_of).for_each(merge_row);
        } else {
            out.chunks_mut(q_dim).zip(&parts_of).for_each(merge_row);
        }
        self.timings.merge_ns += ns(t.elapsed());
        Ok(())
    }
}

impl StepAttention<'_> {
    /// Posts one attention job per cpu-worker that has shares in this step.
    /// A sliding-window layer's shares are cut to the window; a share wholly before it is not
    /// posted (`finish` counts it as nothing).
    fn post_jobs(&mut self, plan: &[Planned], layer: u32, window: Option<usize>, q: &[f32]) -> Result<Vec<Posted>, StepError> {
        let AttnShape { n_head, n_kv_head, head_dim, softcap } = self.shape;
        let q_dim = n_head * head_dim;
        let bs = self.block_size;
        // Per cpu-worker: its job and what each of the job's sequences answers.
        type Building = (u32, AttnJob, Vec<(usize, usize)>, u64);
        let mut by_worker: Vec<Building> = Vec::new();
        for (pi, p) in plan.iter().enumerate() {
            for (si, sh) in p.shares.iter().enumerate() {
                let Some(w) = sh.cpu_worker else { continue };
                let range = windowed(sh.range.clone(), p.n_ctx(), window);
                if range.is_empty() {
                    continue;
                }
                let idx = match by_worker.iter().position(|(x, _, _, _)| *x == w) {
                    Some(i) => i,
                    None => {
                        let job = AttnJob { layer, n_head: n_head as u32, n_kv_head: n_kv_head as u32, head_dim: head_dim as u32, kv_padding: KV_PADDING as u32, softcap, seqs: vec![] };
                        by_worker.push((w, job, vec![], 0));
                        by_worker.len() - 1
                    }
                };
                let first_block = range.start / bs;
                let blocks = p.blocks[first_block..range.end.div_ceil(bs)].iter().map(|b| b.1).collect();
                by_worker[idx].1.seqs.push(SeqJob {
                    start: range.start as u32,
                    end: range.end as u32,
                    n_ctx: p.n_ctx() as u32,
                    first_pos: (first_block * bs) as u32,
                    blocks,
                    q: q[p.row0 * q_dim..(p.row0 + 1) * q_dim].to_vec(),
                });
                by_worker[idx].2.push((pi, si));
                if layer == 0 {
                    by_worker[idx].3 += range.len() as u64;
                    self.timings.cpu_attention_positions += range.len() as u64;
                }
            }
        }
        let mut posted = Vec::with_capacity(by_worker.len());
        for (worker, job, members, positions) in by_worker {
            let w = self.arenas.worker_mut(worker)?;
            let need = job.slot_bytes_needed().unwrap_or(usize::MAX);
            if need > w.producer.ring().slot_bytes() {
                return Err(StepError::JobTooLarge { layer, worker, need, slot_bytes: w.producer.ring().slot_bytes() });
            }
            let mut encoded = Ok(());
            let seqno = w
                .producer
                .post(|slot| encoded = encode_job(&job, slot))
                .map_err(|e| StepError::CpuWorker { worker, what: format!("posting layer {layer}'s job: {e}") })?;
            encoded.map_err(|source| StepError::JobEncoding { layer, source })?;
            posted.push(Posted { worker, seqno, members, positions });
        }
        Ok(posted)
    }
}
