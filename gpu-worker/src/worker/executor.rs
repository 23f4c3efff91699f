//! Executes steps: a batch of sequences, each with a prefill chunk or one decode token, run
//! through the model together. Per layer the new K/V rows go into the arena slots the
//! gateway allocated, each cpu-worker gets one attention job for its share of the decode
//! tokens, the gpu-worker computes prefill attention and its own decode shares meanwhile,
//! and the partial results are merged by log-sum-exp.
//!
//! A sequence whose decode attention runs whole on one device gets bit for bit what the
//! single-process runner computes (the same kernels in the same order); split ones differ
//! only by the merge's rounding.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::time::{Duration, Instant};

use duet_common::kernels::attention::{attn_scale, causal_attention, decode_attention_range, padded_len, KvHead, KV_PADDING};
use duet_common::kernels::ops::log_softmax;
use duet_common::kernels::paged_attention::merge_partials;
use duet_common::kv::BlockId;
use duet_common::rpc::pb;
use duet_common::shm::job::{busy_ns, encode_job, read_results, AttnJob, SeqJob, SeqResult};
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::arenas::{KvArenas, KvShape};
use super::StepError;
use crate::device::cpu::{Attention, CpuModel};
use crate::error::WorkerError;
use crate::runner::top_n;
use crate::sampler::{Sampler, SamplingParams};

/// Longest wait for a cpu-worker's answer to one layer's job before it counts as failed.
pub const DEFAULT_JOB_TIMEOUT: Duration = Duration::from_secs(10);

/// What the gpu-worker keeps of a sequence between steps.
#[derive(Debug, Default)]
struct Sequence {
    /// KV blocks in position order.
    blocks: Vec<(u32, BlockId)>,
    /// The tokens at positions `0..` (for the repetition penalty).
    tokens: Vec<u32>,
    sampler: Option<Sampler>,
    top_n: usize,
}

/// One device's share of a decode token's attention.
#[derive(Debug, Clone)]
struct Share {
    cpu_worker: Option<u32>,
    range: Range<usize>,
}

/// A sequence's part of the running step.
#[derive(Debug)]
struct Planned {
    seq_id: u64,
    /// Its first row in the batch.
    row0: usize,
    /// Its rows (input tokens).
    n: usize,
    /// Position of its first row.
    start: usize,
    blocks: Vec<(u32, BlockId)>,
    /// Decode attention split by device; empty: attention over the whole context here.
    shares: Vec<Share>,
    sample: bool,
}

impl Planned {
    fn n_ctx(&self) -> usize {
        self.start + self.n
    }
}

/// The model, the attached arenas and the sequences in flight.
pub struct Executor {
    model: CpuModel,
    arenas: KvArenas,
    seqs: HashMap<u64, Sequence>,
    job_timeout: Duration,
}

impl Executor {
    pub fn new(model: CpuModel, job_timeout: Duration) -> Self {
        let c = &model.config;
        let shape = KvShape { n_layer: c.n_layer as u32, n_kv_head: c.n_kv_head as u32, head_dim: c.head_dim as u32 };
        Executor { model, arenas: KvArenas::new(shape), seqs: HashMap::new(), job_timeout }
    }

    pub fn model(&self) -> &CpuModel {
        &self.model
    }

    /// Maps a cpu-worker's arena and ring; returns its block count.
    pub fn attach(&mut self, worker: u32, arena: &str, ring: &str, pid: Option<u32>) -> Result<u32, StepError> {
        self.arenas.attach(worker, arena, ring, pid)
    }

