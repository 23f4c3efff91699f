//! The scheduler's per-request state: a running sequence (its KV block table, the tokens
//! still to feed, the text stream) and a session (a conversation's KV kept between turns),
//! and where each decode token's attention runs.

use std::ops::Range;
use std::time::Instant;

use duet_common::kv::{BlockTable, WorkerId};
use duet_common::model::chat::ChatMessage;
use duet_common::rpc::pb;
use tokio::sync::mpsc;

use crate::backend::{Event, Sampling, StopReason, Usage};
use crate::error::GatewayError;
use crate::stop::TextStream;

/// Where decode attention runs (static policies; the balancer will choose per step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttentionPlacement {
    /// On the cpu-workers that hold the KV (the default).
    Cpu,
    /// All on the gpu-worker (it reads the KV from the arenas).
    Gpu,
    /// The first `gpu_fraction` of each context on the gpu-worker, the rest on the
    /// cpu-workers holding it.
    Split { gpu_fraction: f32 },
}

impl std::str::FromStr for AttentionPlacement {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(AttentionPlacement::Cpu),
            "gpu" => Ok(AttentionPlacement::Gpu),
            "split" => Ok(AttentionPlacement::Split { gpu_fraction: 0.5 }),
            _ => match s.strip_prefix("split:").map(str::parse::<f32>) {
                Some(Ok(f)) if (0.0..=1.0).contains(&f) => Ok(AttentionPlacement::Split { gpu_fraction: f }),
                _ => Err(format!("attention placement {s:?}: expected cpu, gpu, split or split:FRACTION (0..1)")),
            },
        }
    }
}

impl std::fmt::Display for AttentionPlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AttentionPlacement::Cpu => f.write_str("cpu"),
            AttentionPlacement::Gpu => f.write_str("gpu"),
            AttentionPlacement::Split { gpu_fraction } => write!(f, "split:{gpu_fraction}"),
        }
    }
}

impl AttentionPlacement {
    /// The shares of attention for a decode token at position `pos` of a sequence whose KV
    /// lies in `table` (already holding `pos`). Empty means all on the gpu-worker.
    pub fn shares(&self, table: &BlockTable, pos: usize) -> Vec<pb::AttentionShare> {
        let n_ctx = pos + 1;
        let gpu_end = match *self {
            AttentionPlacement::Gpu => return Vec::new(),
            AttentionPlacement::Cpu => 0,
            AttentionPlacement::Split { gpu_fraction } => ((n_ctx as f64 * gpu_fraction as f64).round() as usize).min(n_ctx),
        };
        if gpu_end == n_ctx {
            return Vec::new();
        }
        let mut shares = Vec::new();
        if gpu_end > 0 {
            shares.push(pb::AttentionShare { cpu_worker: None, start: 0, end: gpu_end as u32 });
        }
        for (WorkerId(w), range) in table.token_ranges_per_worker() {
            let r: Range<usize> = range.start.max(gpu_end)..range.end.min(n_ctx);
            if r.start < r.end {
                shares.push(pb::AttentionShare { cpu_worker: Some(w), start: r.start as u32, end: r.end as u32 });
            }
        }
        shares
    }
}

/// The sender of a request's events.
pub type Events = mpsc::UnboundedSender<Result<Event, GatewayError>>;

/// A conversation kept between turns.
#[derive(Debug)]
pub struct Session {
    /// The gpu-worker's sequence id: the same across turns.
    pub seq_id: u64,
    /// The KV; `None` while a request is running on the session (it holds it).
    pub table: Option<BlockTable>,
    /// Tokens whose KV is in the table (positions `0..`).
    pub kv_tokens: Vec<u32>,
    /// The whole conversation: `kv_tokens` plus the last sampled token, which was never fed.
    pub history: Vec<u32>,
    /// The chat messages so far (chat sessions), the assistant's replies included.
    pub messages: Vec<ChatMessage>,
    pub last_used: Instant,
}

