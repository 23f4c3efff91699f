//! Model files and everything read from them: GGUF, hyper-parameters, tokenizer, chat
//! template, and the output grammars the sampler follows.

pub mod chat;
pub mod config;
pub mod gguf;
pub mod grammar;
pub mod names;
pub mod pretokenizers;
pub mod tokenizer;
pub mod error;
pub mod experts;
pub mod testutil;

pub use error::{Error, Result};

/// Where `scripts/fetch-model.sh` puts the default model, relative to the workspace root.
pub const DEFAULT_MODEL_PATH: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