    /// Sequences held.
    pub fn n_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Runs one step. If it fails, the gpu-worker forgets every sequence of the step (their
    /// KV may be half written): the gateway fails them or starts them again from position 0.
    pub fn step(&mut self, req: &pb::StepRequest) -> Result<pb::StepResponse, StepError> {
        let t0 = Instant::now();
        for id in &req.released {
            self.seqs.remove(id);
        }
        let result = self.run(req, t0);
        if let Err(e) = &result {
            tracing::warn!(step = req.step, "step failed: {e}");
            for s in &req.sequences {
                self.seqs.remove(&s.seq_id);
            }
        }
        result
    }

    fn run(&mut self, req: &pb::StepRequest, t0: Instant) -> Result<pb::StepResponse, StepError> {
        if req.sequences.is_empty() {
            return Ok(pb::StepResponse { sampled: vec![], timings: Some(pb::StepTimings { total_ns: ns(t0.elapsed()), ..Default::default() }) });
        }
        let bs = self.arenas.block_size().ok_or_else(|| StepError::Invalid("no cpu-worker is attached: there is no KV arena".into()))?;
        let mut seen = HashSet::new();
        let (mut plan, mut tokens, mut positions) = (Vec::new(), Vec::new(), Vec::new());
        for s in &req.sequences {
            if !seen.insert(s.seq_id) {
                return Err(StepError::Invalid(format!("sequence {} appears twice in the step", s.seq_id)));
            }
            let p = self.accept(s, bs, tokens.len())?;
            tokens.extend_from_slice(&s.tokens);
            positions.extend(p.start..p.n_ctx());
            plan.push(p);
        }
        let logit_rows: Vec<usize> = plan.iter().filter(|p| p.sample).map(|p| p.row0 + p.n - 1).collect();
        let mut timings = pb::StepTimings::default();
        for p in &plan {
            if p.shares.is_empty() && p.n > 1 {
                timings.prefill_tokens += p.n as u32;
            } else {
                timings.decode_tokens += p.n as u32;
            }
        }
        let mut attention = StepAttention {
            arenas: &mut self.arenas,
            plan: &plan,
            block_size: bs,
            n_head: self.model.config.n_head,
            job_timeout: self.job_timeout,
            timings: &mut timings,
        };
        let logits = self.model.forward_rows(&tokens, &positions, &mut attention, &logit_rows)?;

        let t_sample = Instant::now();
        let n_vocab = self.model.config.n_vocab;
        let mut sampled = Vec::with_capacity(logit_rows.len());
        for (p, row) in plan.iter().filter(|p| p.sample).zip(logits.chunks_exact(n_vocab)) {
            let seq = self.seqs.get_mut(&p.seq_id).expect("planned sequences are held");
            let sampler = seq.sampler.as_mut().expect("checked when accepted");
            let id = sampler.sample(row, &seq.tokens);
            let (logprob, top) = if seq.top_n > 0 {
                let lp = log_softmax(row);
                let top = top_n(row, seq.top_n).into_iter().map(|(id, l)| pb::TokenProb { id, logprob: l as f32 }).collect();
                (lp[id as usize] as f32, top)
            } else {
                (0.0, Vec::new())
            };
            sampled.push(pb::Sampled { seq_id: p.seq_id, token: Some(pb::TokenProb { id, logprob }), top });
        }
        timings.sample_ns = ns(t_sample.elapsed());
        timings.total_ns = ns(t0.elapsed());
        timings.linear_ns = timings
            .total_ns
            .saturating_sub(timings.kv_write_ns + timings.attention_gpu_ns + timings.attention_wait_ns + timings.merge_ns + timings.sample_ns);
        Ok(pb::StepResponse { sampled, timings: Some(timings) })
    }

    /// Checks one sequence's part of a step and applies it to the sequence's state.
    fn accept(&mut self, s: &pb::SequenceStep, bs: usize, row0: usize) -> Result<Planned, StepError> {
        let n = s.tokens.len();
        let start = s.start_pos as usize;
        let invalid = |what: String| Err(StepError::Invalid(format!("sequence {}: {what}", s.seq_id)));
        if n == 0 {
            return invalid("no input tokens".into());
        }
        let n_ctx_max = self.model.config.n_ctx_train;
        if start + n > n_ctx_max {
            return invalid(format!("{} positions exceed the context of {n_ctx_max}", start + n));
        }
        if !self.seqs.contains_key(&s.seq_id) && start != 0 {
            return Err(StepError::UnknownSequence(s.seq_id));
        }
        let seq = self.seqs.entry(s.seq_id).or_default();
        if start > seq.tokens.len() {
            return invalid(format!("start_pos {start} is past the {} positions held", seq.tokens.len()));
        }
        seq.tokens.truncate(start);
        seq.blocks.truncate(start.div_ceil(bs));
        for b in &s.new_blocks {
            self.arenas.check_block(b.worker, BlockId(b.block))?;
            seq.blocks.push((b.worker, BlockId(b.block)));
        }
        if seq.blocks.len() * bs < start + n {
            return invalid(format!("{} blocks hold {} positions, {} needed", seq.blocks.len(), seq.blocks.len() * bs, start + n));
        }
        if let Some(cfg) = &s.sampler {
            let params = SamplingParams {
                temperature: cfg.temperature,
                top_k: cfg.top_k as usize,
                top_p: cfg.top_p,
                min_p: cfg.min_p,
                repetition_penalty: cfg.repetition_penalty,
                seed: cfg.seed,
            };
            seq.sampler = Some(Sampler::new(params)?);
            seq.top_n = cfg.top_logprobs.min(20) as usize;
        }
        if s.sample && seq.sampler.is_none() {
            return invalid("asks to sample but no sampler was configured".into());
        }
        seq.tokens.extend_from_slice(&s.tokens);
        let shares = if s.attention.is_empty() {
            Vec::new()
        } else if n != 1 {
            return invalid(format!("attention shares are for single decode tokens, the step has {n}"));
        } else {
            let mut shares: Vec<Share> =
                s.attention.iter().map(|a| Share { cpu_worker: a.cpu_worker, range: a.start as usize..a.end as usize }).collect();
            shares.sort_by_key(|sh| sh.range.start);
            let mut next = 0;
            for sh in &shares {
                if sh.range.start != next || sh.range.end <= sh.range.start {
                    return invalid(format!("attention shares {:?} do not cover 0..{} once", s.attention, start + 1));
                }
                next = sh.range.end;
                if let Some(w) = sh.cpu_worker {
                    self.arenas.worker(w)?;
                    let elsewhere = seq.blocks[sh.range.start / bs..sh.range.end.div_ceil(bs)].iter().find(|b| b.0 != w);
                    if let Some(b) = elsewhere {
                        return invalid(format!("cpu-worker {w} is to attend {:?} but block {} lives on cpu-worker {}", sh.range, b.1, b.0));
                    }
                }
            }
            if next != start + 1 {
                return invalid(format!("attention shares {:?} do not cover 0..{} once", s.attention, start + 1));
            }
            shares
        };
        Ok(Planned { seq_id: s.seq_id, row0, n, start, blocks: seq.blocks.clone(), shares, sample: s.sample })
    }
}

fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

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

/// The attention of one step, layer by layer.
struct StepAttention<'a> {
    arenas: &'a mut KvArenas,
    plan: &'a [Planned],
    block_size: usize,
    n_head: usize,
    job_timeout: Duration,
    timings: &'a mut pb::StepTimings,
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

impl Attention for StepAttention<'_> {
    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) -> Result<(), WorkerError> {
        self.attend_layer(layer as u32, q, k, v, out).map_err(|e| match e {
            StepError::Model(m) => m,
            other => WorkerError::Step(other.to_string()),
        })
    }
}

