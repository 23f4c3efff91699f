//! duet-common: what every Duet process shares — the GGUF model reader, tokenizer and chat
//! templates, the CPU kernels (quantised dot products, attention, norms, RoPE), and the
//! machine's NUMA topology.

pub mod error;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod rpc;
pub mod shm;
pub mod topology;

pub use error::{Error, Result};
pub mod testutil;

/// Where `scripts/fetch-model.sh` puts the default model, relative to the workspace root.
pub const DEFAULT_MODEL_PATH: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
