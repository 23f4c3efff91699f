//! One step of the scheduler: the batch (every running sequence's decode token, then prompt
//! chunks while the token budget lasts), its KV blocks and attention shares, the gpu-worker
//! call (sent while the step before runs), and what the sampled tokens do to each request.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long admissions wait after a step could not reach the gpu-worker (the supervisor's
/// watch looks every 250 ms).
const GPU_FAILURE_PAUSE: Duration = Duration::from_secs(2);

use duet_kv::{BlockTable, KvError, Placement, WorkerId, GPU_KV_PAGE};
use duet_model::chat::ChatMessage;
use duet_proto::pb;

use super::Scheduler;
use crate::request::{Event, ScoredToken, StopReason};
use crate::error::GatewayError;
use crate::metrics;
use crate::balancer::planner::{Plan, SeqDemand, Share};
use crate::balancer::stats::{prefill_pairs as prefill_pairs_of, Prediction};
use crate::sequence::{attention_demand, share_gpu_kv, shares_to_proto, Seq};

/// A step sent to the gpu-worker whose results are not applied yet.
pub(super) struct InFlight {
    step: u64,
    entries: Vec<Entry>,
    /// The planner's prediction.
    predicted: Prediction,
    /// Whether the step has decode tokens (whose timings refine the cost fits).
    decodes: bool,
    /// The (row, position) pairs its prompt chunks attend (`balancer::stats::prefill_pairs`).
    prefill_pairs: u64,
    call: tokio::task::JoinHandle<Result<pb::StepResponse, tonic::Status>>,
}

impl InFlight {
    /// Stops waiting for the result (the gpu-worker is gone).
    pub(super) fn abort(self) {
        self.call.abort();
    }
}

/// One sequence's part of a step.
struct Entry {
    /// The sequence ([`Seq::serial`]).
    serial: u64,
    /// Input tokens.
    n: usize,
    /// The input is the token the step before samples.
    fed_sampled: bool,
    sample: bool,
}

