//! Worker mode: the gpu-worker as one process of the Duet service. It maps the cpu-workers'
//! KV arenas and exchange rings ([`arenas`]), executes the gateway's steps ([`executor`],
//! their attention in `step_attention`) in the gateway's order (`step_order`) and serves them
//! over gRPC ([`service`]).

pub mod arenas;
pub mod executor;
mod plan;
mod step_order;
pub mod service;
mod step_attention;

use crate::error::GpuWorkerError;

/// Why a step (or an attachment) failed, by the part that failed.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("invalid step: {0}")]
    Invalid(String),
    #[error("sequence {0} is unknown to the gpu-worker (it starts with start_pos 0)")]
    UnknownSequence(u64),
    #[error("out of order: {0}")]
    Order(String),
    #[error(transparent)]
    Kv(#[from] crate::device::KvAccessError),
    #[error("attaching cpu-worker {worker}: {what}")]
    Attach { worker: u32, what: String },
    #[error("cpu-worker {worker} failed: {what}")]
    CpuWorker { worker: u32, what: String },
    #[error(transparent)]
    Model(#[from] GpuWorkerError),
}
