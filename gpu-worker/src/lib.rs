//! duet-gpu-worker: loads a model onto its device and runs it — as one process of the Duet
//! service (`serve`: steps from the gateway, KV in the cpu-workers' arenas) or standalone
//! (`run`, `perplexity`: the single-process reference the distributed system must match).

pub mod cli;
pub mod device;
pub mod error;
pub mod forward;
pub mod runner;
pub mod sampler;
pub mod worker;
