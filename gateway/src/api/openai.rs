//! The OpenAI-compatible wire types (completions, chat completions, models, errors) and
//! their translation to and from the gateway's own request and event types.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use duet_model::chat::ChatMessage;
use duet_model::grammar::Grammar;

use super::tools::{self, ToolSpec, ToolSyntax, Tools};
use crate::request::{fresh_seed, GenerateParams, Prompt, Sampling, SessionMode, StopReason, TextModel};
use crate::error::GatewayError;

/// Most alternatives `logprobs` may ask for on `/v1/completions` (OpenAI's limit).
pub const MAX_COMPLETION_LOGPROBS: u32 = 5;
/// Most alternatives `top_logprobs` may ask for on `/v1/chat/completions` (OpenAI's limit).
pub const MAX_CHAT_TOP_LOGPROBS: u32 = 20;
/// Most stop sequences (OpenAI's limit).
const MAX_STOP: usize = 4;
/// `max_tokens` of a completion that does not say (OpenAI's default).
const COMPLETION_DEFAULT_MAX_TOKENS: u32 = 16;

/// A prompt as OpenAI accepts it: text, token ids, or a batch of one of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields both endpoints share, and the extensions Duet accepts beyond OpenAI's.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonFields {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// Extension (vLLM's name): keep only the K most likely tokens.
    pub top_k: Option<u32>,
    /// Extension: drop tokens less likely than this times the most likely one.
    pub min_p: Option<f32>,
    /// Extension: llama.cpp-style repetition penalty over the last 64 tokens.
    pub repetition_penalty: Option<f32>,
    /// Structured output: `{"type": "text" | "json_object"}` or `{"type": "json_schema",
    /// "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`.
    pub response_format: Option<ResponseFormat>,
    /// Extension (vLLM's name): the output matches this regular expression.
    pub guided_regex: Option<String>,
    /// Extension (vLLM's name): the output is in this Lark grammar's language.
    pub guided_grammar: Option<String>,
}

/// OpenAI's `response_format`.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Clone, Deserialize)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub schema: Option<Value>,
    #[serde(default)]
    pub strict: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    /// Log-probabilities of the chosen token and this many alternatives (0..=5).
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
    /// Tools belong to chat completions: present here, they are refused, not ignored.
    pub tools: Option<Value>,
    #[serde(flatten)]
    pub common: CommonFields,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// Text, or a list of content parts of which only `text` parts are supported.
    pub content: Option<Value>,
    /// An assistant turn's calls (OpenAI `tool_calls`).
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message's call.
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u32>,
    /// The newer name of `max_tokens`.
    pub max_completion_tokens: Option<u32>,
    pub tools: Option<Vec<ToolSpec>>,
    pub tool_choice: Option<Value>,
    /// Whether one reply may call several functions [true; at most 4].
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub common: CommonFields,
}

fn invalid(msg: impl Into<String>) -> GatewayError {
    GatewayError::InvalidArgument(msg.into())
}

/// The most choices (`n`) one request may ask for: each is a sequence of its own.
pub const MAX_CHOICES: u32 = 16;

impl CommonFields {
    /// How many choices the request asks for (`n`, checked by `check_unsupported`).
    pub fn choices(&self) -> u32 {
        self.n.unwrap_or(1)
    }

    /// Refuses what Duet does not do rather than silently ignoring it.
    fn check_unsupported(&self) -> Result<(), GatewayError> {
        if let Some(n) = self.n.filter(|n| !(1..=MAX_CHOICES).contains(n)) {
            return Err(invalid(format!("n must be in [1, {MAX_CHOICES}], got {n}")));
        }
        Ok(())
    }

    fn sampling(&self) -> Result<Sampling, GatewayError> {
        let d = Sampling::default();
        let seed = match self.seed {
            Some(s) => u64::try_from(s).map_err(|_| invalid(format!("seed must be >= 0, got {s}")))?,
            None => fresh_seed(),
        };
        Ok(Sampling {
            // OpenAI's default temperature is 1.
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            logit_bias: self.logit_bias()?,
            seed,
            grammar: self.grammar()?,
        })
    }

    /// OpenAI's `logit_bias`: token ids (as strings) to numbers.
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, GatewayError> {
        let Some(map) = &self.logit_bias else { return Ok(Vec::new()) };
        map.iter()
            .map(|(k, v)| {
                let id = k.trim().parse::<u32>().map_err(|_| invalid(format!("logit_bias: {k:?} is not a token id")))?;
                let b = v.as_f64().ok_or_else(|| invalid(format!("logit_bias of token {id}: {v} is not a number")))?;
                Ok((id, b as f32))
            })
            .collect()
    }

