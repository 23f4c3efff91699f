//! duet-gpu-worker: loads a model onto its device and runs it — today the CPU device and the
//! standalone single-process commands that are the reference for the distributed system.

pub mod cli;
pub mod device;
pub mod error;
pub mod runner;
pub mod sampler;
