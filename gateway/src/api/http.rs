//! The OpenAI-compatible HTTP API (axum): `POST /v1/completions`, `POST /v1/chat/completions`
//! (both with SSE streaming ending in `data: [DONE]`), `GET /v1/models`, `GET /health`,
//! Prometheus `GET /metrics` and the tokenizer (`tokenizer`); optional bearer-token auth on
//! `/v1/*` and the tokenizer. Errors are OpenAI's
//! JSON error shape; the HTTP status of each gateway error is chosen here and only here.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use futures_util::{Stream, StreamExt};

use super::auth::ApiKey;
use super::openai::{error_body, finish_reason, ChatRequest, CompletionRequest, PromptTokens, UsageOut};
use super::tools::{Reply, Tools};
use crate::backend::Backend;
use crate::request::{check_session_key, session_key, Event, GenerateParams, Prompt, SessionMode, SEED_HEADER, SESSION_HEADER};
use crate::error::GatewayError;

mod tokenizer;

/// What the handlers share.
struct AppState {
    backend: Arc<dyn Backend>,
    model: String,
    created: u64,
    metrics: PrometheusHandle,
}

/// An error answered in OpenAI's shape.
pub struct ApiError {
    status: StatusCode,
    body: Value,
}

impl ApiError {
    fn new(status: StatusCode, kind: &str, code: Option<&str>, message: &str) -> Self {
        ApiError { status, body: error_body(message, kind, code) }
    }
}

impl From<GatewayError> for ApiError {
    fn from(e: GatewayError) -> Self {
        let msg = e.to_string();
        let (status, kind, code) = match e {
            GatewayError::InvalidArgument(_) => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
            GatewayError::PromptTooLong { .. } | GatewayError::ContextExceeded { .. } => (StatusCode::BAD_REQUEST, "invalid_request_error", Some("context_length_exceeded")),
            GatewayError::ResourceExhausted(_) => (StatusCode::TOO_MANY_REQUESTS, "insufficient_resources", None),
            GatewayError::UnknownSession(_) => (StatusCode::NOT_FOUND, "invalid_request_error", Some("session_not_found")),
            GatewayError::SessionBusy(_) => (StatusCode::CONFLICT, "invalid_request_error", Some("session_busy")),
            GatewayError::SessionLost { .. } => (StatusCode::GONE, "invalid_request_error", Some("session_lost")),
            GatewayError::SessionExists(_) => (StatusCode::CONFLICT, "invalid_request_error", Some("session_exists")),
            // RFC 9110's "directed at a server that cannot produce an authoritative response".
            GatewayError::SessionElsewhere { .. } => (StatusCode::MISDIRECTED_REQUEST, "invalid_request_error", Some("session_elsewhere")),
            GatewayError::Unavailable(_) | GatewayError::Loading | GatewayError::ShuttingDown => {
                (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", None)
            }
            GatewayError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        ApiError::new(status, kind, code, &msg)
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        if body_timed_out(&r) {
            return ApiError::new(StatusCode::REQUEST_TIMEOUT, "invalid_request_error", Some("request_timeout"), "the request body stalled: it was not sent within the server's HTTP timeout");
        }
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", Some("request_too_large"), &format!("the request body is too large: {}", r.body_text()));
        }
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", None, &format!("invalid request body: {}", r.body_text()))
    }
}

/// Whether the body could not be read because it stalled (the HTTP server's body timeout).
fn body_timed_out(r: &JsonRejection) -> bool {
    let mut e: Option<&(dyn std::error::Error + 'static)> = Some(r);
    while let Some(err) = e {
        if err.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        e = err.source();
    }
    false
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}

/// The HTTP application over `backend`.
pub fn router(backend: Arc<dyn Backend>, model: String, api_key: Option<ApiKey>, metrics: PrometheusHandle) -> Router {
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let state = Arc::new(AppState { backend, model, created, metrics });
    // The key is checked on everything under /v1, unknown paths included: without it, a
    // client learns nothing (not even which paths exist).
    let api_key = api_key.map(Arc::new);
    let v1 = Router::new()
        .route("/completions", post(completions))
        .route("/chat/completions", post(chat_completions))
        .route("/models", get(models))
        .fallback(no_such_endpoint)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(api_key.clone(), require_key));
    let tokenizer = Router::new()
        .route("/tokenize", post(tokenizer::tokenize))
        .route("/detokenize", post(tokenizer::detokenize))
        .route("/tokenizer_info", get(tokenizer::tokenizer_info))
        .layer(middleware::from_fn_with_state(api_key, require_key));
    Router::new()
        .nest("/v1", v1)
        .merge(tokenizer)
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(no_such_endpoint)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn no_such_endpoint() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", Some("not_found"), "no such endpoint")
}

async fn method_not_allowed(req: Request) -> ApiError {
    let msg = format!("{} is not allowed on {}", req.method(), req.uri().path());
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", Some("method_not_allowed"), &msg)
}

/// `Authorization: Bearer <key>` on `/v1/*` when a key is set.
async fn require_key(State(key): State<Option<Arc<ApiKey>>>, headers: HeaderMap, req: Request, next: Next) -> Response {
    if let Some(key) = key {
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        if !key.accepts_header(given) {
            return ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", Some("invalid_api_key"), "a valid API key is required: Authorization: Bearer <key>")
                .into_response();
        }
    }
    next.run(req).await
}

/// 200 while this node should be sent requests, else 503; the body says why, and names the
/// node (balancers and Kubernetes probes read the status).
async fn health(State(s): State<Arc<AppState>>) -> Response {
    let h = s.backend.health().await;
    let code = if h.serving { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(json!({ "status": h.status, "detail": h.detail, "node": &*s.backend.readiness().node }))).into_response()
}

async fn metrics_text(State(s): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], s.metrics.render()).into_response()
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{ "id": s.model, "object": "model", "created": s.created, "owned_by": "duet" }],
    }))
}