    /// The one structured-output constraint the request sets, if any.
    fn grammar(&self) -> Result<Option<Grammar>, GatewayError> {
        let from_format = match &self.response_format {
            None | Some(ResponseFormat::Text) => None,
            Some(ResponseFormat::JsonObject) => Some(Grammar::JsonObject),
            Some(ResponseFormat::JsonSchema { json_schema }) => {
                let schema = json_schema.schema.as_ref().ok_or_else(|| invalid("response_format.json_schema.schema is required"))?;
                Some(Grammar::JsonSchema(schema.to_string()))
            }
        };
        let all: Vec<Grammar> = [from_format, self.guided_regex.clone().map(Grammar::Regex), self.guided_grammar.clone().map(Grammar::Lark)].into_iter().flatten().collect();
        match all.len() {
            0 | 1 => Ok(all.into_iter().next()),
            _ => Err(invalid("set one of response_format, guided_regex and guided_grammar")),
        }
    }

    fn stop(&self) -> Result<Vec<String>, GatewayError> {
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopInput::One(s)) => vec![s.clone()],
            Some(StopInput::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP {
            return Err(invalid(format!("stop: at most {MAX_STOP} sequences, got {}", stop.len())));
        }
        // Their lengths are checked with the rest of the request (`GenerateParams::validate`).
        Ok(stop)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }
}

impl CompletionRequest {
    /// How many choices each prompt generates, of which the `n` likeliest are answered
    /// (`best_of`, by their tokens' mean log-probability; `n` unless set).
    pub fn best_of(&self) -> u32 {
        self.best_of.unwrap_or(self.common.choices()).max(self.common.choices())
    }