/// A request being served.
#[derive(Debug)]
pub struct Seq {
    pub id: u64,
    pub events: Events,
    pub sampling: Sampling,
    pub max_tokens: u32,
    pub top_logprobs: u32,
    /// Generation goes on past end-of-generation tokens.
    pub ignore_eos: bool,
    pub table: BlockTable,
    /// Blocks of `table` the gpu-worker has been told about.
    pub sent_blocks: usize,
    /// Tokens whose KV is in the table.
    pub kv_tokens: Vec<u32>,
    /// Tokens still to feed: the rest of the prompt, or the last sampled token.
    pub pending: Vec<u32>,
    /// Whether the gpu-worker has this generation's sampler.
    pub sampler_sent: bool,
    pub generated: Vec<u32>,
    pub text: TextStream,
    /// The text released so far (a chat session's assistant message).
    pub output: String,
    /// The session this request runs in, with the messages to add to it when it ends.
    pub session: Option<(String, Vec<ChatMessage>)>,
    pub prompt_tokens: u32,
    pub prefilled: u32,
    /// Blocks this request may come to hold (prompt plus max_tokens), reserved at admission.
    pub reserved_blocks: usize,
    pub arrived: Instant,
    pub first_token: Option<Instant>,
}

impl Seq {
    /// Blocks reserved but not yet allocated.
    pub fn outstanding_blocks(&self) -> usize {
        self.reserved_blocks.saturating_sub(self.table.blocks().len())
    }

    /// Whether the client is gone (its stream was dropped).
    pub fn cancelled(&self) -> bool {
        self.events.is_closed()
    }

    /// The sampler configuration the gpu-worker gets on the first step.
    pub fn sampler_config(&self) -> pb::SamplerConfig {
        let s = self.sampling;
        pb::SamplerConfig {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            seed: s.seed,
            top_logprobs: self.top_logprobs,
        }
    }

    /// The final event.
    pub fn finished(&mut self, reason: StopReason) -> Event {
        let now = Instant::now();
        let usage = Usage {
            prompt_tokens: self.prompt_tokens,
            prefilled_tokens: self.prefilled,
            generated_tokens: self.generated.len() as u32,
            time_to_first_token: self.first_token.unwrap_or(now) - self.arrived,
            total_time: now - self.arrived,
        };
        Event::Finished { reason, text: self.text.finish(), usage }
    }
}

/// Length of the common prefix of two token lists.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_common::kv::KvPool;

    #[test]
    fn placements_parse() {
        assert_eq!("cpu".parse(), Ok(AttentionPlacement::Cpu));
        assert_eq!("gpu".parse(), Ok(AttentionPlacement::Gpu));
        assert_eq!("split:0.25".parse(), Ok(AttentionPlacement::Split { gpu_fraction: 0.25 }));
        assert!("split:2".parse::<AttentionPlacement>().is_err());
        assert!("everywhere".parse::<AttentionPlacement>().is_err());
    }

    #[test]
    fn shares_cover_the_context_once() {
        let pool = KvPool::new(4, &[8, 8]);
        let mut table = pool.new_table();
        table.append_tokens(6, duet_common::kv::Placement::Worker(WorkerId(0))).unwrap();
        table.append_tokens(4, duet_common::kv::Placement::Worker(WorkerId(1))).unwrap();
        // Positions 0..8 on worker 0, 8..10 on worker 1; the token at 9.
        let cpu = AttentionPlacement::Cpu.shares(&table, 9);
        assert_eq!(
            cpu,
            vec![
                pb::AttentionShare { cpu_worker: Some(0), start: 0, end: 8 },
                pb::AttentionShare { cpu_worker: Some(1), start: 8, end: 10 }
            ]
        );
        assert!(AttentionPlacement::Gpu.shares(&table, 9).is_empty());
        let split = AttentionPlacement::Split { gpu_fraction: 0.3 }.shares(&table, 9);
        assert_eq!(
            split,
            vec![
                pb::AttentionShare { cpu_worker: None, start: 0, end: 3 },
                pb::AttentionShare { cpu_worker: Some(0), start: 3, end: 8 },
                pb::AttentionShare { cpu_worker: Some(1), start: 8, end: 10 }
            ]
        );
        assert!(AttentionPlacement::Split { gpu_fraction: 1.0 }.shares(&table, 9).is_empty());
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
    }
}
