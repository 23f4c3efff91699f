//! One step of the scheduler: the batch (every running sequence's decode token, then prompt
//! chunks while the token budget lasts), its KV blocks and attention shares, the gpu-worker
//! call, and what the sampled tokens do to each request.

use std::collections::HashMap;
use std::time::Instant;

use duet_common::kv::{BlockTable, KvError, Placement, WorkerId};
use duet_common::model::chat::ChatMessage;
use duet_common::rpc::pb;

use super::Scheduler;
use crate::backend::{Event, StopReason};
use crate::error::GatewayError;
use crate::metrics;
use crate::balancer::planner::{Plan, SeqDemand, Share};
use crate::sequence::{attention_demand, shares_to_proto, Seq};

impl Scheduler {
    /// Builds a step, runs it on the gpu-worker and applies the results.
    pub(super) async fn run_step(&mut self) {
        let mut budget = self.cfg.max_step_tokens;
        let mut entries: Vec<(usize, usize)> = Vec::new();
        let mut steps = Vec::new();
        let mut failed: Vec<(usize, GatewayError)> = Vec::new();
        // Decode sequences: (index in `steps`, what the planner needs).
        let mut decoding: Vec<(usize, SeqDemand)> = Vec::new();
        // Decode tokens first (they are what users wait on), then prompt chunks in arrival order.
        let order: Vec<usize> = {
            let (dec, pre): (Vec<usize>, Vec<usize>) = (0..self.running.len()).partition(|&i| !self.running[i].generated.is_empty());
            dec.into_iter().chain(pre).collect()
        };
        for i in order {
            let decode = !self.running[i].generated.is_empty();
            let n = if decode { 1 } else { self.running[i].pending.len().min(self.cfg.prefill_chunk) };
            if n > budget {
                continue;
            }
            let start = self.running[i].table.len();
            if let Err(e) = self.allocate(i, n) {
                failed.push((i, GatewayError::ResourceExhausted(format!("no KV block left for the request: {e}"))));
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
            if n == 1 {
                decoding.push((steps.len(), attention_demand(&seq.table, start)));
            }
            steps.push(pb::SequenceStep {
                seq_id: seq.id,
                start_pos: start as u32,
                tokens: seq.pending[..n].to_vec(),
                new_blocks,
                sampler,
                sample: n == seq.pending.len(),
                attention: Vec::new(),
                sub_batch: 0,
            });
            entries.push((i, n));
        }
        let tokens: usize = entries.iter().map(|&(_, n)| n).sum();
        let demands: Vec<SeqDemand> = decoding.iter().map(|(_, d)| d.clone()).collect();
        // Overlap only decode-only steps: a prompt chunk's linear layers dwarf the rest.
        let may_overlap = decoding.len() == steps.len();
        let plan = self.policy.plan(&self.stats.cost_model(), tokens, &demands, self.cfg.block_size, may_overlap, self.cfg.overlap);
        for ((at, d), shares) in decoding.iter().zip(&plan.shares) {
            steps[*at].attention = shares_to_proto(shares, d.n_ctx);
        }
        if plan.overlap {
            for (at, sub) in sub_batches(&plan) {
                steps[decoding[at].0].sub_batch = sub;
            }
        }
        self.step += 1;
        let req = pb::StepRequest { step: self.step, sequences: steps, released: std::mem::take(&mut self.released) };
        let mut outcomes: Vec<(usize, Result<StopReason, GatewayError>)> = failed.into_iter().map(|(i, e)| (i, Err(e))).collect();
        match self.gpu.step(req).await {
            Ok(resp) => {
                let resp = resp.into_inner();
                if let Some(t) = &resp.timings {
                    self.stats.observe(t, (!decoding.is_empty()).then_some(plan.predicted_s));
                    if self.step.is_multiple_of(64) {
                        tracing::debug!(step = self.step, policy = %self.policy, cost = ?self.stats.cost_model(), predicted_s = plan.predicted_s, measured_s = t.total_ns as f64 * 1e-9, gpu_positions = plan.gpu_positions, cpu_positions = ?plan.cpu_positions, "balancer");
                    }
                    metrics::step(t, plan.predicted_s, self.stats.prediction_error());
                    tracing::debug!(step = self.step, total_us = t.total_ns / 1000, prefill = t.prefill_tokens, decode = t.decode_tokens, wait_us = t.attention_wait_ns / 1000, "step");
                }
                let sampled: HashMap<u64, pb::Sampled> = resp.sampled.into_iter().map(|s| (s.seq_id, s)).collect();
                for (i, n) in entries {
                    if let Some(reason) = self.apply(i, n, sampled.get(&self.running[i].id)) {
                        outcomes.push((i, Ok(reason)));
                    }
                }
            }
            Err(status) => {
                let err = match status.code() {
                    tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
                        GatewayError::Unavailable(format!("the step failed: {}", status.message()))
                    }
                    _ => GatewayError::Internal(format!("the gpu-worker refused a step: {}", status.message())),
                };
                tracing::warn!(step = self.step, "step failed: {}", status.message());
                // The gpu-worker forgot the step's sequences; they fail.
                outcomes.extend(entries.into_iter().map(|(i, _)| (i, Err(err.clone()))));
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
                let cost = self.stats.cost_model();
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
        let most_free = |pool: &duet_common::kv::KvPool| {
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

    /// Applies a step's result to sequence `i` (`n` inputs fed, maybe a sampled token);
    /// returns why it ends, if it does.
    fn apply(&mut self, i: usize, n: usize, sampled: Option<&pb::Sampled>) -> Option<StopReason> {
        let eog = &self.text.tokenizer.end_of_generation;
        let seq = &mut self.running[i];
        let fed: Vec<u32> = seq.pending.drain(..n).collect();
        seq.kv_tokens.extend(fed);
        if seq.generated.is_empty() {
            seq.prefilled += n as u32;
            self.prefilled_total += n as u64;
            metrics::tokens_prefilled(n);
        }
        let s = sampled?;
        let token = s.token.as_ref().map_or(0, |t| t.id);
        seq.generated.push(token);
        self.generated_total += 1;
        metrics::token_generated();
        seq.first_token.get_or_insert_with(Instant::now);
        seq.pending = vec![token];
        let text = seq.text.push(self.text.tokenizer.token_bytes(token).unwrap_or(&[]));
        seq.output.push_str(&text);
        let (logprob, top) = if seq.top_logprobs > 0 {
            (s.token.as_ref().map(|t| t.logprob), s.top.iter().map(|t| (t.id, t.logprob)).collect())
        } else {
            (None, Vec::new())
        };
        let _ = seq.events.send(Ok(Event::Token { id: token, text, logprob, top }));
        if eog.contains(&token) && !seq.ignore_eos {
            Some(StopReason::EndOfGeneration)
        } else if seq.text.stopped() {
            Some(StopReason::StopString)
        } else if seq.generated.len() >= seq.max_tokens as usize {
            Some(StopReason::MaxTokens)
        } else if seq.kv_tokens.len() + 1 >= self.cfg.n_ctx {
            Some(StopReason::ContextFull)
        } else {
            None
        }
    }

    /// Ends the sequences that finished or failed: events, sessions, KV.
    fn conclude(&mut self, mut outcomes: Vec<(usize, Result<StopReason, GatewayError>)>) {
        outcomes.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, outcome) in outcomes {
            let mut seq = self.running.swap_remove(i);
            match outcome {
                Ok(reason) => {
                    let ev = seq.finished(reason);
                    if let Event::Finished { text, usage, .. } = &ev {
                        seq.output.push_str(text);
                        metrics::request_finished(reason, usage);
                    }
                    let _ = seq.events.send(Ok(ev));
                    self.keep_or_release(seq);
                }
                Err(e) => {
                    metrics::request_failed(false);
                    let _ = seq.events.send(Err(e));
                    if let Some((name, _)) = &seq.session {
                        self.sessions.remove(name);
                    }
                    self.released.push(seq.id);
                }
            }
        }
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
