//! The tokenizer over HTTP, in vLLM's shape (`POST /tokenize`, `POST /detokenize`, `GET
//! /tokenizer_info`): what lm-evaluation-harness's `local-completions` finds and then uses
//! instead of downloading a Hugging Face tokenizer, so a model known only by its GGUF file
//! can be evaluated. Behind the API key, as `/v1` is.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::Json;
use duet_model::chat::ChatMessage;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{ApiError, AppState};
use crate::error::GatewayError;

#[derive(Debug, Deserialize)]
pub(super) struct TokenizeRequest {
    /// Text to tokenise (special tokens' text parsed as such).
    prompt: Option<String>,
    /// Or chat messages, rendered by the model's chat template.
    messages: Option<Vec<TokenizeMessage>>,
    /// With `prompt`: start with the model's BOS where it wants one [true]. With `messages`
    /// the template writes it [false].
    add_special_tokens: Option<bool>,
    /// With `messages`: end with the assistant turn's opening [true].
    add_generation_prompt: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub(super) struct TokenizeMessage {
    role: String,
    content: String,
}

/// `{"tokens": [...], "count": n, "max_model_len": context}`.
pub(super) async fn tokenize(State(s): State<Arc<AppState>>, body: Result<Json<TokenizeRequest>, JsonRejection>) -> Result<Json<Value>, ApiError> {
    let Json(req) = body?;
    let model = s.backend.text();
    let tok = &model.tokenizer;
    // The text, and whether BOS goes first where the model wants one.
    let (text, add_bos) = match (req.prompt, req.messages) {
        (Some(prompt), None) => (prompt, req.add_special_tokens.unwrap_or(true)),
        (None, Some(messages)) => {
            let template = model.chat_template.as_ref().ok_or_else(|| GatewayError::InvalidArgument("the model has no chat template".into()))?;
            let messages: Vec<ChatMessage> = messages.into_iter().map(|m| ChatMessage::new(m.role, m.content)).collect();
            let rendered = template.render(&messages, req.add_generation_prompt.unwrap_or(true)).map_err(GatewayError::from)?;
            (rendered, req.add_special_tokens.unwrap_or(false))
        }
        _ => return Err(GatewayError::InvalidArgument("set one of prompt and messages".into()).into()),
    };
    let tokens = if add_bos { tok.encode_prompt(&text, true) } else { tok.encode(&text, true) }.map_err(GatewayError::from)?;
    let max_model_len = s.backend.info().await?.context_length;
    Ok(Json(json!({ "count": tokens.len(), "max_model_len": max_model_len, "tokens": tokens })))
}

#[derive(Debug, Deserialize)]
pub(super) struct DetokenizeRequest {
    tokens: Vec<u32>,
}

/// `{"prompt": text}`.
pub(super) async fn detokenize(State(s): State<Arc<AppState>>, body: Result<Json<DetokenizeRequest>, JsonRejection>) -> Result<Json<Value>, ApiError> {
    let Json(req) = body?;
    let prompt = s.backend.text().tokenizer.decode(&req.tokens).map_err(GatewayError::from)?;
    Ok(Json(json!({ "prompt": prompt })))
}

/// The special tokens' text, the chat template and the context length.
pub(super) async fn tokenizer_info(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let text = s.backend.text();
    let tok = &text.tokenizer;
    let piece = |id: Option<u32>| id.map(|id| text.piece(id));
    let context = s.backend.info().await?.context_length;
    Ok(Json(json!({
        "tokenizer_class": "GGUF",
        "bos_token": piece(tok.bos),
        "eos_token": piece(tok.end_of_generation.first().copied()),
        "pad_token": null,
        "add_bos_token": tok.add_bos,
        "chat_template": text.chat_template.as_ref().map(|t| t.source()),
        "model_max_length": context,
    })))
}