    /// The request's generation for each of its prompts (one, or a batch).
    pub fn params(&self) -> Result<Vec<GenerateParams>, GatewayError> {
        self.common.check_unsupported()?;
        if self.echo && self.common.stream {
            return Err(invalid("echo is supported without stream"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(invalid("suffix is not supported"));
        }
        let n = self.common.choices();
        if let Some(b) = self.best_of.filter(|b| !(n..=MAX_CHOICES).contains(b)) {
            return Err(invalid(format!("best_of must be in [n, {MAX_CHOICES}] (n = {n}), got {b}")));
        }
        if self.best_of() > n && self.common.stream {
            return Err(invalid("best_of above n is answered whole, not streamed"));
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_null()) {
            return Err(invalid("tools are for /v1/chat/completions"));
        }
        let logprobs = self.logprobs.unwrap_or(0);
        if logprobs > MAX_COMPLETION_LOGPROBS {
            return Err(invalid(format!("logprobs must be at most {MAX_COMPLETION_LOGPROBS}, got {logprobs}")));
        }
        let prompts: Vec<Prompt> = match &self.prompt {
            PromptInput::Text(t) => vec![Prompt::Text(t.clone())],
            PromptInput::Ids(ids) => vec![Prompt::Tokens(ids.clone())],
            PromptInput::Texts(v) => v.iter().cloned().map(Prompt::Text).collect(),
            PromptInput::IdLists(v) => v.iter().cloned().map(Prompt::Tokens).collect(),
        };
        if prompts.is_empty() {
            return Err(invalid("prompt: an empty batch"));
        }
        let (sampling, stop) = (self.common.sampling()?, self.common.stop()?);
        let params = |prompt| GenerateParams {
            prompt,
            max_tokens: Some(self.common.max_tokens.unwrap_or(COMPLETION_DEFAULT_MAX_TOKENS)),
            sampling: sampling.clone(),
            stop: stop.clone(),
            // The chosen token's log-probability comes with at least one alternative; best_of
            // ranks the choices by theirs.
            top_logprobs: if self.logprobs.is_some() || self.best_of() > n { logprobs.max(1) } else { 0 },
            session: SessionMode::None,
            ignore_eos: false,
            // Echoed with logprobs, the prompt's tokens are scored too.
            prompt_logprobs: self.echo && self.logprobs.is_some(),
        };
        Ok(prompts.into_iter().map(params).collect())
    }
}

impl ChatRequest {
    /// Alternatives per position the response lists (None: no logprobs).
    pub fn top_logprobs(&self) -> Option<u32> {
        self.logprobs.then(|| self.top_logprobs.unwrap_or(0))
    }

    /// The tools the model may call (`None`: it answers in text), in the model's format.
    pub fn tools(&self, text: &TextModel) -> Result<Option<Tools>, GatewayError> {
        let syntax = ToolSyntax::of_model(text.chat_template.as_ref(), &text.tokenizer);
        Tools::from_request(self.tools.as_deref(), self.tool_choice.as_ref(), self.parallel_tool_calls.unwrap_or(true), syntax).map_err(invalid)
    }

    pub fn params(&self, text: &TextModel) -> Result<GenerateParams, GatewayError> {
        self.common.check_unsupported()?;
        let tools = self.tools(text)?;
        let top = self.top_logprobs.unwrap_or(0);
        if top > MAX_CHAT_TOP_LOGPROBS {
            return Err(invalid(format!("top_logprobs must be at most {MAX_CHAT_TOP_LOGPROBS}, got {top}")));
        }
        if top > 0 && !self.logprobs {
            return Err(invalid("top_logprobs needs logprobs: true"));
        }
        // Earlier calls and tool results go back in the model's own format when its template
        // has one (tools given or not), else in the generic one.
        let native = ToolSyntax::of_model(text.chat_template.as_ref(), &text.tokenizer) != ToolSyntax::Generic;
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        for (i, m) in self.messages.iter().enumerate() {
            let content = message_text(i, m.content.as_ref())?;
            let message = match (m.role.as_str(), &m.tool_calls) {
                ("system" | "developer", _) => ChatMessage::new("system", content),
                ("user", _) => ChatMessage::new("user", content),
                ("assistant", Some(calls)) if !calls.is_empty() && native => {
                    ChatMessage { tool_calls: Some(tools::calls_for_template(calls)), ..ChatMessage::new("assistant", content) }
                }
                ("assistant", Some(calls)) if !calls.is_empty() => ChatMessage::new("assistant", tools::calls_as_text(calls)),
                ("assistant", _) => ChatMessage::new("assistant", content),
                ("tool", _) if native => ChatMessage { tool_call_id: m.tool_call_id.clone(), ..ChatMessage::new("tool", content) },
                // The generic format shows tool results as user turns in its JSON.
                ("tool", _) => ChatMessage::new("user", tools::result_as_text(m.tool_call_id.as_deref(), &content)),
                (other, _) => return Err(invalid(format!("messages[{i}].role {other:?}: expected system, developer, user, assistant or tool"))),
            };
            messages.push(message);
        }
        let mut sampling = self.common.sampling()?;
        let mut template_tools = None;
        if let Some(t) = &tools {
            if sampling.grammar.is_some() {
                return Err(invalid("tools cannot be combined with response_format, guided_regex or guided_grammar"));
            }
            sampling.grammar = t.grammar();
            template_tools = t.template_tools();
            // The generic format describes the functions in the system message (the first one, or a new one).
            if let Some(prompt) = t.system_prompt() {
                match messages.first_mut().filter(|m| m.role == "system") {
                    Some(system) => system.content = format!("{}\n\n{prompt}", system.content),
                    None => messages.insert(0, ChatMessage::new("system", prompt)),
                }
            }
        }
        Ok(GenerateParams {
            prompt: Prompt::Chat { messages, tools: template_tools },
            max_tokens: self.max_completion_tokens.or(self.common.max_tokens),
            sampling,
            stop: self.common.stop()?,
            top_logprobs: if self.logprobs { top.max(1) } else { 0 },
            session: SessionMode::None,
            ignore_eos: false,
            prompt_logprobs: false,
        })
    }
}

/// A message's text: a string, or the concatenated `text` parts of a content list.
fn message_text(i: usize, content: Option<&Value>) -> Result<String, GatewayError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(invalid(format!("messages[{i}].content: only text parts are supported, got {:?}", kind.unwrap_or("?"))))
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(invalid(format!("messages[{i}].content must be a string or a list of text parts"))),
    }
}

/// OpenAI's finish reason.
pub fn finish_reason(r: StopReason) -> &'static str {
    match r {
        StopReason::EndOfGeneration | StopReason::StopString => "stop",
        StopReason::MaxTokens | StopReason::ContextFull => "length",
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct UsageOut {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// How many prompt tokens were not prefilled again (a session's KV, `x-session-id`).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

/// A prompt's tokens: all of them, and those whose KV was already held.
#[derive(Debug, Clone, Copy)]
pub struct PromptTokens {
    pub total: u32,
    pub cached: u32,
}

impl UsageOut {
    pub fn new(prompt: PromptTokens, completion_tokens: u32) -> Self {
        UsageOut {
            prompt_tokens: prompt.total,
            completion_tokens,
            total_tokens: prompt.total + completion_tokens,
            prompt_tokens_details: PromptTokensDetails { cached_tokens: prompt.cached },
        }
    }
}

/// The body of an OpenAI error: `{"error": {"message", "type", "param", "code"}}`.
pub fn error_body(message: &str, kind: &str, code: Option<&str>) -> Value {
    json!({ "error": { "message": message, "type": kind, "param": null, "code": code } })
}