fn check_model(s: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != s.model => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("model_not_found"),
            &format!("the model {m:?} does not exist: this server serves {:?}", s.model),
        )),
        _ => Ok(()),
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn new_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    format!("{prefix}-{t:x}{n:04x}")
}

type Events = mpsc::UnboundedReceiver<Result<Event, GatewayError>>;

/// A generation begun: its prompt's token count, the tokens prefilled, the session the
/// request keeps its KV in, and the remaining events.
struct Started {
    prompt_tokens: PromptTokens,
    prompt_ids: Vec<u32>,
    session: Option<String>,
    rx: Events,
}

/// Starts a generation; a request refused before it starts fails the call itself.
async fn start(s: &AppState, params: GenerateParams) -> Result<Started, ApiError> {
    let mut rx = s.backend.generate(params).await?;
    match rx.recv().await {
        Some(Ok(Event::Prompt { prompt_ids, cached_tokens, session_id })) => {
            let prompt_tokens = PromptTokens { total: prompt_ids.len() as u32 + cached_tokens, cached: cached_tokens };
            Ok(Started { prompt_tokens, prompt_ids, session: session_id, rx })
        }
        Some(Ok(_)) => Err(GatewayError::Internal("a generation began without its prompt".into()).into()),
        Some(Err(e)) => Err(e.into()),
        None => Err(GatewayError::Internal("the scheduler dropped the request".into()).into()),
    }
}

/// The session a request keeps its KV in: the `x-session-id` header's key or id, if any.
fn session_of(headers: &HeaderMap) -> Result<SessionMode, ApiError> {
    let Some(v) = headers.get(SESSION_HEADER) else { return Ok(SessionMode::None) };
    let id = v.to_str().map_err(|_| GatewayError::InvalidArgument(format!("the {SESSION_HEADER} header is not visible ASCII")))?;
    check_session_key(session_key(id))?;
    Ok(SessionMode::Conversation(id.to_string()))
}

