//! The one interface between the API front ends and what serves them: the [`Backend`] trait
//! (generate, sessions, policy, state, health), and its implementation over the scheduler
//! task, [`SchedulerBackend`]. The front ends hold an `Arc<dyn Backend>`.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::error::GatewayError;
use crate::readiness::{Health, Phase, Readiness};
use crate::request::{Event, GenerateParams, Prompt, ServerInfo, SessionMode, TextModel};
use crate::scheduler::Command;

/// A generation's events, ending after `Finished` or an error; dropping the receiver cancels
/// the generation.
pub type EventStream = mpsc::UnboundedReceiver<Result<Event, GatewayError>>;

/// What the front ends serve from.
#[tonic::async_trait]
pub trait Backend: Send + Sync {
    /// The model's text side (tokenizer, chat template, grammars).
    fn text(&self) -> &TextModel;

    /// The node's phase (loading, serving, draining) and name.
    fn readiness(&self) -> &Readiness;

    /// Starts a generation.
    async fn generate(&self, params: GenerateParams) -> Result<EventStream, GatewayError>;

    /// Ends a session; returns the KV blocks freed.
    async fn close_session(&self, session_id: String) -> Result<u32, GatewayError>;

    /// Switches the balancer's policy from the next step on.
    async fn set_policy(&self, policy: crate::balancer::Policy) -> Result<(), GatewayError>;

    async fn info(&self) -> Result<ServerInfo, GatewayError>;

    /// The node's health now: its phase, then (while serving) its workers and KV.
    async fn health(&self) -> Health {
        match self.readiness().phase() {
            Phase::Loading => return Health::not_serving("loading", "starting the workers and loading the model"),
            Phase::Draining => return Health::not_serving("draining", "shutting down: finishing the requests in flight"),
            Phase::Serving => {}
        }
        match self.info().await {
            Ok(i) if !i.cpu_workers.iter().any(|w| w.ready) => Health::not_serving("no_cpu_worker", "no cpu-worker is serving"),
            Ok(i) if i.kv_full => Health::not_serving("kv_full", "requests are waiting for KV cache space"),
            Ok(_) => Health::serving(),
            Err(e) => Health::not_serving("unavailable", e.to_string()),
        }
    }
}

/// The [`Backend`] over the scheduler task: a cloneable handle sending it commands.
#[derive(Clone)]
pub struct SchedulerBackend {
    commands: mpsc::Sender<Command>,
    text: Arc<TextModel>,
    readiness: Readiness,
}

impl SchedulerBackend {
    pub(crate) fn new(commands: mpsc::Sender<Command>, text: Arc<TextModel>, readiness: Readiness) -> Self {
        SchedulerBackend { commands, text, readiness }
    }

    async fn send(&self, cmd: Command) -> Result<(), GatewayError> {
        if self.readiness.phase() == Phase::Loading {
            return Err(GatewayError::Loading);
        }
        self.commands.send(cmd).await.map_err(|_| GatewayError::ShuttingDown)
    }
}

#[tonic::async_trait]
impl Backend for SchedulerBackend {
    fn text(&self) -> &TextModel {
        &self.text
    }

    fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    async fn generate(&self, mut params: GenerateParams) -> Result<EventStream, GatewayError> {
        params.validate()?;
        if let Some(g) = params.sampling.grammar.clone() {
            // Compiling it and its first mask may take milliseconds for a large schema: off
            // the runtime's workers.
            let text = self.text.clone();
            tokio::task::spawn_blocking(move || text.check_grammar(&g)).await.map_err(|e| GatewayError::Internal(format!("checking the grammar: {e}")))??;
        }
        let biased: Vec<u32> = params.sampling.logit_bias.iter().map(|&(id, _)| id).collect();
        self.text.tokenizer.check_ids(&biased).map_err(|e| GatewayError::InvalidArgument(format!("logit_bias: {e}")))?;
        // Rendering and tokenising happen here, in the caller's task, not in the scheduler's
        // (which stays free to run steps); only a session's turns, which build on the
        // session's conversation, are tokenised there.
        if params.session == SessionMode::None && !matches!(params.prompt, Prompt::Tokens(_)) {
            params.prompt = Prompt::Tokens(self.text.prompt_ids(&params.prompt)?);
        }
        let (tx, rx) = mpsc::unbounded_channel();
        self.send(Command::Generate { params: Box::new(params), events: tx, arrived: std::time::Instant::now() }).await?;
        Ok(rx)
    }

    async fn close_session(&self, session_id: String) -> Result<u32, GatewayError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::CloseSession { session_id, reply: tx }).await?;
        rx.await.map_err(|_| GatewayError::ShuttingDown)?
    }

    async fn set_policy(&self, policy: crate::balancer::Policy) -> Result<(), GatewayError> {
        self.send(Command::SetPolicy { policy }).await
    }

    async fn info(&self) -> Result<ServerInfo, GatewayError> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Info { reply: tx }).await?;
        rx.await.map_err(|_| GatewayError::ShuttingDown)
    }
}
