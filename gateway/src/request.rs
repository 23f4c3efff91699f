//! A generation request and what comes back, in the gateway's own types (front ends never
//! see worker protobufs): prompts, sampling, sessions, events, usage, the server's state, and
//! the model's text side that turns prompts into tokens.

use std::time::Duration;

use duet_model::chat::{ChatMessage, ChatTemplate};
use duet_model::grammar::{Grammar, Grammars};
use duet_model::tokenizer::Tokenizer;

use crate::error::GatewayError;

/// What to generate from.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Text, tokenised with special tokens parsed.
    Text(String),
    /// Token ids as given.
    Tokens(Vec<u32>),
    /// Chat messages, rendered with the model's chat template and a generation prompt, with
    /// the functions the model may call when its template takes them (`tools`).
    Chat { messages: Vec<ChatMessage>, tools: Option<Vec<serde_json::Value>> },
}

/// What a request does with sessions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionMode {
    None,
    /// Keep the conversation's KV as a new session, named `key@node` (a random key when
    /// `None`; the key is what a balancer routes on, see [`session_key`]).
    Create(Option<String>),
    /// Continue this session: the prompt follows its conversation so far.
    Continue(String),
    /// The prompt is the whole conversation (OpenAI's API): keep its KV as session `id` (a
    /// key, or `key@node` as a previous answer named it), continuing the session where this
    /// node holds it (the prefix the two share is not prefilled again) and creating it where
    /// it holds none. A session of another node is an error, not a silent new session.
    Conversation(String),
}

/// The longest session key a client may choose.
pub const MAX_SESSION_KEY: usize = 128;

/// The part of a session id a balancer routes on: everything before the `@` that names the
/// node holding it (`"k1@node-a"` → `"k1"`), or the whole id without one.
pub fn session_key(id: &str) -> &str {
    id.split_once('@').map_or(id, |(key, _)| key)
}

/// Checks a client's session key (the `x-session-id` header or metadata): 1 to 128 visible
/// ASCII characters, no `@`.
pub fn check_session_key(key: &str) -> Result<(), GatewayError> {
    if key.is_empty() || key.len() > MAX_SESSION_KEY || !key.bytes().all(|b| b.is_ascii_graphic() && b != b'@') {
        return Err(GatewayError::InvalidArgument(format!(
            "a session key must be 1 to {MAX_SESSION_KEY} visible ASCII characters without '@', got {key:?}"
        )));
    }
    Ok(())
}

/// The header (HTTP) and metadata key (gRPC) that carry a session's id or key, for the
/// balancer to route on and the gateway to name sessions by.
pub const SESSION_HEADER: &str = "x-session-id";

/// The response header (HTTP) and metadata key (gRPC) that report the seed a request sampled
/// with: the one it gave, or the fresh one drawn for it; sent back as `seed`, it reproduces
/// the request.
pub const SEED_HEADER: &str = "x-duet-seed";

/// A fresh seed for a request that gives none, so that retries and best-of-N get different
/// samples; below 2^63, so that it can be sent back as OpenAI's `seed` (a signed integer).
pub fn fresh_seed() -> u64 {
    rand::random::<u64>() >> 1
}

/// Sampling parameters (see `SamplingParams` in inference.proto).
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Added to these tokens' logits first, by token id.
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
    /// Structured output: what the generated text must match.
    pub grammar: Option<Grammar>,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
            grammar: None,
        }
    }
}

/// The most tokens a request's logit bias may name (OpenAI's limit).
pub const MAX_LOGIT_BIAS_TOKENS: usize = 300;