/// Which logprobs shape a response carries.
#[derive(Clone, Copy)]
enum LogprobStyle {
    None,
    /// `/v1/completions`: tokens, token_logprobs, top_logprobs (maps), text_offset.
    Completion(u32),
    /// `/v1/chat/completions`: content: [{token, logprob, bytes, top_logprobs}].
    Chat(u32),
}

/// A token as logprobs show it: its text (lossy UTF-8) and its own bytes (part of a
/// character, for a token that splits one).
struct Piece {
    text: String,
    bytes: Vec<u8>,
}

impl Piece {
    fn of(s: &AppState, id: u32) -> Piece {
        let bytes = s.backend.text().piece_bytes(id);
        Piece { text: String::from_utf8_lossy(&bytes).into_owned(), bytes }
    }
}

/// Logprobs of a run of tokens, in the response's shape.
#[derive(Default)]
struct Logprobs {
    tokens: Vec<Piece>,
    /// NaN (shown as null) where there is none: an echoed prompt's first token.
    token_logprobs: Vec<f32>,
    /// `None` (null) where there are none: an echoed prompt's first token.
    top: Vec<Option<Vec<(Piece, f32)>>>,
}

impl Logprobs {
    fn push(&mut self, s: &AppState, style: LogprobStyle, id: u32, logprob: Option<f32>, top: &[(u32, f32)]) {
        self.push_maybe(s, style, id, logprob, Some(top));
    }

    /// [`Self::push`], with no alternatives (`None`) for a token that has no context.
    fn push_maybe(&mut self, s: &AppState, style: LogprobStyle, id: u32, logprob: Option<f32>, top: Option<&[(u32, f32)]>) {
        let n = match style {
            LogprobStyle::None => return,
            LogprobStyle::Completion(n) | LogprobStyle::Chat(n) => n as usize,
        };
        self.tokens.push(Piece::of(s, id));
        self.token_logprobs.push(logprob.unwrap_or(f32::NAN));
        self.top.push(top.map(|top| top.iter().take(n).map(|&(t, lp)| (Piece::of(s, t), lp)).collect()));
    }

    fn to_json(&self, style: LogprobStyle, text_start: usize) -> Value {
        match style {
            LogprobStyle::None => Value::Null,
            LogprobStyle::Completion(_) => {
                let mut offset = text_start;
                let offsets: Vec<usize> = self
                    .tokens
                    .iter()
                    .map(|t| {
                        let o = offset;
                        offset += t.text.len();
                        o
                    })
                    .collect();
                let top: Vec<Value> = self
                    .top
                    .iter()
                    .map(|alts| alts.as_ref().map_or(Value::Null, |alts| Value::Object(alts.iter().map(|(t, lp)| (t.text.clone(), json!(lp))).collect())))
                    .collect();
                let tokens: Vec<&str> = self.tokens.iter().map(|t| t.text.as_str()).collect();
                json!({ "tokens": tokens, "token_logprobs": self.token_logprobs, "top_logprobs": top, "text_offset": offsets })
            }
            LogprobStyle::Chat(_) => {
                let entry = |t: &Piece, lp: f32| json!({ "token": t.text, "logprob": lp, "bytes": t.bytes });
                let content: Vec<Value> = self
                    .tokens
                    .iter()
                    .zip(&self.token_logprobs)
                    .zip(&self.top)
                    .map(|((t, &lp), alts)| {
                        let mut e = entry(t, lp);
                        e["top_logprobs"] = Value::Array(alts.iter().flatten().map(|(t, lp)| entry(t, *lp)).collect());
                        e
                    })
                    .collect();
                json!({ "content": content })
            }
        }
    }
}

/// How a response is shaped: the endpoint, its logprobs, whether a stream ends with usage,
/// whether the reply is read as tool calls.
#[derive(Clone)]
struct Shape {
    endpoint: Endpoint,
    style: LogprobStyle,
    include_usage: bool,
    /// The tools the reply may call: it is read back as calls or text.
    tools: Option<Tools>,
    /// A completion's prompt comes back before its text (`echo`).
    echo: bool,
}

