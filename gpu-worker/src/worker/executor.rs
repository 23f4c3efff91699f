//! Executes steps: a batch of sequences, each with a prefill chunk or one decode token, run
//! through the model together. Per layer the new K/V rows go into the arena slots the
//! gateway allocated, each cpu-worker gets one attention job for its share of the decode
//! tokens, the gpu-worker computes prefill attention and its own decode shares meanwhile,
//! and the partial results are merged by log-sum-exp.
//!
//! A sequence whose decode attention runs whole on one device gets bit for bit what the
//! single-process runner computes (the same kernels in the same order); split ones differ
//! only by the merge's rounding.
//!
//! Structured output: a sequence with a grammar keeps an llguidance matcher here; its mask of
//! allowed tokens is computed on another thread while the step's forward pass runs, applied
//! to the logits before sampling, and the sampled token advances the matcher.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use duet_kernels::ops::log_softmax;
use duet_kv::BlockId;
use duet_model::grammar::{self, Grammar, GrammarError, Grammars};
use duet_proto::pb;
use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;
use rayon::prelude::*;

use super::arenas::KvArenas;
use super::hot_experts::HotExperts;
use super::plan::{ns, Planned, Share};
use super::step_attention::StepAttention;
use super::{SequenceError, StepError};
use crate::device::Device;
use crate::forward::run_layers;
use crate::runner::top_n_of;
use crate::sampler::{Sampler, SamplingParams};

/// Longest wait for a cpu-worker's answer to one layer's job before it counts as failed.
pub const DEFAULT_JOB_TIMEOUT: Duration = Duration::from_secs(10);

/// What the gpu-worker keeps of a sequence between steps.
#[derive(Default)]
struct Sequence {
    /// KV blocks in position order.
    blocks: Vec<(u32, BlockId)>,
    /// The tokens at positions `0..` (for the repetition penalty).
    tokens: Vec<u32>,
    sampler: Option<Sampler>,
    top_n: usize,
    /// The token its last step sampled (the input of a `feed_sampled` step).
    last_sampled: Option<u32>,
    /// Structured output: where the generation stands in its grammar.
    matcher: Option<Matcher>,
}

/// One sub-batch of a step: its sequences (rows numbered within it), tokens, positions.
#[derive(Debug, Default)]
struct SubBatch {
    plan: Vec<Planned>,
    tokens: Vec<u32>,
    positions: Vec<usize>,
}

impl SubBatch {
    /// The rows whose logits are needed, in plan order: a sampling sequence's last row, every
    /// row of one whose inputs are scored.
    fn logit_rows(&self) -> Vec<usize> {
        self.plan.iter().flat_map(|p| p.row0 + p.n - logit_rows_of(p)..p.row0 + p.n).collect()
    }

    /// Each plan's first row in the logits of [`Self::logit_rows`].
    fn logit_offsets(&self) -> Vec<usize> {
        self.plan.iter().scan(0, |at, p| Some(std::mem::replace(at, *at + logit_rows_of(p)))).collect()
    }
}

/// How many of `p`'s last rows need logits.
fn logit_rows_of(p: &Planned) -> usize {
    match (p.score, p.sample) {
        (true, _) => p.n,
        (false, true) => 1,
        (false, false) => 0,
    }
}

