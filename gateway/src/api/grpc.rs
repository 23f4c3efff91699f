//! The public gRPC API, `duet.v1.Inference`, over a [`Backend`]; plus gRPC health
//! checking and server reflection on the same port.

use std::pin::Pin;
use std::sync::Arc;

use duet_model::chat::ChatMessage;
use duet_model::grammar::Grammar;
use duet_proto::pb::inference_server::{Inference, InferenceServer};
use duet_proto::{pb, Listener};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use super::auth::ApiKey;
use crate::backend::Backend;
use crate::request::{check_session_key, fresh_seed, session_key, Event, GenerateParams, Prompt, Sampling, SessionMode, StopReason, SEED_HEADER, SESSION_HEADER};
use crate::error::GatewayError;
use crate::readiness::Phase;

/// The service.
pub struct InferenceService {
    backend: Arc<dyn Backend>,
}

impl InferenceService {
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        InferenceService { backend }
    }
}

/// The request in the gateway's own terms.
pub fn params_from_proto(r: pb::GenerateRequest) -> Result<GenerateParams, GatewayError> {
    use pb::generate_request::Prompt as P;
    let prompt = match r.prompt {
        Some(P::Text(t)) => Prompt::Text(t),
        Some(P::Tokens(t)) => Prompt::Tokens(t.ids),
        Some(P::Chat(c)) => {
            for m in &c.messages {
                if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
                    return Err(GatewayError::InvalidArgument(format!("chat role {:?}: expected system, user or assistant", m.role)));
                }
            }
            Prompt::Chat { messages: c.messages.into_iter().map(|m| ChatMessage::new(m.role, m.content)).collect(), tools: None }
        }
        None => return Err(GatewayError::InvalidArgument("the prompt is empty: set text, tokens or chat".into())),
    };
    let d = Sampling::default();
    let s = r.sampling.unwrap_or_default();
    let sampling = Sampling {
        temperature: s.temperature.unwrap_or(d.temperature),
        top_k: s.top_k.unwrap_or(d.top_k),
        top_p: s.top_p.unwrap_or(d.top_p),
        min_p: s.min_p.unwrap_or(d.min_p),
        repetition_penalty: s.repetition_penalty.unwrap_or(d.repetition_penalty),
        frequency_penalty: s.frequency_penalty.unwrap_or(d.frequency_penalty),
        presence_penalty: s.presence_penalty.unwrap_or(d.presence_penalty),
        logit_bias: s.logit_bias.iter().map(|(&id, &b)| (id, b)).collect(),
        seed: s.seed.unwrap_or_else(fresh_seed),
        grammar: s.constraint.as_ref().map(Grammar::try_from).transpose().map_err(|e| GatewayError::InvalidArgument(e.to_string()))?,
    };
    let session = match (r.session_id, r.create_session) {
        (Some(id), _) => SessionMode::Continue(id),
        (None, true) => SessionMode::Create(None),
        (None, false) => SessionMode::None,
    };
    Ok(GenerateParams {
        prompt,
        max_tokens: r.max_tokens,
        sampling,
        stop: r.stop,
        top_logprobs: r.top_logprobs,
        session,
        ignore_eos: r.ignore_eos,
        prompt_logprobs: r.prompt_logprobs,
    })
}

fn stop_reason(r: StopReason) -> pb::StopReason {
    match r {
        StopReason::EndOfGeneration => pb::StopReason::EndOfGeneration,
        StopReason::MaxTokens => pb::StopReason::MaxTokens,
        StopReason::StopString => pb::StopReason::StopString,
        StopReason::ContextFull => pb::StopReason::ContextFull,
    }
}

