//! Admission: which waiting requests start, with what KV — their session's, the longest
//! cached prefix of their prompt, or none — once their blocks fit, evicting idle sessions
//! when they do not; a prompt whose blocks a running request is computing waits for them.

use std::time::Instant;

use super::{Scheduler, SessionUse, Waiting};
use crate::error::GatewayError;
use crate::metrics;
use crate::request::{Event, DEFAULT_MAX_TOKENS};
use crate::sequence::{common_prefix, Events, Seq, Session};
use crate::text_stream::TextStream;

/// What became of a waiting request [`Scheduler::try_admit`] took.
enum Admission {
    Admitted,
    /// It waits until blocks are free (and holds up those behind it).
    KvFull(Waiting),
    /// It waits until a running request has computed the prompt's blocks it shares.
    PrefixBeingComputed(Waiting),
}

impl Scheduler {
    /// Starts waiting requests, in order, while they fit; one whose prompt's blocks a running
    /// request is computing waits for them without holding up those behind it.
    pub(super) fn admit(&mut self) {
        self.kv_full = false;
        let mut deferred = Vec::new();
        while self.running.len() < self.cfg.max_running {
            let Some(w) = self.waiting.pop_front() else { break };
            match self.try_admit(w) {
                Ok(Admission::Admitted) => {}
                Ok(Admission::KvFull(w)) => {
                    self.waiting.push_front(w);
                    self.kv_full = true;
                    break;
                }
                Ok(Admission::PrefixBeingComputed(w)) => deferred.push(w),
                Err((events, e)) => {
                    metrics::request_failed(false);
                    let _ = events.send(Err(e));
                }
            }
        }
        for w in deferred.into_iter().rev() {
            self.waiting.push_front(w);
        }
    }

    /// Whether a running request is computing whole blocks of `prompt` past the `cached` first
    /// positions, which it will soon have cached: a prompt sharing them waits for them rather
    /// than computing them again (a prompt's `n` choices; clients sending one system prompt
    /// at once).
    fn prefix_being_computed(&self, prompt: &[u32], cached: usize) -> bool {
        let whole = |n: usize| n.min(prompt.len() - 1) / self.cfg.block_size * self.cfg.block_size;
        self.running.iter().filter(|s| s.generated.is_empty() && s.paused_since.is_none()).any(|s| {
            let shared = common_prefix(&s.kv_tokens, prompt);
            let shared = if shared < s.kv_tokens.len() { shared } else { shared + common_prefix(&s.pending, &prompt[shared..]) };
            whole(shared) > cached && s.kv_tokens.len() < whole(shared)
        })
    }

