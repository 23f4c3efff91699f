//! The error type of duet-model, one variant per step that can fail.

use crate::gguf::GgufError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading GGUF: {0}")]
    Gguf(#[from] GgufError),
    #[error("unsupported model: {0}")]
    UnsupportedModel(String),
    #[error("tensor {name:?}: expected {expected}, found {found}")]
    TensorShape { name: String, expected: String, found: String },
    #[error("building tokenizer: {0}")]
    Tokenizer(String),
    #[error("tokenizing: {0}")]
    Encode(String),
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    TokenOutOfRange { id: u32, n_vocab: usize },
    #[error("chat template: {0}")]
    Template(String),
    #[error("reading {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