/// The device with the model, the attached arenas and the sequences in flight.
pub struct Executor<D: Device = crate::device::cpu::CpuDevice> {
    device: D,
    arenas: KvArenas,
    seqs: HashMap<u64, Sequence>,
    job_timeout: Duration,
    /// The vocabulary prepared for structured output (`None`: grammars are refused).
    grammars: Option<Grammars>,
    /// The plan of hot experts held on the device (`--device-experts`).
    hot: Option<HotExperts>,
    /// The device's phase times summed over recent steps, and how many (see
    /// [`Executor::log_phases`]).
    phases: (Vec<(&'static str, u64)>, u32),
    /// Benchmarks only: prompts' K/V made up, not computed (see
    /// [`Executor::with_synthetic_prefill`]).
    synthetic_prefill: bool,
}

/// Steps over which the device's phase times are summed before they are logged.
const PHASE_LOG_STEPS: u32 = 64;

impl<D: Device> Executor<D> {
    pub fn new(device: D, job_timeout: Duration) -> Result<Self, StepError> {
        let shape = device.config().kv_shape().map_err(crate::error::GpuWorkerError::Model)?;
        // Expert jobs keep the cpu-worker on every core for a millisecond or more while the
        // device waits; on shared cores neither side should spin then (`duet_kv::shm::ring`).
        let arenas = KvArenas::new(shape, device.host_layers() > 0 && !device.holds_all_experts());
        Ok(Executor { device, arenas, seqs: HashMap::new(), job_timeout, grammars: None, hot: None, phases: (Vec::new(), 0), synthetic_prefill: false })
    }

    /// Holds on the device, planned every `every` steps, the `k` experts of each layer the
    /// router chose most (see `hot_experts`; the CUDA device keeps them on the GPU, in the
    /// room `cuda::set_expert_slots` reserved). Fails unless the device is a mixture's whose
    /// experts are on the cpu-workers.
    pub fn with_hot_experts(mut self, k: usize, every: u64) -> Result<Self, StepError> {
        let c = self.device.config();
        let Some(e) = c.experts.filter(|_| !self.device.holds_all_experts()) else {
            return Err(StepError::Model(crate::error::GpuWorkerError::InvalidRequest(
                "--device-experts needs a mixture-of-experts model with its experts on the cpu-workers (--experts-on cpu-workers)".into(),
            )));
        };
        self.hot = Some(HotExperts::new(k, every, c.n_layer, e.n_expert));
        Ok(self)
    }

    /// Feeds a step's routed-token counts to the hot-expert plan and, when it is time, places
    /// the planned experts: after the step's timings are taken, so that taking experts up
    /// (repacking them) is not counted as the step's work; the next step computes with the
    /// new plan. A failure keeps the old one.
    fn plan_hot_experts(&mut self, routed: &[pb::ExpertRouted]) {
        let Some(plan) = self.hot.as_mut().and_then(|h| h.step(routed)) else { return };
        match self.device.place_experts(&plan) {
            Ok(0) => {}
            Ok(moved) => tracing::info!(moved, held = plan.iter().map(Vec::len).sum::<usize>(), "hot experts placed on the device"),
            Err(e) => tracing::warn!("hot experts not placed: {e}"),
        }
    }

    /// For benchmarks of decode at depth (`--synthetic-prefill`): of each prefill chunk only
    /// the last token is computed; the K/V rows of the others are made up
    /// ([`KvArenas::write_synthetic`]), so that sessions of 32K positions open in seconds on
    /// any device. Decode then attends real bytes of the real size, so its timings are the
    /// served system's; the text is noise.
    pub fn with_synthetic_prefill(mut self) -> Self {
        self.synthetic_prefill = true;
        self
    }

    /// Enables structured output over this vocabulary.
    pub fn with_grammars(mut self, grammars: Grammars) -> Self {
        self.grammars = Some(grammars);
        self
    }

    pub fn device(&self) -> &D {
        &self.device
    }

    /// Maps a cpu-worker's arena and ring; returns its block count.
    pub fn attach(&mut self, worker: u32, arena: &str, ring: &str, pid: Option<u32>) -> Result<u32, StepError> {
        let device = &self.device;
        // SAFETY: the arenas drop a worker's mapping before they unmap its arena.
        self.arenas.attach(worker, arena, ring, pid, |ptr, len| unsafe { device.map_host(ptr, len) })
    }

    /// Sequences held.
    pub fn n_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Runs one step. If it fails, the gpu-worker forgets every sequence of the step (their
    /// KV may be half written): the gateway fails them or starts them again from position 0.
    /// A sequence that could not sample (its grammar) is forgotten alone, named in the
    /// response's `failed`.
    pub fn step(&mut self, req: &pb::StepRequest) -> Result<pb::StepResponse, StepError> {
        let t0 = Instant::now();
        for id in &req.released {
            self.seqs.remove(id);
        }
        self.device.release(&req.released);
        let result = self.run(req, t0);
        if let Ok(pb::StepResponse { timings: Some(t), .. }) = &result {
            self.plan_hot_experts(&t.expert_routed);
        }
        if let Ok(resp) = &result {
            // Those that could not sample are forgotten: the gateway fails their requests.
            let failed: Vec<u64> = resp.failed.iter().map(|f| f.seq_id).collect();
            if !failed.is_empty() {
                tracing::info!(step = req.step, ?failed, "sequences could not sample: {}", resp.failed[0].reason);
                failed.iter().for_each(|id| drop(self.seqs.remove(id)));
                self.device.release(&failed);
            }
        }
        self.log_phases();
        if let Err(e) = &result {
            tracing::warn!(step = req.step, "step failed: {e}");
            for s in &req.sequences {
                self.seqs.remove(&s.seq_id);
            }
            self.device.release(&req.sequences.iter().map(|s| s.seq_id).collect::<Vec<_>>());
        }
        result
    }

    fn run(&mut self, req: &pb::StepRequest, t0: Instant) -> Result<pb::StepResponse, StepError> {
        if req.sequences.is_empty() {
            return Ok(pb::StepResponse { timings: Some(pb::StepTimings { total_ns: ns(t0.elapsed()), ..Default::default() }), ..Default::default() });
        }
        let bs = self.arenas.block_size().ok_or(StepError::NoArena)?;
        let mut seen = HashSet::new();
        let mut subs: [SubBatch; 2] = Default::default();
        // Request order: (sub-batch, index in its plan).
        let mut order = Vec::with_capacity(req.sequences.len());
        for s in &req.sequences {
            if !seen.insert(s.seq_id) {
                return Err(StepError::DuplicateSequence(s.seq_id));
            }
            if s.sub_batch > 1 {
                return Err(StepError::Sequence { seq_id: s.seq_id, problem: SequenceError::SubBatch(s.sub_batch) });
            }
            let sub = &mut subs[s.sub_batch as usize];
            let Some(p) = self.accept(s, bs, req.after_step != 0)? else {
                tracing::debug!(step = req.step, seq = s.seq_id, "sequence skipped: the step before failed and took it, or it failed there alone");
                continue;
            };
            order.push((s.sub_batch as usize, sub.plan.len()));
            sub.plan.push(p);
        }
        if subs.iter().all(|s| s.plan.is_empty()) {
            return Ok(pb::StepResponse { timings: Some(pb::StepTimings { total_ns: ns(t0.elapsed()), ..Default::default() }), ..Default::default() });
        }
        // Every slot the step writes is one row's: a block the new rows of two sequences (or
        // two places of one sequence's list) land in would have two rows write one slot, and
        // the rows are written in parallel.
        let mut written = HashSet::new();
        for p in subs.iter().flat_map(|s| &s.plan) {
            for &(worker, block) in p.blocks.get(p.start / bs..(p.start + p.n).div_ceil(bs)).unwrap_or_default() {
                if !written.insert((worker, block)) {
                    return Err(StepError::SharedBlock { worker, block });
                }
            }
        }
        // Counted as asked (a synthetic prefill's chunk too: its step is no decode step).
        let mut timings = pb::StepTimings::default();
        for p in subs.iter().flat_map(|s| &s.plan) {
            if p.shares.is_empty() && p.n > 1 {
                timings.prefill_tokens += p.n as u32;
            } else {
                timings.decode_tokens += p.n as u32;
            }
        }
        // Each sub-batch's rows: its sequences' tokens in plan order (a synthetic prefill's
        // chunk first reduced to its last token).
        for sub in &mut subs {
            for p in &mut sub.plan {
                if self.synthetic_prefill && p.shares.is_empty() && p.n > 1 {
                    self.arenas.write_synthetic(&p.blocks, p.start..p.n_ctx() - 1)?;
                    p.start = p.n_ctx() - 1;
                    p.n = 1;
                }
                p.row0 = sub.tokens.len();
                sub.tokens.extend_from_slice(&self.seqs[&p.seq_id].tokens[p.start..p.n_ctx()]);
                sub.positions.extend(p.start..p.n_ctx());
            }
        }
        let on_device: Vec<(u64, usize)> = subs.iter().flat_map(|s| &s.plan).map(|p| (p.seq_id, p.device_end())).collect();
        self.device.begin_step(&on_device);
        // The non-empty sub-batches, each started on the device; two interleave their layers.
        let used: Vec<usize> = (0..2).filter(|&k| !subs[k].plan.is_empty()).collect();
        let mut batches = Vec::with_capacity(used.len());
        for &k in &used {
            batches.push(self.device.start_batch(&subs[k].tokens, &subs[k].positions, &subs[k].logit_rows())?);
        }
        timings.sub_batches = used.len() as u32;
        let plans: Vec<&[Planned]> = used.iter().map(|&k| subs[k].plan.as_slice()).collect();
        let (shape, job_timeout) = (crate::device::attn_shape(self.device.config()), self.job_timeout);
        let (device, arenas, step_timings) = (&self.device, &mut self.arenas, &mut timings);
        // The constrained sequences' masks, on another thread while the layers run.
        let constrained: Vec<(u64, Matcher)> = subs
            .iter()
            .flat_map(|s| &s.plan)
            .filter(|p| p.sample)
            .filter_map(|p| self.seqs.get_mut(&p.seq_id)?.matcher.take().map(|m| (p.seq_id, m)))
            .collect();
        let (forward, masked) = std::thread::scope(|scope| {
            let masking = (!constrained.is_empty()).then(|| scope.spawn(move || masks(constrained)));
            // A layer's expert jobs may take every slot of a cpu-worker's ring, so none may be
            // left to the other sub-batch's attention jobs: with experts on the cpu-workers the
            // sub-batches run one after the other instead of interleaved.
            let forward = if plans.len() > 1 && !device.holds_all_experts() {
                batches.iter_mut().zip(&plans).try_for_each(|(batch, &plan)| {
                    let mut attention = StepAttention { plans: vec![plan], arenas: &mut *arenas, block_size: bs, shape, job_timeout, timings: &mut *step_timings };
                    run_layers(device, std::slice::from_mut(batch), &mut attention)
                })
            } else {
                let mut attention = StepAttention { plans: plans.clone(), arenas, block_size: bs, shape, job_timeout, timings: step_timings };
                run_layers(device, &mut batches, &mut attention)
            };
            (forward, masking.map(|h| h.join()))
        });
        // A sequence whose grammar allows no token fails alone (it samples nothing); the
        // step goes on for the others.
        let mut step_masks: HashMap<u64, SimpleVob> = HashMap::new();
        let mut failed: Vec<pb::FailedSequence> = Vec::new();
        for (id, m, mask) in masked.transpose().map_err(|_| StepError::MaskThread)?.into_iter().flatten() {
            self.seqs.get_mut(&id).expect("held").matcher = Some(m);
            match mask {
                Ok(mask) => drop(step_masks.insert(id, mask)),
                Err(e) => failed.push(pb::FailedSequence { seq_id: id, reason: e.to_string() }),
            }
        }
        forward?;
        // Greedy rows whose logits nothing else needs (no grammar, no log-probabilities)
        // take their tokens from the device, which may find them without handing the logits
        // over; the others sample from the logits.
        let scoring = subs.iter().flat_map(|s| &s.plan).any(|p| p.score);
        let plain_greedy = !scoring && subs.iter().flat_map(|s| &s.plan).filter(|p| p.sample).all(|p| {
            let seq = &self.seqs[&p.seq_id];
            seq.sampler.as_ref().is_some_and(Sampler::is_plain_greedy) && seq.matcher.is_none() && seq.top_n == 0
        });
        let mut device_tokens: Option<[Vec<u32>; 2]> = None;
        if plain_greedy {
            let mut got: [Vec<u32>; 2] = Default::default();
            let mut all = true;
            for (batch, &k) in batches.iter().zip(&used) {
                match self.device.greedy_tokens(batch)? {
                    Some(ids) => got[k] = ids,
                    None => {
                        all = false;
                        break;
                    }
                }
            }
            device_tokens = all.then_some(got);
        }
        let mut logits: [Vec<f32>; 2] = Default::default();
        if device_tokens.is_none() {
            for (batch, &k) in batches.iter().zip(&used) {
                logits[k] = self.device.logits(batch)?;
            }
        }
        // The attention of layers computed wholly on the device, timed on the GPU: the
        // balancer learns the GPU's attention cost from it (else it would count as linear).
        // A failed query loses the figure, not the step.
        let host_timed_attention = timings.attention_gpu_ns;
        match self.device.take_attention_ns() {
            Ok(ns) => timings.attention_gpu_ns += ns.unwrap_or(0),
            Err(e) => tracing::warn!("the device's attention time: {e}"),
        }
        // The rows its KV copy lacked, brought in (the balancer must not read them as a cost
        // per position: a step after the plan changed uploaded 2M rows in 0.58 s, the next
        // ones attended the same positions in 18 ms). Those of its attention calls are in the
        // attention the host timed; the rest (layers wholly on the device) in the linear
        // layers' remainder.
        match self.device.take_kv_upload_time() {
            Ok(up) => {
                timings.gpu_kv_upload_ns = up.total_ns;
                timings.attention_gpu_ns -= up.in_attention_calls_ns.min(host_timed_attention);
            }
            Err(e) => tracing::warn!("the device's KV upload time: {e}"),
        }

        let t_sample = Instant::now();
        // Each sampled sequence with its sub-batch and its logit row there (the device's
        // greedy tokens: its index among the sampled rows), in request order.
        let offsets = [subs[0].logit_offsets(), subs[1].logit_offsets()];
        let mut next_sampled = [0usize; 2];
        let sampled_rows: Vec<(&Planned, usize, usize)> = order
            .iter()
            .filter(|&&(k, i)| subs[k].plan[i].sample)
            .map(|&(k, i)| {
                let p = &subs[k].plan[i];
                next_sampled[k] += 1;
                let row = if device_tokens.is_some() { next_sampled[k] - 1 } else { offsets[k][i] + logit_rows_of(p) - 1 };
                (p, k, row)
            })
            .collect();
        if let Some(tokens) = device_tokens {
            let mut sampled = Vec::with_capacity(sampled_rows.len());
            for (p, k, r) in sampled_rows {
                let id = tokens[k][r];
                self.seqs.get_mut(&p.seq_id).expect("planned sequences are held").last_sampled = Some(id);
                sampled.push(pb::Sampled { seq_id: p.seq_id, token: Some(pb::TokenProb { id, logprob: 0.0 }), top: Vec::new() });
            }
            return Ok(self.finish_step(sampled, Vec::new(), failed, timings, t_sample, t0));
        }
        let n_vocab = self.device.config().n_vocab;
        let scored: Vec<pb::ScoredPrompt> = order
            .iter()
            .filter(|&&(k, i)| subs[k].plan[i].score)
            .map(|&(k, i)| {
                let p = &subs[k].plan[i];
                let inputs = &subs[k].tokens[p.row0..p.row0 + p.n];
                let rows = &logits[k][offsets[k][i] * n_vocab..(offsets[k][i] + p.n) * n_vocab];
                pb::ScoredPrompt { seq_id: p.seq_id, tokens: score_inputs(rows, n_vocab, &inputs[1..], p.next_token, self.seqs[&p.seq_id].top_n) }
            })
            .collect();
        let rows: Vec<(&Planned, &[f32])> = sampled_rows
            .into_iter()
            .filter(|(p, _, _)| !failed.iter().any(|f| f.seq_id == p.seq_id))
            .map(|(p, k, r)| (p, &logits[k][r * n_vocab..(r + 1) * n_vocab]))
            .collect();
        // Rows sample in parallel: each sequence's sampler, grammar and history are its own
        // (a step names a sequence once), and a large vocabulary's filters take a while.
        let wanted: HashSet<u64> = rows.iter().map(|(p, _)| p.seq_id).collect();
        let mut states: HashMap<u64, &mut Sequence> = self.seqs.iter_mut().filter(|(id, _)| wanted.contains(id)).map(|(&id, s)| (id, s)).collect();
        let work: Vec<(&Planned, &[f32], &mut Sequence)> =
            rows.into_iter().map(|(p, row)| (p, row, states.remove(&p.seq_id).expect("planned sequences are held, once each"))).collect();
        let outcomes: Vec<Result<pb::Sampled, pb::FailedSequence>> = work
            .into_par_iter()
            .map(|(p, row, seq)| sample_row(p, row, seq, step_masks.get(&p.seq_id)).map_err(|e| pb::FailedSequence { seq_id: p.seq_id, reason: e.to_string() }))
            .collect();
        let mut sampled = Vec::with_capacity(outcomes.len());
        for o in outcomes {
            match o {
                Ok(s) => sampled.push(s),
                Err(f) => failed.push(f),
            }
        }
        Ok(self.finish_step(sampled, scored, failed, timings, t_sample, t0))
    }

    /// The step's response: its sampled tokens, its scored prompts, the sequences that could
    /// not sample, and its timings, closed.
    fn finish_step(
        &self,
        sampled: Vec<pb::Sampled>,
        prompt_logprobs: Vec<pb::ScoredPrompt>,
        failed: Vec<pb::FailedSequence>,
        mut timings: pb::StepTimings,
        t_sample: Instant,
        t0: Instant,
    ) -> pb::StepResponse {
        timings.sample_ns = ns(t_sample.elapsed());
        timings.expert_routed = self
            .device
            .take_expert_usage()
            .into_iter()
            .map(|r| pb::ExpertRouted { layer: r.layer, expert: r.expert, tokens: r.tokens })
            .collect();
        timings.total_ns = ns(t0.elapsed());
        timings.linear_ns = timings
            .total_ns
            .saturating_sub(timings.kv_write_ns + timings.attention_gpu_ns + timings.attention_wait_ns + timings.merge_ns + timings.sample_ns + timings.gpu_kv_upload_ns);
        pb::StepResponse { sampled, timings: Some(timings), prompt_logprobs, failed }
    }

    /// Sums the device's phase times (the CUDA device's: where its calls' time goes) and logs
    /// them, in milliseconds per step, every [`PHASE_LOG_STEPS`] steps at debug level
    /// (`duet_gpu_worker::worker=debug`).
    fn log_phases(&mut self) {
        let now = self.device.phase_times();
        if now.is_empty() {
            return;
        }
        let (sums, steps) = &mut self.phases;
        if sums.is_empty() {
            *sums = now;
        } else {
            sums.iter_mut().zip(now).for_each(|(s, n)| s.1 += n.1);
        }
        *steps += 1;
        if *steps == PHASE_LOG_STEPS {
            let per_step: Vec<String> = sums.iter().map(|(name, ns)| format!("{name}={:.2}", *ns as f64 / 1e6 / PHASE_LOG_STEPS as f64)).collect();
            tracing::debug!(steps = PHASE_LOG_STEPS, "device ms per step: {}", per_step.join(" "));
            *sums = Vec::new();
            *steps = 0;
        }
    }

    /// Checks one sequence's part of a step and applies it to the sequence's state. With
    /// `skip_unknown` (the step was sent while the one before ran), a sequence that goes on
    /// from a position the gpu-worker does not hold is skipped (`None`): the step before
    /// failed and took it (or it could not sample there), and the gateway has failed its
    /// request; failing this whole step would take the requests that joined it too.
    fn accept(&mut self, s: &pb::SequenceStep, bs: usize, skip_unknown: bool) -> Result<Option<Planned>, StepError> {
        let start = s.start_pos as usize;
        let invalid = |problem: SequenceError| Err(StepError::Sequence { seq_id: s.seq_id, problem });
        // Held tokens: the sequence is taken up from the arenas (its positions 0..start are in
        // the blocks `new_blocks` lists, every one of them), known here or not.
        let taken_up = !s.held_tokens.is_empty() && s.held_tokens.len() == start;
        if !self.seqs.contains_key(&s.seq_id) && start != 0 && !taken_up {
            if skip_unknown {
                return Ok(None);
            }
            return Err(StepError::UnknownSequence(s.seq_id));
        }
        let tokens: Vec<u32> = match (s.feed_sampled, self.seqs.get(&s.seq_id)) {
            (false, _) => s.tokens.clone(),
            (true, _) if !s.tokens.is_empty() => return invalid(SequenceError::FeedsAndHasTokens),
            (true, Some(Sequence { last_sampled: Some(t), .. })) => vec![*t],
            (true, _) => return invalid(SequenceError::NothingSampled),
        };
        let n = tokens.len();
        if n == 0 {
            return invalid(SequenceError::NoTokens);
        }
        let n_ctx_max = self.device.config().n_ctx_train;
        if start + n > n_ctx_max {
            return invalid(SequenceError::PastContext { positions: start + n, n_ctx: n_ctx_max });
        }
        let seq = self.seqs.entry(s.seq_id).or_default();
        if taken_up {
            seq.tokens.clone_from(&s.held_tokens);
            seq.blocks.clear();
        }
        if start > seq.tokens.len() {
            return invalid(SequenceError::StartPastHeld { start, held: seq.tokens.len() });
        }
        seq.tokens.truncate(start);
        seq.blocks.truncate(start.div_ceil(bs));
        for b in &s.new_blocks {
            self.arenas.check_block(b.worker, BlockId(b.block))?;
            seq.blocks.push((b.worker, BlockId(b.block)));
        }
        if seq.blocks.len() * bs < start + n {
            return invalid(SequenceError::TooFewBlocks { blocks: seq.blocks.len(), holds: seq.blocks.len() * bs, needed: start + n });
        }
        if let Some(cfg) = &s.sampler {
            let params = SamplingParams {
                temperature: cfg.temperature,
                top_k: cfg.top_k as usize,
                top_p: cfg.top_p,
                min_p: cfg.min_p,
                repetition_penalty: cfg.repetition_penalty,
                frequency_penalty: cfg.frequency_penalty,
                presence_penalty: cfg.presence_penalty,
                seed: cfg.seed,
            };
            seq.sampler = Some(Sampler::new(params)?.with_logit_bias(cfg.logit_bias.iter().map(|(&id, &b)| (id, b)))?);
            seq.top_n = cfg.top_logprobs.min(20) as usize;
            seq.matcher = match cfg.constraint.as_ref().map(Grammar::try_from).transpose() {
                Err(e) => return invalid(e.into()),
                Ok(None) => None,
                Ok(Some(g)) => match self.grammars.as_ref().map(|gs| gs.matcher(&g)) {
                    None => return invalid(SequenceError::NoGrammars),
                    Some(Err(e)) => return invalid(e.into()),
                    Some(Ok(m)) => Some(m),
                },
            };
        }
        if s.sample && seq.sampler.is_none() {
            return invalid(SequenceError::NoSampler);
        }
        seq.tokens.extend(tokens);
        seq.last_sampled = None;
        let shares = if s.attention.is_empty() {
            Vec::new()
        } else if n != 1 {
            return invalid(SequenceError::SharesNotDecode(n));
        } else {
            let mut shares: Vec<Share> =
                s.attention.iter().map(|a| Share { cpu_worker: a.cpu_worker, range: a.start as usize..a.end as usize }).collect();
            shares.sort_by_key(|sh| sh.range.start);
            let uncovered = |shares: &[Share]| SequenceError::SharesUncovered { shares: shares.iter().map(|sh| sh.range.clone()).collect(), n_ctx: start + 1 };
            let mut next = 0;
            for sh in &shares {
                if sh.range.start != next || sh.range.end <= sh.range.start {
                    return invalid(uncovered(&shares));
                }
                next = sh.range.end;
                if let Some(w) = sh.cpu_worker {
                    self.arenas.worker(w)?;
                    let elsewhere = seq.blocks[sh.range.start / bs..sh.range.end.div_ceil(bs)].iter().find(|b| b.0 != w);
                    if let Some(b) = elsewhere {
                        return invalid(SequenceError::ShareElsewhere { worker: w, range: sh.range.clone(), block: b.1, owner: b.0 });
                    }
                }
            }
            if next != start + 1 {
                return invalid(uncovered(&shares));
            }
            shares
        };
        let score = s.prompt_logprobs;
        Ok(Some(Planned { seq_id: s.seq_id, row0: 0, n, start, blocks: seq.blocks.clone(), shares, sample: s.sample, score, next_token: s.next_prompt_token.filter(|_| score) }))
    }
}

/// The next-token masks of `matchers`, each with its matcher back.
fn masks(matchers: Vec<(u64, Matcher)>) -> Vec<(u64, Matcher, Result<SimpleVob, grammar::GrammarError>)> {
    matchers
        .into_iter()
        .map(|(id, mut m)| {
            let mask = grammar::allowed(&mut m);
            (id, m, mask)
        })
        .collect()
}

/// The log-probabilities of `next` (each row's following token: the inputs after the first,
/// then `last` after the last row where given) under `rows` (`n_vocab` logits each, untempered
/// and unmasked), each with the `n_top` most likely tokens; rows in parallel.
fn score_inputs(rows: &[f32], n_vocab: usize, next: &[u32], last: Option<u32>, n_top: usize) -> Vec<pb::ScoredToken> {
    let next: Vec<u32> = next.iter().copied().chain(last).collect();
    rows.par_chunks(n_vocab)
        .zip(&next)
        .map(|(row, &id)| {
            let (token, top) = scored(row, id, n_top);
            pb::ScoredToken { token: Some(token), top }
        })
        .collect()
}

/// Token `id`'s log-probability under logits `row` and the `n_top` most likely tokens there,
/// from one log-softmax of the row.
fn scored(row: &[f32], id: u32, n_top: usize) -> (pb::TokenProb, Vec<pb::TokenProb>) {
    let lp = log_softmax(row);
    let top = top_n_of(&lp, n_top).into_iter().map(|(id, l)| pb::TokenProb { id, logprob: l as f32 }).collect();
    (pb::TokenProb { id, logprob: lp.get(id as usize).copied().unwrap_or(f64::NEG_INFINITY) as f32 }, top)
}

/// Samples one sequence's next token from its logits row (its grammar's mask applied), and
/// advances its grammar.
fn sample_row(p: &Planned, row: &[f32], seq: &mut Sequence, mask: Option<&SimpleVob>) -> Result<pb::Sampled, GrammarError> {
    let masked_row;
    let row = match mask {
        Some(mask) => {
            let mut r = row.to_vec();
            grammar::apply_mask(mask, &mut r);
            masked_row = r;
            &masked_row[..]
        }
        None => row,
    };
    let sampler = seq.sampler.as_mut().expect("checked when accepted");
    let id = sampler.sample(row, &seq.tokens);
    // Once the grammar is complete only end of generation was allowed: nothing to follow.
    if let Some(m) = seq.matcher.as_mut().filter(|m| !m.is_stopped()) {
        grammar::consume(m, id)?;
    }
    seq.last_sampled = Some(id);
    let (token, top) = if seq.top_n > 0 { scored(row, id, seq.top_n) } else { (pb::TokenProb { id, logprob: 0.0 }, Vec::new()) };
    Ok(pb::Sampled { seq_id: p.seq_id, token: Some(token), top })
}