impl Sampling {
    /// Checks every value's range; the error names the field.
    pub fn validate(&self) -> Result<(), GatewayError> {
        let bad = |what: String| Err(GatewayError::InvalidArgument(what));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!("temperature must be a finite number >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p < 1.0) {
            return bad(format!("min_p must be in [0, 1), got {}", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!("repetition_penalty must be a finite number > 0, got {}", self.repetition_penalty));
        }
        for (name, v) in [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS_TOKENS {
            return bad(format!("logit_bias: at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {}", self.logit_bias.len()));
        }
        if let Some((id, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return bad(format!("logit_bias of token {id} must be in [-100, 100], got {b}"));
        }
        Ok(())
    }
}

/// Most log-probabilities a request may ask for per position.
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Tokens generated when a request does not say.
pub const DEFAULT_MAX_TOKENS: u32 = 256;

/// A generation request.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub prompt: Prompt,
    /// Most tokens to generate. `None`: [`DEFAULT_MAX_TOKENS`], or what the context leaves;
    /// given, the prompt and `max_tokens` must fit the context together.
    pub max_tokens: Option<u32>,
    pub sampling: Sampling,
    pub stop: Vec<String>,
    pub top_logprobs: u32,
    pub session: SessionMode,
    /// Generate past end-of-generation tokens, up to max_tokens (benchmarks).
    pub ignore_eos: bool,
    /// Score the prompt: [`Event::PromptLogprobs`] for every prompt token after the first,
    /// with `top_logprobs` alternatives (OpenAI's `echo` with `logprobs`).
    pub prompt_logprobs: bool,
}

impl GenerateParams {
    pub fn validate(&self) -> Result<(), GatewayError> {
        self.sampling.validate()?;
        if self.max_tokens == Some(0) {
            return Err(GatewayError::InvalidArgument("max_tokens must be at least 1".into()));
        }
        if self.prompt_logprobs && self.session != SessionMode::None {
            return Err(GatewayError::InvalidArgument("prompt log-probabilities (echo with logprobs) are for requests outside a session".into()));
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(GatewayError::InvalidArgument(format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {}", self.top_logprobs)));
        }
        let empty = match &self.prompt {
            Prompt::Text(t) => t.is_empty(),
            Prompt::Tokens(t) => t.is_empty(),
            Prompt::Chat { messages, .. } => messages.is_empty(),
        };
        if empty {
            return Err(GatewayError::InvalidArgument("the prompt is empty".into()));
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(GatewayError::InvalidArgument(format!("stop: at most {MAX_STOP_STRINGS} strings, got {}", self.stop.len())));
        }
        if let Some(s) = self.stop.iter().find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
            return Err(GatewayError::InvalidArgument(format!("stop: a stop string must be 1 to {MAX_STOP_BYTES} bytes long, got {}", s.len())));
        }
        Ok(())
    }
}

/// Most stop strings a request may give (the HTTP API keeps OpenAI's 4).
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, bytes.
pub const MAX_STOP_BYTES: usize = 4096;

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    EndOfGeneration,
    MaxTokens,
    StopString,
    ContextFull,
}

/// Counts and timings of a finished generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub prefilled_tokens: u32,
    pub generated_tokens: u32,
    pub time_to_first_token: Duration,
    pub total_time: Duration,
}

/// What a generation stream carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// First: the prompt as tokenised (new tokens only, with a session).
    Prompt { prompt_ids: Vec<u32>, session_id: Option<String>, cached_tokens: u32 },
    /// Prompt tokens scored, in order from the second (asked for with `prompt_logprobs`; one
    /// event per prompt chunk, before the first token).
    PromptLogprobs { tokens: Vec<ScoredToken> },
    /// One per generated token.
    Token { id: u32, text: String, logprob: Option<f32>, top: Vec<(u32, f32)> },
    /// Last.
    Finished { reason: StopReason, text: String, usage: Usage },
}

/// A prompt token's log-probability under the tokens before it, and the most likely tokens there.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredToken {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// One cpu-worker's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuWorkerStatus {
    pub worker: u32,
    pub kv_blocks: u32,
    pub kv_blocks_free: u32,
    pub ready: bool,
    pub restarts: u32,
}

/// The server's state, for `Info` and metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerInfo {
    pub model: String,
    pub context_length: u32,
    pub vocab_size: u32,
    pub gpu_device: String,
    pub cpu_workers: Vec<CpuWorkerStatus>,
    pub kv_block_size: u32,
    pub sessions: u32,
    pub active_requests: u32,
    /// Requests are waiting for KV cache space.
    pub kv_full: bool,
    /// The balancer's policy.
    pub policy: String,
    /// Median and 90th percentile of the planner's recent relative step-time errors.
    pub prediction_error: Option<(f64, f64)>,
    pub prefilled_tokens_total: u64,
    pub generated_tokens_total: u64,
    /// The gpu-worker makes up prompts' K/V (benchmarks only).
    pub synthetic_prefill: bool,
}

/// The model's text side, shared by the front ends and the scheduler.
#[derive(Debug)]
pub struct TextModel {
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// The vocabulary prepared for structured output (`None`: the vocabulary cannot be used).
    pub grammars: Option<Grammars>,
}

impl TextModel {
    /// Refuses a grammar that does not compile, or matches no text (before the request runs).
    pub fn check_grammar(&self, g: &Grammar) -> Result<(), GatewayError> {
        let grammars = self.grammars.as_ref().ok_or_else(|| GatewayError::InvalidArgument("structured output is not available for this model's vocabulary".into()))?;
        grammars.check(g).map_err(|e| GatewayError::InvalidArgument(format!("structured output: {e}")))
    }

    /// A token's text for logprobs and tokenisation replies: its bytes, lossily as UTF-8.
    pub fn piece(&self, id: u32) -> String {
        String::from_utf8_lossy(&self.piece_bytes(id)).into_owned()
    }

    /// A token's own bytes (a token may hold part of a UTF-8 character).
    pub fn piece_bytes(&self, id: u32) -> Vec<u8> {
        self.tokenizer.token_bytes(id).unwrap_or(&[]).to_vec()
    }

    /// The token ids of a prompt (text with special tokens, ids checked, or chat rendered).
    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, GatewayError> {
        match prompt {
            Prompt::Text(t) => Ok(self.tokenizer.encode_prompt(t, true)?),
            Prompt::Tokens(ids) => {
                self.tokenizer.check_ids(ids)?;
                Ok(ids.clone())
            }
            Prompt::Chat { messages, tools } => {
                let template = self
                    .chat_template
                    .as_ref()
                    .ok_or_else(|| GatewayError::InvalidArgument("the model has no chat template: send text or tokens".into()))?;
                let text = template.render_with_tools(messages, tools.as_deref(), true)?;
                Ok(self.tokenizer.encode_prompt(&text, true)?)
            }
        }
    }
}

