//! Worker mode: the gpu-worker as one process of the Duet service. It maps the cpu-workers'
//! KV arenas and exchange rings ([`arenas`]), executes the gateway's steps ([`executor`],
//! their attention in `step_attention`) in the gateway's order (`step_order`) and serves them
//! over gRPC ([`service`]).

pub mod arenas;
pub mod executor;
mod hot_experts;
mod plan;
mod step_order;
pub mod service;
mod step_attention;
mod step_experts;

use std::ops::Range;
use std::time::Duration;

use duet_kv::shm::job::JobError;
use duet_kv::BlockId;
use duet_model::grammar::GrammarError;

use crate::error::GpuWorkerError;

/// Why a step (or an attachment) failed, by the part that failed.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("invalid step: no cpu-worker is attached, so there is no KV arena")]
    NoArena,
    #[error("invalid step: sequence {0} appears twice")]
    DuplicateSequence(u64),
    #[error("invalid step: sequence {seq_id}: {problem}")]
    Sequence { seq_id: u64, problem: SequenceError },
    #[error("invalid step: block {block} of cpu-worker {worker}, whose arena has {n_blocks}")]
    BlockOutOfRange { worker: u32, block: BlockId, n_blocks: u32 },
    #[error("invalid step: block {block} of cpu-worker {worker} takes new rows of two sequences, or twice in one sequence's blocks")]
    SharedBlock { worker: u32, block: BlockId },
    #[error("invalid step: layer {layer}'s attention job for cpu-worker {worker} needs {need} bytes, its ring slots hold {slot_bytes} (raise its --slot-bytes)")]
    JobTooLarge { layer: u32, worker: u32, need: usize, slot_bytes: usize },
    #[error("invalid step: encoding layer {layer}'s attention job: {source}")]
    JobEncoding { layer: u32, source: JobError },
    #[error("the structured-output mask thread failed")]
    MaskThread,
    #[error("sequence {0} is unknown to the gpu-worker (it starts with start_pos 0)")]
    UnknownSequence(u64),
    #[error("out of order: step {after}, which this step comes after, did not run in {waited:?}, or the caller left")]
    OutOfOrder { after: u64, waited: Duration },
    #[error(transparent)]
    Kv(#[from] crate::device::KvAccessError),
    #[error("attaching cpu-worker {worker}: {what}")]
    Attach { worker: u32, what: String },
    #[error("cpu-worker {worker} failed: {what}")]
    CpuWorker { worker: u32, what: String },
    #[error(transparent)]
    Model(GpuWorkerError),
}

/// A cpu-worker that failed serving routed experts is a failed cpu-worker (the gateway
/// re-attaches and resumes); every other device error is the model's.
impl From<GpuWorkerError> for StepError {
    fn from(e: GpuWorkerError) -> Self {
        match e {
            GpuWorkerError::RemoteExperts { worker: Some(worker), what } => StepError::CpuWorker { worker, what: format!("routed experts: {what}") },
            e => StepError::Model(e),
        }
    }
}

/// What is wrong with one sequence's part of a step.
#[derive(Debug, thiserror::Error)]
pub enum SequenceError {
    #[error("sub-batch {0} (there are two: 0 and 1)")]
    SubBatch(u32),
    #[error("feeds its sampled token and has input tokens too")]
    FeedsAndHasTokens,
    #[error("feeds its sampled token but its last step sampled none")]
    NothingSampled,
    #[error("no input tokens")]
    NoTokens,
    #[error("{positions} positions exceed the context of {n_ctx}")]
    PastContext { positions: usize, n_ctx: usize },
    #[error("start_pos {start} is past the {held} positions held")]
    StartPastHeld { start: usize, held: usize },
    #[error("{blocks} blocks hold {holds} positions, {needed} needed")]
    TooFewBlocks { blocks: usize, holds: usize, needed: usize },
    #[error("asks to sample but no sampler was configured")]
    NoSampler,
    #[error("structured output is not available on this gpu-worker")]
    NoGrammars,
    #[error("structured output: {0}")]
    Grammar(#[from] GrammarError),
    #[error("attention shares are for single decode tokens, the step has {0}")]
    SharesNotDecode(usize),
    #[error("attention shares {shares:?} do not cover 0..{n_ctx} once")]
    SharesUncovered { shares: Vec<Range<usize>>, n_ctx: usize },
    #[error("cpu-worker {worker} is to attend {range:?} but block {block} lives on cpu-worker {owner}")]
    ShareElsewhere { worker: u32, range: Range<usize>, block: BlockId, owner: u32 },
}
