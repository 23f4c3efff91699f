//! The scheduler's per-request state: a running sequence (its KV block table, the tokens
//! still to feed, the text stream) and a session (a conversation's KV kept between turns),
//! and what the balancer's planner needs of each decode token.

use std::time::Instant;

use duet_kv::{BlockTable, WorkerId, GPU_KV_PAGE};
use duet_model::chat::ChatMessage;
use duet_proto::pb;
use tokio::sync::mpsc;

use crate::request::{Event, Sampling, StopReason, Usage};
use crate::balancer::planner::{SeqDemand, Share};
use crate::error::GatewayError;
use crate::text_stream::TextStream;

/// What the planner needs of a sequence whose decode token is at `pos`: its context and
/// which cpu-worker holds which positions (the gpu-worker reads any of them from the arenas).
pub fn attention_demand(table: &BlockTable, pos: usize) -> SeqDemand {
    let n_ctx = pos + 1;
    let held = table
        .token_ranges_per_worker()
        .into_iter()
        .filter(|(_, r)| r.start < n_ctx)
        .map(|(WorkerId(w), r)| (w, r.start..r.end.min(n_ctx)))
        .collect();
    SeqDemand { n_ctx, held, gpu_max: n_ctx }
}

/// Shares the GPU's KV mirror of `capacity` positions among the decoding sequences: each
/// may be attended on the GPU over a prefix no longer than its part (`gpu_max`), the parts
/// filled shortest context first (a context shorter than an even part leaves the rest to the
/// longer ones), rounded down to whole blocks; each part takes whole pages of the mirror
/// ([`GPU_KV_PAGE`]), so that together they fit it.
pub fn share_gpu_kv(demands: &mut [SeqDemand], capacity: usize, block_size: usize) {
    let mut order: Vec<usize> = (0..demands.len()).collect();
    order.sort_by_key(|&i| demands[i].n_ctx);
    let mut left = capacity / GPU_KV_PAGE * GPU_KV_PAGE;
    for (k, &i) in order.iter().enumerate() {
        let d = &mut demands[i];
        let even = left / (order.len() - k) / GPU_KV_PAGE * GPU_KV_PAGE;
        d.gpu_max = if d.n_ctx <= even { d.n_ctx } else { even / block_size.max(1) * block_size.max(1) };
        left -= d.gpu_max.next_multiple_of(GPU_KV_PAGE);
    }
}

/// A planned sequence's shares for the step request. All on the gpu-worker is sent as no
/// shares: the gpu-worker then attends the whole context unsplit, exactly as the
/// single-process runner does.
pub fn shares_to_proto(shares: &[Share], n_ctx: usize) -> Vec<pb::AttentionShare> {
    if let [Share { cpu_worker: None, range }] = shares {
        if *range == (0..n_ctx) {
            return Vec::new();
        }
    }
    shares.iter().map(|s| pb::AttentionShare { cpu_worker: s.cpu_worker, start: s.range.start as u32, end: s.range.end as u32 }).collect()
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
    /// The gpu-worker generation (see the scheduler) its sequence was last sent to: a session
    /// older than the running gpu-worker is taken up again from its KV (`Seq::restore`).
    pub gpu_generation: u64,
    /// A request on the session failed: the gpu-worker may have forgotten the sequence (it
    /// forgets a failed step's sequences, and one that could not sample), so the next turn
    /// takes it up again from its KV (harmless where it had not).
    pub take_up: bool,
}