impl Scheduler {
    /// Builds the next step and sends it to the gpu-worker (to run after the step in flight,
    /// if any). Sequences in the step in flight take part with what that step leaves them:
    /// the next prompt chunk, or a decode token fed with the token it samples, unless that
    /// token is certainly their last. `None` if there is nothing to send.
    pub(super) fn send_step(&mut self) -> Option<InFlight> {
        let mut budget = self.cfg.max_step_tokens;
        let mut entries: Vec<Entry> = Vec::new();
        let mut steps = Vec::new();
        let mut failed: Vec<(u64, GatewayError)> = Vec::new();
        // Decode sequences: (index in `steps`, what the planner needs).
        let mut decoding: Vec<(usize, SeqDemand)> = Vec::new();
        // Positions of the GPU's KV mirror the step's prompt chunks take (their attention
        // runs there over their whole prefix, which stays after the prefill).
        let mut prompt_mirror = 0;
        let mut prefill_pairs = 0;
        let mut scored_rows = 0;
        // Decode tokens first (they are what users wait on), then prompt chunks in arrival order.
        let order: Vec<usize> = {
            let (dec, pre): (Vec<usize>, Vec<usize>) = (0..self.running.len()).partition(|&i| self.running[i].decoding());
            dec.into_iter().chain(pre).collect()
        };
        for i in order {
            let seq = &self.running[i];
            // KV on a cpu-worker that is down: the request waits for it.
            if self.workers_down(&seq.table).next().is_some() {
                continue;
            }
            let fed_sampled = seq.samples_in_flight > 0;
            let n = if fed_sampled {
                if !seq.continues_after_in_flight(self.cfg.n_ctx) {
                    continue;
                }
                1
            } else if seq.decoding() {
                1
            } else {
                (seq.pending.len() - seq.queued).min(self.cfg.prefill_chunk)
            };
            if n > budget || (!fed_sampled && seq.queued + n > seq.pending.len()) || n == 0 {
                continue;
            }
            // A scored prompt chunk has the logits of every row computed and sent back (a
            // vocabulary's worth of floats a row): one chunk's worth a step, at most.
            let prompt_logprobs = seq.prompt_logprobs && !fed_sampled && !seq.decoding();
            if prompt_logprobs && scored_rows + n > self.cfg.prefill_chunk {
                continue;
            }
            let start = seq.table.len();
            if let Err(e) = self.allocate(i, n) {
                // With a cpu-worker down, its blocks come back with it: wait rather than fail.
                if self.worker_up.iter().all(|&up| up) {
                    failed.push((self.running[i].serial, GatewayError::ResourceExhausted(format!("no KV block left for the request: {e}"))));
                }
                continue;
            }
            budget -= n;
            let seq = &mut self.running[i];
            let new_blocks = seq.table.blocks()[seq.sent_blocks..]
                .iter()
                .map(|&(WorkerId(worker), b)| pb::KvBlockRef { worker, block: b.0 })
                .collect();
            seq.sent_blocks = seq.table.blocks().len();
            let sampler = (!seq.sampler_sent).then(|| seq.sampler_config());
            seq.sampler_sent = true;
            // Resumed: it runs again (a request that merely waits for step budget is not paused).
            seq.paused_since = None;
            let held_tokens = if std::mem::take(&mut seq.restore) && start > 0 { seq.kv_tokens[..start.min(seq.kv_tokens.len())].to_vec() } else { Vec::new() };
            let footprint = (start + n).next_multiple_of(GPU_KV_PAGE);
            if n == 1 {
                decoding.push((steps.len(), attention_demand(&seq.table, start)));
            } else {
                prefill_pairs += prefill_pairs_of(start, n);
                if prompt_mirror + footprint <= self.cfg.gpu_kv_positions {
                    // (A prompt longer than the mirror is attended on the host: it takes none.)
                    prompt_mirror += footprint;
                }
            }
            let tokens = if fed_sampled { Vec::new() } else { seq.pending[seq.queued..seq.queued + n].to_vec() };
            let sample = fed_sampled || seq.queued + n == seq.pending.len();
            // A prompt chunk scored: its inputs, and the token after it where the prompt goes on.
            if prompt_logprobs {
                scored_rows += n;
            }
            let next_prompt_token = seq.pending.get(seq.queued + n).copied().filter(|_| prompt_logprobs);
            if !fed_sampled {
                seq.queued += n;
            }
            if sample {
                seq.samples_in_flight += 1;
            }
            steps.push(pb::SequenceStep {
                seq_id: seq.id,
                start_pos: start as u32,
                tokens,
                new_blocks,
                sampler,
                sample,
                attention: Vec::new(),
                sub_batch: 0,
                feed_sampled: fed_sampled,
                held_tokens,
                prompt_logprobs,
                next_prompt_token,
            });
            entries.push(Entry { serial: seq.serial, n, fed_sampled, sample });
        }
        if !failed.is_empty() {
            let outcomes = failed.into_iter().filter_map(|(serial, e)| Some((self.index_of(serial)?, Err(e)))).collect();
            self.conclude(outcomes);
        }
        if steps.is_empty() && self.released.is_empty() {
            return None;
        }
        let tokens: usize = entries.iter().map(|e| e.n).sum();
        let mut demands: Vec<SeqDemand> = decoding.iter().map(|(_, d)| d.clone()).collect();
        if self.cfg.gpu_kv_positions > 0 {
            share_gpu_kv(&mut demands, self.cfg.gpu_kv_positions.saturating_sub(prompt_mirror), self.cfg.block_size);
        }
        // Overlap only decode-only steps: a prompt chunk's linear layers dwarf the rest.
        let may_overlap = decoding.len() == steps.len();
        let plan = self.policy.plan(&self.stats.cost_model(tokens, prefill_pairs), tokens, &demands, self.cfg.block_size, may_overlap, self.cfg.overlap);
        for ((at, d), shares) in decoding.iter().zip(&plan.shares) {
            steps[*at].attention = shares_to_proto(shares, d.n_ctx);
        }
        if plan.overlap {
            for (at, sub) in sub_batches(&plan) {
                steps[decoding[at].0].sub_batch = sub;
            }
        }
        self.step += 1;
        if self.step.is_multiple_of(64) && !decoding.is_empty() {
            tracing::debug!(step = self.step, policy = %self.policy, cost = ?self.stats.cost_model(tokens, prefill_pairs), predicted_s = plan.predicted_s, gpu_positions = plan.gpu_positions, cpu_positions = ?plan.cpu_positions, "balancer");
        }
        let req = pb::StepRequest {
            step: self.step,
            sequences: steps,
            released: std::mem::take(&mut self.released),
            after_step: self.in_flight.back().map_or(0, |f| f.step),
        };
        let call = tokio::spawn(self.gpu.step(req));
        let predicted = Prediction { seconds: plan.predicted_s, warm: self.stats.warm_for(tokens, plan.overlap, plan.gpu_positions, &plan.cpu_positions, prefill_pairs) };
        Some(InFlight { step: self.step, entries, predicted, decodes: !decoding.is_empty(), prefill_pairs, call })
    }