/// What one endpoint's responses look like.
#[derive(Clone, Copy)]
enum Endpoint {
    Completion,
    Chat,
}

impl Endpoint {
    fn object(self, stream: bool) -> &'static str {
        match (self, stream) {
            (Endpoint::Completion, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    /// Choice `index` carrying `text` (whole or a delta).
    fn choice(self, index: usize, text: &str, logprobs: Value, finish: Option<&str>, stream: bool) -> Value {
        match (self, stream) {
            (Endpoint::Completion, _) => json!({ "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish }),
            (Endpoint::Chat, false) => json!({
                "index": index,
                "message": { "role": "assistant", "content": text },
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            (Endpoint::Chat, true) => {
                let delta = if finish.is_some() && text.is_empty() { json!({}) } else { json!({ "content": text }) };
                json!({ "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish })
            }
        }
    }
}

async fn completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    check_model(&s, req.common.model.as_deref())?;
    let mut prompts = req.params()?;
    let session = session_of(&headers)?;
    prompts.iter_mut().for_each(|p| p.session = session.clone());
    let style = if req.logprobs.is_some() { LogprobStyle::Completion(req.logprobs.unwrap_or(0)) } else { LogprobStyle::None };
    let shape = Shape { endpoint: Endpoint::Completion, style, include_usage: req.common.include_usage(), tools: None, echo: req.echo };
    respond(s, shape, prompts, Choices { n: req.common.choices(), best_of: req.best_of() }, req.common.stream).await
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    check_model(&s, req.common.model.as_deref())?;
    let mut params = req.params(s.backend.text())?;
    params.session = session_of(&headers)?;
    let tools = req.tools(s.backend.text())?;
    let style = req.top_logprobs().map_or(LogprobStyle::None, LogprobStyle::Chat);
    let shape = Shape { endpoint: Endpoint::Chat, style, include_usage: req.common.include_usage(), tools, echo: false };
    let n = req.common.choices();
    respond(s, shape, vec![params], Choices { n, best_of: n }, req.common.stream).await
}

/// Answers `n` choices for each of `prompts` (a completion's batch of prompts, or one): of
/// `best_of` generated for each, the likeliest ([`likeliest`]). Each generation is a sequence
/// of its own sampled with the request's seed plus its index (prompt-major: prompt `p`'s
/// generation `i` is `p * best_of + i`); with a session, the `x-session-id`
/// response header names it (`key@node`: send it back to continue the session on this node);
/// `x-duet-seed` reports the seed the first choice sampled with.
async fn respond(s: Arc<AppState>, shape: Shape, prompts: Vec<GenerateParams>, choices: Choices, stream: bool) -> Result<Response, ApiError> {
    let Choices { n, best_of } = choices;
    let seed = prompts.first().map_or(0, |p| p.sampling.seed);
    let choices = prompts.len() * best_of as usize;
    if choices > 1 && prompts.iter().any(|p| p.session != SessionMode::None) {
        return Err(GatewayError::InvalidArgument(format!("{choices} choices: a session's conversation takes one prompt and one choice (n = 1)")).into());
    }
    if choices > MAX_GENERATIONS {
        return Err(GatewayError::InvalidArgument(format!("{} prompts of {best_of} choices: at most {MAX_GENERATIONS} choices a request", prompts.len())).into());
    }
    let generations = prompts.iter().flat_map(|p| std::iter::repeat_n(p, best_of as usize)).enumerate().map(|(i, params)| {
        let mut p = params.clone();
        // Below 2^63, as every seed reported back (OpenAI's `seed` is a signed integer).
        p.sampling.seed = seed.wrapping_add(i as u64) & (u64::MAX >> 1);
        start(&s, p)
    });
    // One failing to start drops the others' receivers, which cancels them.
    let started = futures_util::future::try_join_all(generations).await?;
    // Each prompt counts once, however many choices it has.
    let firsts = || started.iter().step_by(best_of as usize);
    let prompt_tokens = PromptTokens { total: firsts().map(|g| g.prompt_tokens.total).sum(), cached: firsts().map(|g| g.prompt_tokens.cached).sum() };
    let session = started[0].session.clone();
    // Echoed, each choice's prompt as sent: its text, or its tokens' text.
    let echoes: Vec<Option<Echo>> = started
        .iter()
        .zip(prompts.iter().flat_map(|p| std::iter::repeat_n(&p.prompt, best_of as usize)))
        .map(|(g, prompt)| {
            shape.echo.then(|| {
                let text = match prompt {
                    Prompt::Text(t) => t.clone(),
                    _ => String::from_utf8_lossy(&g.prompt_ids.iter().flat_map(|&id| s.backend.text().piece_bytes(id)).collect::<Vec<u8>>()).into_owned(),
                };
                Echo { text, ids: g.prompt_ids.clone() }
            })
        })
        .collect();
    let rxs: Vec<Events> = started.into_iter().map(|g| g.rx).collect();
    let id = new_id(match shape.endpoint {
        Endpoint::Completion => "cmpl",
        Endpoint::Chat => "chatcmpl",
    });
    let mut response = if stream {
        let events = sse_events(s, shape, id, prompt_tokens, rxs);
        Sse::new(events).keep_alive(KeepAlive::default()).into_response()
    } else {
        let all = futures_util::future::try_join_all(rxs.into_iter().zip(echoes).enumerate().map(|(i, (rx, echo))| whole_choice(&s, &shape, i, echo, rx))).await?;
        let generated = all.iter().map(|c| c.generated).sum();
        let choices = likeliest(all, n as usize, best_of as usize);
        Json(json!({
            "id": id,
            "object": shape.endpoint.object(false),
            "created": unix_now(),
            "model": s.model,
            "choices": choices,
            "usage": UsageOut::new(prompt_tokens, generated),
        }))
        .into_response()
    };
    if let Some(v) = session.and_then(|id| header::HeaderValue::from_str(&id).ok()) {
        response.headers_mut().insert(SESSION_HEADER, v);
    }
    response.headers_mut().insert(SEED_HEADER, header::HeaderValue::from(seed));
    Ok(response)
}

/// How many choices a request answers for each prompt (`n`), of how many generated (`best_of`).
struct Choices {
    n: u32,
    best_of: u32,
}

/// A choice answered whole: its JSON, its generated tokens and their log-probabilities' sum.
struct Whole {
    json: Value,
    generated: u32,
    logprob: f64,
}

/// The `n` likeliest of each prompt's `best_of` choices (by their tokens' mean
/// log-probability), in that order, numbered prompt-major; all of them where `n` is `best_of`.
fn likeliest(all: Vec<Whole>, n: usize, best_of: usize) -> Vec<Value> {
    let mut out = Vec::with_capacity(all.len() / best_of.max(1) * n);
    let mut all = all.into_iter();
    loop {
        let mut group: Vec<Whole> = all.by_ref().take(best_of).collect();
        if group.is_empty() {
            return out;
        }
        if n < best_of {
            let mean = |w: &Whole| w.logprob / f64::from(w.generated.max(1));
            group.sort_by(|a, b| mean(b).total_cmp(&mean(a)));
        }
        for mut w in group.into_iter().take(n) {
            w.json["index"] = json!(out.len());
            out.push(w.json);
        }
    }
}

/// The most choices one request may run (prompts times `best_of`): each is a sequence of its own.
const MAX_GENERATIONS: usize = 64;

/// An echoed prompt: its text, and its tokens for the logprobs.
struct Echo {
    text: String,
    ids: Vec<u32>,
}

/// Waits for choice `index`'s whole generation: its JSON and its generated tokens; with
/// tools, the reply is read as tool calls or text (see `tools`). Echoed, the prompt comes
/// first, in the text and in the logprobs: its first token with none, the others scored.
async fn whole_choice(s: &AppState, shape: &Shape, index: usize, echo: Option<Echo>, mut rx: Events) -> Result<Whole, ApiError> {
    let (mut text, mut logprobs, mut generated, mut logprob_sum) = (String::new(), Logprobs::default(), 0u32, 0f64);
    if let Some(echo) = echo {
        text = echo.text;
        if let Some(&first) = echo.ids.first() {
            logprobs.push_maybe(s, shape.style, first, None, None);
        }
    }
    loop {
        match rx.recv().await {
            Some(Ok(Event::PromptLogprobs { tokens })) => {
                for t in tokens {
                    logprobs.push(s, shape.style, t.id, Some(t.logprob), &t.top);
                }
            }
            Some(Ok(Event::Token { id, text: t, logprob, top })) => {
                generated += 1;
                logprob_sum += f64::from(logprob.unwrap_or(0.0));
                text.push_str(&t);
                logprobs.push(s, shape.style, id, logprob, &top);
            }
            Some(Ok(Event::Finished { reason, text: rest, usage })) => {
                text.push_str(&rest);
                let lp = logprobs.to_json(shape.style, 0);
                let choice = match shape.tools.as_ref().map(|t| t.read_reply(&text)) {
                    Some(Reply::Calls { content, calls }) => json!({
                        "index": index,
                        "message": { "role": "assistant", "content": content, "tool_calls": calls },
                        "logprobs": lp,
                        "finish_reason": "tool_calls",
                    }),
                    Some(Reply::Text(t)) => shape.endpoint.choice(index, &t, lp, Some(finish_reason(reason)), false),
                    None => shape.endpoint.choice(index, &text, lp, Some(finish_reason(reason)), false),
                };
                return Ok(Whole { json: choice, generated: usage.generated_tokens, logprob: logprob_sum });
            }
            Some(Ok(Event::Prompt { .. })) => {}
            Some(Err(e)) => return Err(e.into()),
            None => return Err(GatewayError::Internal(format!("the generation ended without finishing after {generated} tokens")).into()),
        }
    }
}

/// What the stream of a choice has sent so far.
#[derive(Default)]
struct ChoiceStream {
    /// Bytes of text sent (completion logprobs' `text_offset`).
    text_offset: usize,
    /// With tools, the reply held back until it is whole.
    held: String,
}

/// The SSE stream of a generation's choices: one chunk per token (text deltas, each with its
/// choice's index), a last chunk per choice with its finish reason, once every choice has
/// finished a usage chunk if asked, then `[DONE]`. With `tools` each reply is held back and
/// sent whole when it ends: one chunk of tool calls (or of the answer's text). An error after
/// the stream began is sent as an OpenAI error object before `[DONE]`, and ends the stream.
/// Dropping the stream (the client went away, or it ended) drops the event receivers, which
/// cancels the generations still running and frees their KV.
fn sse_events(s: Arc<AppState>, shape: Shape, id: String, prompt_tokens: PromptTokens, rxs: Vec<Events>) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let n = rxs.len();
    let merged = futures_util::stream::select_all(rxs.into_iter().enumerate().map(|(i, rx)| UnboundedReceiverStream::new(rx).map(move |ev| (i, ev))));
    let state = SseChoices {
        s,
        created: unix_now(),
        id,
        prompt_tokens,
        choices: (0..n).map(|_| ChoiceStream::default()).collect(),
        opened: false,
        finished: 0,
        generated: 0,
        ended: false,
        shape,
    };
    futures_util::stream::unfold((state, merged), |(mut st, mut merged)| async move {
        if st.ended {
            return None;
        }
        let (i, ev) = merged.next().await?;
        let out = st.step(i, ev);
        Some((futures_util::stream::iter(out.into_iter().map(Ok)), (st, merged)))
    })
    .flatten()
}

/// The state of [`sse_events`]' stream.
struct SseChoices {
    s: Arc<AppState>,
    shape: Shape,
    id: String,
    created: u64,
    prompt_tokens: PromptTokens,
    choices: Vec<ChoiceStream>,
    /// Whether the opening chunks were sent.
    opened: bool,
    finished: usize,
    /// Tokens generated by the choices that finished.
    generated: u32,
    /// `[DONE]` was sent.
    ended: bool,
}

impl SseChoices {
    fn chunk(&self, choices: Value, usage: Option<UsageOut>) -> SseEvent {
        let mut v = json!({ "id": self.id, "object": self.shape.endpoint.object(true), "created": self.created, "model": self.s.model, "choices": choices });
        if self.shape.include_usage {
            v["usage"] = usage.map_or(Value::Null, |u| json!(u));
        }
        SseEvent::default().data(v.to_string())
    }

    /// The chunks event `ev` of choice `i` sends.
    fn step(&mut self, i: usize, ev: Result<Event, GatewayError>) -> Vec<SseEvent> {
        let (endpoint, style) = (self.shape.endpoint, self.shape.style);
        let mut out: Vec<SseEvent> = Vec::new();
        if !self.opened {
            self.opened = true;
            if matches!(endpoint, Endpoint::Chat) {
                // Chat streams open with the assistant's role, for each choice.
                for index in 0..self.choices.len() {
                    out.push(self.chunk(json!([{ "index": index, "delta": { "role": "assistant", "content": "" }, "logprobs": null, "finish_reason": null }]), None));
                }
            }
        }
        let holding = self.shape.tools.is_some();
        let done = match ev {
            Ok(Event::Token { text, .. }) if holding => {
                self.choices[i].held.push_str(&text);
                None
            }
            Ok(Event::Finished { reason, text, usage }) if holding => {
                let held = &mut self.choices[i].held;
                held.push_str(&text);
                let reply = self.shape.tools.as_ref().map_or_else(|| Reply::Text(held.clone()), |t| t.read_reply(held));
                let (delta, finish) = match reply {
                    Reply::Calls { content, calls } => {
                        let calls: Vec<Value> = calls.into_iter().enumerate().map(|(k, mut call)| {
                            call["index"] = json!(k);
                            call
                        }).collect();
                        (json!({ "content": content, "tool_calls": calls }), "tool_calls")
                    }
                    Reply::Text(t) => (json!({ "content": t }), finish_reason(reason)),
                };
                out.push(self.chunk(json!([{ "index": i, "delta": delta, "logprobs": null, "finish_reason": null }]), None));
                out.push(self.chunk(json!([{ "index": i, "delta": {}, "logprobs": null, "finish_reason": finish }]), None));
                Some(usage.generated_tokens)
            }
            Ok(Event::Token { id: tok, text, logprob, top }) => {
                let mut lp = Logprobs::default();
                lp.push(&self.s, style, tok, logprob, &top);
                if !text.is_empty() || !matches!(style, LogprobStyle::None) {
                    out.push(self.chunk(json!([endpoint.choice(i, &text, lp.to_json(style, self.choices[i].text_offset), None, true)]), None));
                }
                self.choices[i].text_offset += text.len();
                None
            }
            Ok(Event::Finished { reason, text, usage }) => {
                out.push(self.chunk(json!([endpoint.choice(i, &text, Value::Null, Some(finish_reason(reason)), true)]), None));
                Some(usage.generated_tokens)
            }
            // Asked for only by echoed completions, which do not stream.
            Ok(Event::Prompt { .. } | Event::PromptLogprobs { .. }) => None,
            Err(e) => {
                out.push(SseEvent::default().data(ApiError::from(e).body.to_string()));
                out.push(SseEvent::default().data("[DONE]"));
                self.ended = true;
                None
            }
        };
        if let Some(tokens) = done {
            (self.finished, self.generated) = (self.finished + 1, self.generated + tokens);
            if self.finished == self.choices.len() {
                if self.shape.include_usage {
                    out.push(self.chunk(json!([]), Some(UsageOut::new(self.prompt_tokens, self.generated))));
                }
                out.push(SseEvent::default().data("[DONE]"));
                self.ended = true;
            }
        }
        out
    }
}