/// A request being served.
#[derive(Debug)]
pub struct Seq {
    pub id: u64,
    /// Unique to this request (a session's turns share `id`): how a step's results find it.
    pub serial: u64,
    pub events: Events,
    pub sampling: Sampling,
    pub max_tokens: u32,
    pub top_logprobs: u32,
    /// Its prompt chunks are scored (`GenerateParams::prompt_logprobs`).
    pub prompt_logprobs: bool,
    /// Generation goes on past end-of-generation tokens.
    pub ignore_eos: bool,
    pub table: BlockTable,
    /// Blocks of `table` the gpu-worker has been told about.
    pub sent_blocks: usize,
    /// The gpu-worker may not know this sequence although its KV is in the arenas (its
    /// session outlived a gpu-worker restart): the first step sends every block and the tokens
    /// held (`held_tokens`).
    pub restore: bool,
    /// The session's KV length when this request took it: what the session goes back to if
    /// the request fails (its earlier turns' KV is intact).
    pub resume_from: usize,
    /// Since when the request waits for a failed worker to come back (its steps in flight were
    /// lost; it goes on from the KV of its applied steps): `None` while it runs.
    pub paused_since: Option<std::time::Instant>,
    /// Times it was resumed after a worker failure (bounded: see the scheduler).
    pub resumes: u32,
    /// Tokens whose KV is in the table.
    pub kv_tokens: Vec<u32>,
    /// Tokens still to feed: the rest of the prompt, or the last sampled token.
    pub pending: Vec<u32>,
    /// How many of `pending` went out in steps whose results are not back yet.
    pub queued: usize,
    /// Steps not back yet that sample a token for it (the next input is the last one's).
    pub samples_in_flight: u32,
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
    /// The gpu-worker may not know this sequence (it restarted): the next step sends every
    /// block, the tokens held and the sampler again.
    pub fn take_up_again(&mut self) {
        self.restore = true;
        self.sent_blocks = 0;
        self.sampler_sent = false;
    }
    /// Forgets the steps in flight (a worker failed and they are lost): back to the state of
    /// the last applied step, whose K/V is in the arenas; the next step feeds `pending` again.
    pub fn rewind(&mut self) {
        self.queued = 0;
        self.samples_in_flight = 0;
        // The table holds the applied positions' blocks alone or whole (only whole, applied
        // blocks are shared), so this keeps every applied position; were one shared block cut
        // (a bug), its tokens would be fed again rather than written into it.
        let kept = self.table.truncate(self.kv_tokens.len());
        let again = self.kv_tokens.split_off(kept);
        self.pending.splice(0..0, again);
        self.paused_since.get_or_insert_with(std::time::Instant::now);
        // The gpu-worker forgets a failed step's sequences: without being taken up again from
        // the arenas, one of them left out of the next step and sent in the one pipelined
        // after it would be skipped there, its chunk taken for computed (and its blocks,
        // holding no KV, registered in the prefix cache). Taking up one it knows is harmless.
        self.take_up_again();
    }

    /// Blocks reserved but not yet allocated.
    pub fn outstanding_blocks(&self) -> usize {
        self.reserved_blocks.saturating_sub(self.table.blocks().len())
    }

    /// Whether it decodes (rather than prefills) in the next step.
    pub fn decoding(&self) -> bool {
        !self.generated.is_empty() || self.samples_in_flight > 0
    }

    /// Whether it certainly goes on after the tokens the steps in flight sample for it: it
    /// has generation left and context left (an end-of-generation token or a stop string
    /// may still end it).
    pub fn continues_after_in_flight(&self, n_ctx: usize) -> bool {
        (self.generated.len() + self.samples_in_flight as usize) < self.max_tokens as usize && self.table.len() + 1 < n_ctx
    }

    /// Whether the client is gone (its stream was dropped).
    pub fn cancelled(&self) -> bool {
        self.events.is_closed()
    }