    /// The index in `running` of the sequence with this serial, if it still runs.
    fn index_of(&self, serial: u64) -> Option<usize> {
        self.running.iter().position(|s| s.serial == serial)
    }

    /// Waits for a step's results and applies them to its sequences that still run.
    pub(super) async fn finish_step(&mut self, f: InFlight) {
        let result = match f.call.await {
            Ok(r) => r,
            Err(e) => Err(tonic::Status::unavailable(format!("the step's call failed: {e}"))),
        };
        let found: Vec<(usize, Entry)> = f.entries.into_iter().filter_map(|e| Some((self.index_of(e.serial)?, e))).collect();
        let mut outcomes: Vec<(usize, Result<StopReason, GatewayError>)> = Vec::new();
        match result {
            Ok(resp)
                if found.iter().any(|(i, e)| {
                    let id = self.running[*i].id;
                    e.sample && !resp.sampled.iter().any(|s| s.seq_id == id) && !resp.failed.iter().any(|s| s.seq_id == id)
                }) =>
            {
                // A sequence that should have sampled was skipped: the gpu-worker does not know
                // it, so it restarted before the watch saw it (the step reached the new process).
                tracing::warn!(step = f.step, "the gpu-worker no longer knows sequences of the step: it restarted");
                self.gpu_lost_sequences();
                return;
            }
            Ok(resp) => {
                if let Some(t) = &resp.timings {
                    self.stats.observe(t, f.decodes.then_some(f.predicted), f.prefill_pairs);
                    metrics::step(t, f.predicted.seconds, self.stats.prediction_error());
                    tracing::debug!(step = f.step, total_us = t.total_ns / 1000, predicted_us = (f.predicted.seconds * 1e6) as u64, warm = f.predicted.warm, prefill = t.prefill_tokens, decode = t.decode_tokens, sub_batches = t.sub_batches, linear_us = t.linear_ns / 1000, gpu_attn_us = t.attention_gpu_ns / 1000, kv_upload_us = t.gpu_kv_upload_ns / 1000, wait_us = t.attention_wait_ns / 1000, kv_write_us = t.kv_write_ns / 1000, merge_us = t.merge_ns / 1000, sample_us = t.sample_ns / 1000, experts_wait_us = t.experts_wait_ns / 1000, experts_busy_us = t.cpu_workers.iter().map(|w| w.experts_busy_ns).sum::<u64>() / 1000, "step");
                }
                let sampled: HashMap<u64, pb::Sampled> = resp.sampled.into_iter().map(|s| (s.seq_id, s)).collect();
                let mut scored: HashMap<u64, pb::ScoredPrompt> = resp.prompt_logprobs.into_iter().map(|p| (p.seq_id, p)).collect();
                let mut failed: HashMap<u64, String> = resp.failed.into_iter().map(|f| (f.seq_id, f.reason)).collect();
                for (i, e) in found {
                    let seq = &self.running[i];
                    if let Some(reason) = failed.remove(&seq.id) {
                        // Its output constraint allowed no token (or refused the one drawn): it
                        // fails alone, and the gpu-worker has forgotten it.
                        outcomes.push((i, Err(GatewayError::InvalidArgument(format!("structured output: {reason}")))));
                        continue;
                    }
                    if let Some(p) = scored.remove(&seq.id).filter(|_| seq.prompt_logprobs && !e.fed_sampled) {
                        let tokens = p
                            .tokens
                            .into_iter()
                            .map(|t| {
                                let (id, logprob) = t.token.map_or((0, f32::NEG_INFINITY), |t| (t.id, t.logprob));
                                ScoredToken { id, logprob, top: t.top.into_iter().map(|t| (t.id, t.logprob)).collect() }
                            })
                            .collect();
                        let _ = seq.events.send(Ok(Event::PromptLogprobs { tokens }));
                    }
                    if let Some(outcome) = self.apply(i, &e, sampled.get(&self.running[i].id)) {
                        outcomes.push((i, outcome));
                    }
                }
            }
            Err(status) => {
                let err = match status.code() {
                    tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
                        self.gpu_pause_until = Some(Instant::now() + GPU_FAILURE_PAUSE);
                        GatewayError::Unavailable(format!("the step failed: {}", status.message()))
                    }
                    _ => GatewayError::Internal(format!("the gpu-worker refused a step: {}", status.message())),
                };
                tracing::warn!(step = f.step, "step failed: {}", status.message());
                if status.code() == tonic::Code::FailedPrecondition && status.message().contains("is unknown to the gpu-worker") {
                    // The step reached a gpu-worker that restarted before the watch saw it.
                    self.gpu_lost_sequences();
                    return;
                }
                if matches!(err, GatewayError::Unavailable(_)) {
                    // A worker failed: the requests go on from their applied steps once it
                    // is back (the watch says which, and whether their KV was kept).
                    self.rewind_all(&format!("a step failed ({})", status.message()));
                    return;
                }
                // The gpu-worker refused the step: its sequences fail.
                outcomes.extend(found.into_iter().map(|(i, _)| (i, Err(err.clone()))));
            }
        }
        self.conclude(outcomes);
    }

    /// Extends sequence `i`'s table by `n` positions. A sequence stays on the cpu-worker
    /// that holds its last block while it has room (one job per layer, no merge, its KV on
    /// one NUMA node); a new one goes to the serving cpu-worker with the least predicted
    /// attention work among those that hold all its blocks (the balancer's placement), else
    /// the one with the most free blocks; failing all, block by block.
    fn allocate(&mut self, i: usize, n: usize) -> Result<(), KvError> {
        let bs = self.cfg.block_size;
        let table = &self.running[i].table;
        let wanted = (table.len() + n).div_ceil(bs) - table.blocks().len();
        let up = &self.worker_up;
        let serving = || (0..self.pool.n_workers()).filter(|&w| up[w]).map(|w| WorkerId(w as u32));
        let home = table.blocks().last().map(|b| b.0).filter(|&w| up[w.0 as usize]);
        let choice = match home {
            _ if wanted == 0 => home.or_else(|| serving().next()),
            Some(w) if self.pool.n_free(w) >= wanted => Some(w),
            _ => {
                // Predicted attention work per worker: the KV positions of running sequences
                // it holds, at its fitted cost per position.
                // Only the attention costs are read: any batch size will do.
                let cost = self.stats.cost_model(1, 0);
                let mut work = vec![0f64; self.pool.n_workers()];
                for seq in &self.running {
                    for (WorkerId(w), r) in seq.table.token_ranges_per_worker() {
                        work[w as usize] += r.len() as f64 * cost.cpu_attn_per_pos.get(w as usize).copied().unwrap_or(0.0);
                    }
                }
                serving()
                    .filter(|&w| self.pool.n_free(w) >= wanted)
                    .min_by(|a, b| work[a.0 as usize].total_cmp(&work[b.0 as usize]).then(self.pool.n_free(*b).cmp(&self.pool.n_free(*a))))
            }
        };
        let table: &mut BlockTable = &mut self.running[i].table;
        if let Some(w) = choice {
            return table.append_tokens(n, Placement::Worker(w));
        }
        let most_free = |pool: &duet_kv::KvPool| {
            (0..pool.n_workers()).filter(|&w| up[w]).max_by_key(|&w| (pool.n_free(WorkerId(w as u32)), std::cmp::Reverse(w))).map(|w| WorkerId(w as u32))
        };
        let mut left = n;
        while left > 0 {
            let room = table.blocks().len() * bs - table.len();
            let take = if room > 0 { room.min(left) } else { bs.min(left) };
            let w = most_free(&self.pool).ok_or(KvError::OutOfBlocks { wanted: 1, free: 0 })?;
            table.append_tokens(take, Placement::Worker(w))?;
            left -= take;
        }
        Ok(())
    }

    /// Applies a step's result to sequence `i` (its inputs fed, maybe a sampled token);
    /// returns why it ends, if it does.
    fn apply(&mut self, i: usize, e: &Entry, sampled: Option<&pb::Sampled>) -> Option<Result<StopReason, GatewayError>> {
        let eog = &self.text.tokenizer.end_of_generation;
        let seq = &mut self.running[i];
        let n = e.n;
        if e.sample {
            seq.samples_in_flight -= 1;
        }
        if !e.fed_sampled {
            seq.queued -= n;
        }
        if seq.pending.len() < n || (e.sample && sampled.is_none()) {
            return Some(Err(GatewayError::Internal(format!("the gpu-worker returned no token for sequence {}", seq.id))));
        }
        let fed: Vec<u32> = seq.pending.drain(..n).collect();
        seq.kv_tokens.extend(fed);
        if self.cfg.prefix_cache {
            seq.table.register_full(&seq.kv_tokens);
        }
        if seq.generated.is_empty() {
            seq.prefilled += n as u32;
            self.prefilled_total += n as u64;
            metrics::tokens_prefilled(n);
        }
        let s = sampled.filter(|_| e.sample)?;
        let token = s.token.as_ref().map_or(0, |t| t.id);
        seq.generated.push(token);
        self.generated_total += 1;
        metrics::token_generated();
        seq.first_token.get_or_insert_with(Instant::now);
        seq.pending = vec![token];
        // The end-of-generation token ends the text; its own text ("<|im_end|>") is not output.
        let ends = eog.contains(&token) && !seq.ignore_eos;
        let text = if ends { String::new() } else { seq.text.push(self.text.tokenizer.token_bytes(token).unwrap_or(&[])) };
        seq.output.push_str(&text);
        let (logprob, top) = if seq.top_logprobs > 0 {
            (s.token.as_ref().map(|t| t.logprob), s.top.iter().map(|t| (t.id, t.logprob)).collect())
        } else {
            (None, Vec::new())
        };
        let _ = seq.events.send(Ok(Event::Token { id: token, text, logprob, top }));
        let reason = if ends {
            StopReason::EndOfGeneration
        } else if seq.text.stopped() {
            StopReason::StopString
        } else if seq.generated.len() >= seq.max_tokens as usize {
            StopReason::MaxTokens
        } else if seq.kv_tokens.len() + 1 >= self.cfg.n_ctx {
            StopReason::ContextFull
        } else {
            return None;
        };
        Some(Ok(reason))
    }

    /// Ends the sequences that finished or failed: events, sessions, KV.
    pub(super) fn conclude(&mut self, mut outcomes: Vec<(usize, Result<StopReason, GatewayError>)>) {
        outcomes.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        // The requests' KV goes back (and the gauges say so) before their clients hear the
        // end: a client that reads /metrics after its last event finds its KV freed.
        let mut ends = Vec::with_capacity(outcomes.len());
        for (i, outcome) in outcomes {
            let mut seq = self.running.swap_remove(i);
            let events = seq.events.clone();
            match outcome {
                Ok(reason) => {
                    let ev = seq.finished(reason);
                    if let Event::Finished { text, usage, .. } = &ev {
                        seq.output.push_str(text);
                        metrics::request_finished(reason, usage);
                    }
                    self.keep_or_release(seq);
                    ends.push((events, Ok(ev)));
                }
                Err(e) => {
                    metrics::request_failed(false);
                    self.return_session(seq);
                    ends.push((events, Err(e)));
                }
            }
        }
        self.publish_metrics();
        for (events, end) in ends {
            let _ = events.send(end);
        }
    }

    /// A failed request's session goes back to the state the request found it in (its KV up
    /// to `resume_from`, which earlier turns wrote and nothing of this request touched), so a
    /// client may retry the turn; without a session the KV goes back to the pool.
    pub(super) fn return_session(&mut self, mut seq: Seq) {
        let session = seq.session.as_ref().and_then(|(name, _)| self.sessions.get_mut(name)).filter(|s| s.table.is_none());
        let Some(session) = session else {
            self.released.push(seq.id);
            return;
        };
        let kept = seq.table.truncate(seq.resume_from);
        seq.kv_tokens.truncate(kept);
        session.table = Some(seq.table);
        session.kv_tokens = seq.kv_tokens;
        session.last_used = Instant::now();
        session.take_up = true;
    }

    /// A finished request's KV goes back to its session, or to the pool.
    fn keep_or_release(&mut self, seq: Seq) {
        let Some((name, mut messages)) = seq.session else {
            self.released.push(seq.id);
            return;
        };
        let Some(session) = self.sessions.get_mut(&name) else {
            self.released.push(seq.id);
            return;
        };
        if !messages.is_empty() {
            messages.push(ChatMessage::new("assistant", seq.output));
        }
        let mut history = seq.kv_tokens.clone();
        history.extend(seq.pending.last());
        session.table = Some(seq.table);
        session.kv_tokens = seq.kv_tokens;
        session.history = history;
        session.messages = messages;
        session.last_used = Instant::now();
    }
}

