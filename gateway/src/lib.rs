//! duet-gateway: the only public process of Duet. It serves the gRPC API, tokenises and
//! renders chat templates, runs the continuous-batching scheduler over the gpu-worker and
//! the cpu-workers' KV, keeps sessions, and in local mode supervises the worker processes.

pub mod api;
pub mod backend;
pub mod balancer;
pub mod cli;
pub mod config;
pub mod error;
pub mod leftovers;
pub mod metrics;
pub mod readiness;
pub mod request;
pub mod scheduler;
pub mod sequence;
pub mod serve;
pub mod text_stream;
pub mod supervisor;