    /// The sampler configuration the gpu-worker gets on the first step.
    pub fn sampler_config(&self) -> pb::SamplerConfig {
        let s = &self.sampling;
        pb::SamplerConfig {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            min_p: s.min_p,
            repetition_penalty: s.repetition_penalty,
            frequency_penalty: s.frequency_penalty,
            presence_penalty: s.presence_penalty,
            logit_bias: s.logit_bias.iter().copied().collect(),
            seed: s.seed,
            top_logprobs: self.top_logprobs,
            constraint: s.grammar.as_ref().map(pb::OutputConstraint::from),
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
    use crate::balancer::planner::CostModel;
    use crate::balancer::Policy;
    use duet_kv::KvPool;

    #[test]
    fn the_gpu_mirror_is_shared_shortest_context_first() {
        let on = |n_ctx| SeqDemand { n_ctx, held: vec![(0, 0..n_ctx)], gpu_max: n_ctx };
        // 1000 positions (62 pages of 16) for contexts of 100, 2000 and 5000: the short one
        // whole (7 pages), the other two 440 each, rounded down to blocks of 16 and pages
        // (432: 27 pages), the last taking what is left (448: 28 pages). Counted in positions
        // (448 each) they took 63 pages.
        let mut d = vec![on(2000), on(100), on(5000)];
        share_gpu_kv(&mut d, 1000, 16);
        assert_eq!(d.iter().map(|d| d.gpu_max).collect::<Vec<_>>(), [432, 100, 448]);
        // Whatever the contexts and blocks, the parts fit the mirror's pages.
        for (ctxs, cap, block) in [(vec![17, 33, 1000, 1000], 500, 1), (vec![1, 2, 3, 4, 5, 6, 7, 8, 9], 64, 1), (vec![8208; 64], 471_200, 64)] {
            let mut d: Vec<SeqDemand> = ctxs.into_iter().map(on).collect();
            share_gpu_kv(&mut d, cap, block);
            let pages: usize = d.iter().map(|d| d.gpu_max.div_ceil(GPU_KV_PAGE)).sum();
            assert!(pages <= cap / GPU_KV_PAGE, "{pages} pages of {cap} positions");
        }
        // Room for everything: every context whole.
        let mut d = vec![on(2000), on(100)];
        share_gpu_kv(&mut d, 1 << 20, 16);
        assert_eq!(d.iter().map(|d| d.gpu_max).collect::<Vec<_>>(), [2000, 100]);
        // The planner keeps the GPU's share within it and gives the rest to the cpu-worker.
        let mut d = vec![on(5000)];
        share_gpu_kv(&mut d, 1000, 16);
        let cost = CostModel { linear_fixed: 0.0, linear_per_token: 0.0, gpu_attn_per_pos: 1.0, cpu_fixed: vec![0.0], cpu_attn_per_pos: vec![1.0], overlapped_fixed: 0.0, overlapped_per_token: 0.0, overlap_slowdown: 1.0, shared_cores: false, local_linear: None };
        let plan = Policy::Gpu.plan(&cost, 1, &d, 16, false, crate::balancer::Overlap::Never);
        let ranges: Vec<_> = plan.shares[0].iter().map(|s| (s.cpu_worker, s.range.clone())).collect();
        assert_eq!(ranges, [(None, 0..992), (Some(0), 992..5000)]);
    }

    #[test]
    fn shares_cover_the_context_once() {
        let pool = KvPool::new(4, &[8, 8]);
        let mut table = pool.new_table();
        table.append_tokens(6, duet_kv::Placement::Worker(WorkerId(0))).unwrap();
        table.append_tokens(4, duet_kv::Placement::Worker(WorkerId(1))).unwrap();
        // Positions 0..8 on worker 0, 8..10 on worker 1; the token at 9.
        let demand = attention_demand(&table, 9);
        assert_eq!(demand.held, vec![(0, 0..8), (1, 8..10)]);
        let cost = CostModel {
            linear_fixed: 0.0,
            linear_per_token: 0.0,
            gpu_attn_per_pos: 1.0,
            cpu_fixed: vec![0.0; 2],
            cpu_attn_per_pos: vec![1.0; 2],
            overlapped_fixed: 0.0,
            overlapped_per_token: 0.0,
            overlap_slowdown: 1.0,
            shared_cores: false,
            local_linear: None,
        };
        let proto = |p: Policy| shares_to_proto(&p.plan(&cost, 1, std::slice::from_ref(&demand), 4, false, crate::balancer::Overlap::Auto).shares[0], 10);
        assert_eq!(
            proto(Policy::Cpu),
            vec![
                pb::AttentionShare { cpu_worker: Some(0), start: 0, end: 8 },
                pb::AttentionShare { cpu_worker: Some(1), start: 8, end: 10 }
            ]
        );
        assert!(proto(Policy::Gpu).is_empty());
        assert_eq!(
            proto(Policy::Ratio(0.3)),
            vec![
                pb::AttentionShare { cpu_worker: None, start: 0, end: 3 },
                pb::AttentionShare { cpu_worker: Some(0), start: 3, end: 8 },
                pb::AttentionShare { cpu_worker: Some(1), start: 8, end: 10 }
            ]
        );
        assert!(proto(Policy::Ratio(1.0)).is_empty());
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
    }
}