impl StepAttention<'_> {
    fn attend_layer(&mut self, layer: u32, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) -> Result<(), StepError> {
        let (bs, n_head) = (self.block_size, self.n_head);
        let n_rows = self.plan.iter().map(|p| p.n).sum::<usize>();
        let q_dim = q.len() / n_rows;
        let kv_dim = k.len() / n_rows;
        let hd = q_dim / n_head;
        let n_kv = kv_dim / hd;

        let t = Instant::now();
        for p in self.plan {
            for i in 0..p.n {
                let (pos, row) = (p.start + i, p.row0 + i);
                let (w, b) = p.blocks[pos / bs];
                self.arenas.write_token(w, b, pos % bs, layer, &k[row * kv_dim..(row + 1) * kv_dim], &v[row * kv_dim..(row + 1) * kv_dim])?;
            }
        }
        self.timings.kv_write_ns += ns(t.elapsed());

        let posted = self.post_jobs(layer, q, q_dim, hd, n_kv)?;

        // The gpu-worker's own part: prefill chunks (and unsplit decode tokens) over the
        // whole context, and its decode shares.
        let t = Instant::now();
        let shape = duet_common::kernels::attention::AttnShape { n_head, n_kv_head: n_kv, head_dim: hd };
        let mut partials: Vec<Vec<(Vec<f32>, Vec<f32>)>> = self.plan.iter().map(|p| vec![Default::default(); p.shares.len()]).collect();
        let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
        for (pi, p) in self.plan.iter().enumerate() {
            if p.shares.is_empty() {
                let mut heads = Vec::with_capacity(n_kv);
                for h in 0..n_kv {
                    self.arenas.gather(&p.blocks, layer, h as u32, 0..p.n_ctx(), &mut kbuf, &mut vbuf)?;
                    heads.push((std::mem::take(&mut kbuf), std::mem::take(&mut vbuf)));
                }
                let views: Vec<KvHead<'_>> = heads.iter().map(|(k, v)| KvHead { k, v }).collect();
                if layer == 0 && p.n == 1 {
                    // An unsplit decode token: its whole context here.
                    self.timings.gpu_attention_positions += p.n_ctx() as u64;
                }
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
                partials[pi][si] = self.gpu_share(p, sh, layer, &q[p.row0 * q_dim..(p.row0 + 1) * q_dim], hd, n_kv)?;
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
        for (p, parts) in self.plan.iter().zip(&partials) {
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
    fn post_jobs(&mut self, layer: u32, q: &[f32], q_dim: usize, hd: usize, n_kv: usize) -> Result<Vec<Posted>, StepError> {
        let bs = self.block_size;
        // Per cpu-worker: its job and what each of the job's sequences answers.
        type Building = (u32, AttnJob, Vec<(usize, usize)>, u64);
        let mut by_worker: Vec<Building> = Vec::new();
        for (pi, p) in self.plan.iter().enumerate() {
            for (si, sh) in p.shares.iter().enumerate() {
                let Some(w) = sh.cpu_worker else { continue };
                let idx = match by_worker.iter().position(|(x, _, _, _)| *x == w) {
                    Some(i) => i,
                    None => {
                        let job = AttnJob { layer, n_head: self.n_head as u32, n_kv_head: n_kv as u32, head_dim: hd as u32, kv_padding: KV_PADDING as u32, seqs: vec![] };
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

    /// The gpu-worker's share of one decode token: every query head over `sh.range`.
    fn gpu_share(&self, p: &Planned, sh: &Share, layer: u32, q: &[f32], hd: usize, n_kv: usize) -> Result<(Vec<f32>, Vec<f32>), StepError> {
        let group = self.n_head / n_kv;
        let n_padded = padded_len(p.n_ctx(), KV_PADDING);
        let scale = attn_scale(hd);
        let mut out = vec![0f32; self.n_head * hd];
        let mut lse = vec![0f32; self.n_head];
        let (mut k16, mut v16) = (Vec::new(), Vec::new());
        for h in 0..n_kv {
            self.arenas.gather(&p.blocks, layer, h as u32, sh.range.clone(), &mut k16, &mut v16)?;
            let (mut k, mut v) = (vec![0f32; k16.len()], vec![0f32; v16.len()]);
            k16.convert_to_f32_slice(&mut k);
            v16.convert_to_f32_slice(&mut v);
            let heads = h * group..(h + 1) * group;
            out[heads.start * hd..heads.end * hd]
                .par_chunks_mut(hd)
                .zip(lse[heads.clone()].par_iter_mut())
                .enumerate()
                .for_each(|(g, (o, l))| {
                    let qh = &q[(heads.start + g) * hd..(heads.start + g + 1) * hd];
                    *l = decode_attention_range(qh, &k, &v, sh.range.clone(), n_padded, scale, o);
                });
        }
        Ok((out, lse))
    }
}
