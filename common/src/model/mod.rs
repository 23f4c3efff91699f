//! Model files and everything read from them: GGUF, hyper-parameters, tokenizer, chat template.

pub mod chat;
pub mod config;
pub mod gguf;
pub mod grammar;
pub mod names;
pub mod pretokenizers;
pub mod tokenizer;