    /// Admits `w`, or gives it back if it must wait, or fails it.
    fn try_admit(&mut self, mut w: Waiting) -> Result<Admission, (Events, GatewayError)> {
        let fail = |w: Waiting, e| Err((w.events, e));
        let bs = self.cfg.block_size;
        // The conversation's tokens, and what is cached of them.
        let (full, session, messages) = match self.resolve(&w.params, w.prompt_ids.take()) {
            Ok(x) => x,
            Err(e) => return fail(w, e),
        };
        // Kept for the next try if it waits.
        let wait = |mut w: Waiting, full: &[u32]| {
            w.prompt_ids = Some(full.to_vec());
            w
        };
        if full.is_empty() {
            // (A text that tokenises to nothing, on a model with no BOS token.)
            return fail(w, GatewayError::InvalidArgument("the prompt is empty once tokenised".into()));
        }
        if full.len() >= self.cfg.n_ctx {
            return fail(w, GatewayError::PromptTooLong { prompt: full.len(), context: self.cfg.n_ctx });
        }
        let max_tokens = match w.params.max_tokens {
            Some(m) if full.len() + m as usize > self.cfg.n_ctx => {
                return fail(w, GatewayError::ContextExceeded { prompt: full.len(), max_tokens: m as usize, context: self.cfg.n_ctx })
            }
            Some(m) => m,
            None => DEFAULT_MAX_TOKENS,
        };
        let need_tokens = (full.len() + max_tokens as usize).min(self.cfg.n_ctx);
        let need_blocks = need_tokens.div_ceil(bs);
        if need_blocks > self.total_blocks() {
            return fail(
                w,
                GatewayError::ResourceExhausted(format!(
                    "the request needs up to {need_tokens} tokens of KV, more than the {} the cpu-workers hold; lower max_tokens",
                    self.total_blocks() * bs
                )),
            );
        }
        // A request without KV of its own starts from the longest cached prefix of its
        // prompt (not one whose every prompt token is scored: the cached ones would not be).
        let uses_cache = self.cfg.prefix_cache && !w.params.prompt_logprobs;
        let prefix_table = match &session {
            SessionUse::Existing(_) => None,
            _ if uses_cache => {
                let up = &self.worker_up;
                let table = self.pool.table_with_prefix(&full, |w| up[w.0 as usize]);
                if self.prefix_being_computed(&full, table.len()) {
                    return Ok(Admission::PrefixBeingComputed(wait(w, &full)));
                }
                Some(table)
            }
            _ => Some(self.pool.new_table()),
        };
        // Blocks the request holds already, or gets back from its session's table when it is
        // cut to what the request shares with it.
        let held = match &prefix_table {
            Some(t) => t.blocks().len(),
            None => session.existing().and_then(|id| self.sessions.get(id)).map_or(0, |s| {
                s.table.as_ref().map_or(0, |t| t.blocks_reusable_after_truncate(common_prefix(&s.kv_tokens, &full).min(full.len() - 1)))
            }),
        };
        let outstanding: usize = self.running.iter().map(Seq::outstanding_blocks).sum();
        let fits = |s: &Self| s.free_blocks() >= outstanding + need_blocks.saturating_sub(held);
        while !fits(self) {
            // Evict the least recently used idle session other than this request's, of those
            // that would give blocks back (not all shared with running requests).
            let own = session.existing();
            let victim = self
                .sessions
                .iter()
                .filter(|(k, s)| s.table.as_ref().is_some_and(|t| t.blocks_reusable_after_truncate(0) > 0) && Some(k.as_str()) != own)
                .min_by_key(|(_, s)| s.last_used)
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else { return Ok(Admission::KvFull(wait(w, &full))) };
            let s = self.sessions.remove(&victim).expect("found");
            tracing::info!(session = %victim, "idle session evicted to make room for a request");
            self.released.push(s.seq_id);
            self.lost_sessions.record(victim, "it was the least recently used idle session when the KV cache was full, and was evicted to make room");
        }

        // Admitted: take the session's KV (or the cached prefix's) and keep what is cached.
        let (seq_id, mut table, mut kv_tokens, session_name, restore) = match session {
            SessionUse::Existing(id) => {
                let s = self.sessions.get_mut(&id).expect("resolved");
                let restore = std::mem::take(&mut s.take_up) || s.gpu_generation != self.gpu_generation;
                s.gpu_generation = self.gpu_generation;
                (s.seq_id, s.table.take().expect("idle"), std::mem::take(&mut s.kv_tokens), Some(id), restore)
            }
            new => {
                let id = self.next_seq;
                self.next_seq += 1;
                let name = match new {
                    SessionUse::New(name) => {
                        self.sessions.insert(
                            name.clone(),
                            Session {
                                seq_id: id,
                                table: None,
                                kv_tokens: vec![],
                                history: vec![],
                                messages: vec![],
                                last_used: Instant::now(),
                                gpu_generation: self.gpu_generation,
                                take_up: false,
                            },
                        );
                        Some(name)
                    }
                    _ => None,
                };
                let table = prefix_table.expect("made for a request without a session");
                let kv_tokens = full[..table.len()].to_vec();
                metrics::prefix_cache_lookup(full.len(), table.len());
                // The gpu-worker learns of KV it did not compute as of a sequence taken up
                // again: the held tokens and every block.
                let restore = !table.is_empty();
                (id, table, kv_tokens, name, restore)
            }
        };
        let cached = table.truncate(common_prefix(&kv_tokens, &full).min(full.len() - 1));
        kv_tokens.truncate(cached);
        let pending = full[cached..].to_vec();
        metrics::request_admitted(full.len());
        let _ = w.events.send(Ok(Event::Prompt { prompt_ids: pending.clone(), session_id: session_name.clone(), cached_tokens: cached as u32 }));
        let serial = self.next_serial;
        self.next_serial += 1;
        self.running.push(Seq {
            id: seq_id,
            serial,
            events: w.events,
            sampling: w.params.sampling,
            max_tokens,
            top_logprobs: w.params.top_logprobs,
            prompt_logprobs: w.params.prompt_logprobs,
            ignore_eos: w.params.ignore_eos,
            sent_blocks: if restore { 0 } else { table.blocks().len() },
            restore,
            resume_from: cached,
            paused_since: None,
            resumes: 0,
            table,
            kv_tokens,
            pending,
            queued: 0,
            samples_in_flight: 0,
            sampler_sent: false,
            generated: Vec::new(),
            text: TextStream::new(w.params.stop.clone()),
            output: String::new(),
            session: session_name.map(|n| (n, messages)),
            prompt_tokens: full.len() as u32,
            prefilled: 0,
            reserved_blocks: need_blocks,
            arrived: w.arrived,
            first_token: None,
        });
        Ok(Admission::Admitted)
    }
}