fn ns(d: std::time::Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

/// The `x-session-id` metadata (what a balancer routes on), checked.
fn session_metadata<T>(req: &Request<T>) -> Result<Option<String>, GatewayError> {
    let Some(v) = req.metadata().get(SESSION_HEADER) else { return Ok(None) };
    let id = v.to_str().map_err(|_| GatewayError::InvalidArgument(format!("the {SESSION_HEADER} metadata is not visible ASCII")))?;
    check_session_key(session_key(id))?;
    Ok(Some(id.to_string()))
}

impl InferenceService {
    fn response(&self, ev: Event) -> pb::GenerateResponse {
        use pb::generate_response::Event as E;
        let event = match ev {
            Event::Prompt { prompt_ids, session_id, cached_tokens } => {
                E::Prompt(pb::PromptInfo { prompt_ids, session_id: session_id.unwrap_or_default(), cached_tokens })
            }
            Event::Token { id, text, logprob, top } => E::Token(self.token(id, text, logprob, top)),
            Event::PromptLogprobs { tokens } => E::PromptLogprobs(pb::PromptLogprobs {
                tokens: tokens.into_iter().map(|t| self.token(t.id, self.backend.text().piece(t.id), Some(t.logprob), t.top)).collect(),
            }),
            Event::Finished { reason, text, usage } => E::Finished(pb::Finished {
                reason: stop_reason(reason) as i32,
                text,
                usage: Some(pb::Usage {
                    prompt_tokens: usage.prompt_tokens,
                    prefilled_tokens: usage.prefilled_tokens,
                    generated_tokens: usage.generated_tokens,
                    time_to_first_token_ns: ns(usage.time_to_first_token),
                    total_time_ns: ns(usage.total_time),
                }),
            }),
        };
        pb::GenerateResponse { event: Some(event) }
    }

    /// A token with its log-probability and its alternatives, as the API shows one.
    fn token(&self, id: u32, text: String, logprob: Option<f32>, top: Vec<(u32, f32)>) -> pb::GeneratedToken {
        let top_logprobs = top.into_iter().map(|(id, logprob)| pb::TokenLogprob { id, logprob, text: self.backend.text().piece(id) }).collect();
        pb::GeneratedToken { id, text, logprob, top_logprobs }
    }
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Inference for InferenceService {
    type GenerateStream = GenerateStream;

    async fn generate(&self, req: Request<pb::GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        let key = session_metadata(&req)?;
        let mut params = params_from_proto(req.into_inner())?;
        // A new session is named by the key the balancer routed on, so that its later turns
        // (routed on the same key) come back to this node.
        if let (SessionMode::Create(name), Some(key)) = (&mut params.session, key) {
            *name = Some(session_key(&key).to_string());
        }
        let seed = params.sampling.seed;
        let mut rx = self.backend.generate(params).await?;
        // The first event decides the status: a request refused before it starts (bad
        // prompt, unknown session, too large) fails the call itself.
        let first = match rx.recv().await {
            Some(Ok(ev)) => ev,
            Some(Err(e)) => return Err(e.into()),
            None => return Err(GatewayError::Internal("the scheduler dropped the request".into()).into()),
        };
        let first = self.response(first);
        let this = InferenceService { backend: self.backend.clone() };
        let rest = tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
            .map(move |ev| ev.map(|e| this.response(e)).map_err(Status::from));
        let mut response = Response::new(Box::pin(tokio_stream::once(Ok(first)).chain(rest)) as GenerateStream);
        // The seed it samples with, in the response's metadata (see SEED_HEADER).
        response.metadata_mut().insert(SEED_HEADER, seed.into());
        Ok(response)
    }

    async fn tokenize(&self, req: Request<pb::TokenizeRequest>) -> Result<Response<pb::TokenizeResponse>, Status> {
        let r = req.into_inner();
        let tok = &self.backend.text().tokenizer;
        let parse_special = r.parse_special.unwrap_or(true);
        let ids = if r.add_special.unwrap_or(true) { tok.encode_prompt(&r.text, parse_special) } else { tok.encode(&r.text, parse_special) }
            .map_err(GatewayError::from)?;
        let pieces = ids.iter().map(|&id| self.backend.text().piece(id)).collect();
        Ok(Response::new(pb::TokenizeResponse { ids, pieces }))
    }

    async fn detokenize(&self, req: Request<pb::DetokenizeRequest>) -> Result<Response<pb::DetokenizeResponse>, Status> {
        let ids = req.into_inner().ids;
        let text = self.backend.text().tokenizer.decode(&ids).map_err(GatewayError::from)?;
        Ok(Response::new(pb::DetokenizeResponse { text }))
    }

    async fn close_session(&self, req: Request<pb::CloseSessionRequest>) -> Result<Response<pb::CloseSessionResponse>, Status> {
        let freed_blocks = self.backend.close_session(req.into_inner().session_id).await?;
        Ok(Response::new(pb::CloseSessionResponse { freed_blocks }))
    }

    async fn set_policy(&self, req: Request<pb::SetPolicyRequest>) -> Result<Response<pb::SetPolicyResponse>, Status> {
        let policy = req.into_inner().policy.parse().map_err(GatewayError::InvalidArgument)?;
        let previous = self.backend.info().await?.policy;
        self.backend.set_policy(policy).await?;
        Ok(Response::new(pb::SetPolicyResponse { previous }))
    }

    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
        let i = self.backend.info().await?;
        let bs = i.kv_block_size as u64;
        Ok(Response::new(pb::InfoResponse {
            model: i.model,
            context_length: i.context_length,
            vocab_size: i.vocab_size,
            gpu_device: i.gpu_device,
            kv_capacity_tokens: i.cpu_workers.iter().map(|w| w.kv_blocks as u64 * bs).sum(),
            kv_free_tokens: i.cpu_workers.iter().map(|w| w.kv_blocks_free as u64 * bs).sum(),
            cpu_workers: i
                .cpu_workers
                .into_iter()
                .map(|w| pb::CpuWorkerInfo {
                    worker: w.worker,
                    kv_blocks: w.kv_blocks,
                    kv_blocks_free: w.kv_blocks_free,
                    ready: w.ready,
                    restarts: w.restarts,
                })
                .collect(),
            kv_block_size: i.kv_block_size,
            sessions: i.sessions,
            active_requests: i.active_requests,
            policy: i.policy,
            step_prediction_error_p50: i.prediction_error.map(|e| e.0),
            step_prediction_error_p90: i.prediction_error.map(|e| e.1),
            prefilled_tokens_total: i.prefilled_tokens_total,
            generated_tokens_total: i.generated_tokens_total,
            synthetic_prefill: i.synthetic_prefill,
        }))
    }
}

/// Keeps gRPC health (the server as a whole, "", and `duet.v1.Inference`) saying what
/// `/health` says: checked at each change of phase and every second; ends once draining.
async fn report_health(reporter: tonic_health::server::HealthReporter, backend: Arc<dyn Backend>) {
    use tonic_health::ServingStatus;
    let mut phase = backend.readiness().subscribe();
    let mut last = None;
    loop {
        let now = backend.readiness().phase();
        let health = backend.health().await;
        let status = if health.serving { ServingStatus::Serving } else { ServingStatus::NotServing };
        if last != Some(status) {
            tracing::info!(status = health.status, detail = %health.detail, "health");
            for service in ["", <InferenceServer<InferenceService> as tonic::server::NamedService>::NAME] {
                reporter.set_service_status(service, status).await;
            }
            last = Some(status);
        }
        backend.readiness().reported(now);
        if now == Phase::Draining {
            return;
        }
        tokio::select! {
            changed = phase.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
        }
    }
}

/// Serves the public API with health and reflection on `listener` until `shutdown`; with an
/// API key, Inference calls must carry it (health and reflection stay open for probes).
pub async fn serve(
    backend: Arc<dyn Backend>,
    listener: Listener,
    api_key: Option<ApiKey>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(report_health(reporter, backend.clone()));
    // Reflection in both versions: grpcurl and grpcio's reflection package still speak v1alpha.
    // It lists only what this port serves: the workers' services share the descriptor set
    // but are not served here.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .with_service_name("duet.v1.Inference")
            .with_service_name("grpc.health.v1.Health")
            .with_service_name("grpc.reflection.v1.ServerReflection")
            .with_service_name("grpc.reflection.v1alpha.ServerReflection")
    };
    let reflection_v1 = reflection().build_v1().expect("the compiled-in descriptor sets are valid");
    let reflection_v1alpha = reflection().build_v1alpha().expect("the compiled-in descriptor sets are valid");
    let builder =
        tonic::transport::Server::builder().add_service(health).add_service(reflection_v1).add_service(reflection_v1alpha);
    match api_key {
        Some(key) => {
            let router = builder.add_service(InferenceServer::with_interceptor(InferenceService::new(backend), key.interceptor()));
            listener.serve(router, shutdown).await
        }
        None => listener.serve(builder.add_service(InferenceServer::new(InferenceService::new(backend))), shutdown).await,
    }
}