/// Splits an overlapped plan's sequences into two sub-batches of equal work: the heaviest
/// cpu-worker share first, each to the sub-batch with less cpu-worker work so far (the
/// gpu-worker's own work breaking ties). Returns (index in the plan, sub-batch).
fn sub_batches(plan: &Plan) -> Vec<(usize, u32)> {
    let work = |shares: &[Share]| -> (usize, usize) {
        shares.iter().fold((0, 0), |(c, g), s| if s.cpu_worker.is_some() { (c + s.range.len(), g) } else { (c, g + s.range.len()) })
    };
    let mut order: Vec<(usize, (usize, usize))> = plan.shares.iter().map(|s| work(s)).enumerate().collect();
    order.sort_by_key(|&(i, (c, g))| (std::cmp::Reverse(c), std::cmp::Reverse(g), i));
    let mut load = [(0usize, 0usize, 0usize); 2];
    let mut out = Vec::with_capacity(order.len());
    for (i, (c, g)) in order {
        let sub = if (load[0].0, load[0].1, load[0].2) <= (load[1].0, load[1].1, load[1].2) { 0 } else { 1 };
        load[sub] = (load[sub].0 + c, load[sub].1 + g, load[sub].2 + 1);
        out.push((i, sub as u32));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_batches_share_the_work_evenly() {
        let share = |w: Option<u32>, n: usize| Share { cpu_worker: w, range: 0..n };
        let plan = Plan {
            shares: vec![
                vec![share(Some(0), 300)],
                vec![share(Some(0), 100)],
                vec![share(Some(0), 200)],
                vec![share(None, 50)],
                vec![share(Some(0), 200)],
            ],
            predicted_s: 0.0,
            overlap: true,
            gpu_positions: 50,
            cpu_positions: vec![800],
        };
        let subs = sub_batches(&plan);
        assert_eq!(subs.len(), 5);
        let cpu = |k: u32| subs.iter().filter(|&&(_, s)| s == k).map(|&(i, _)| plan.shares[i].iter().map(|s| s.range.len()).sum::<usize>()).sum::<usize>();
        assert_eq!(cpu(0) + cpu(1), 850);
        assert!(cpu(0).abs_diff(cpu(1)) <= 100, "{subs:?}");
        assert!(subs.iter().any(|&(_, s)| s == 0) && subs.iter().any(|&(_, s)| s == 1));
    }
}
