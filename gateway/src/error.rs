//! The gateway's error type, one variant per thing that can go wrong with a request or the
//! service, and its mapping to gRPC status codes (the only place that mapping lives).

use tonic::Status;

#[derive(Debug, Clone, thiserror::Error)]
pub enum GatewayError {
    /// The request is malformed (empty prompt, bad sampling values, unknown token ids...).
    #[error("{0}")]
    InvalidArgument(String),
    /// The prompt does not fit the model's context.
    #[error("the prompt of {prompt} tokens does not fit the context of {context} tokens (one position must stay free to generate)")]
    PromptTooLong { prompt: usize, context: usize },
    /// The prompt and the `max_tokens` the request asked for together exceed the context
    /// (refused, as OpenAI and vLLM refuse it, rather than shortened silently).
    #[error("the context holds {context} tokens, but {} were requested ({prompt} in the prompt, {max_tokens} for the completion): reduce the prompt or max_tokens", prompt + max_tokens)]
    ContextExceeded { prompt: usize, max_tokens: usize, context: usize },
    /// The request can never fit the KV cache, or the server is at its request limit.
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("session {0:?} does not exist (it was closed, expired, or never created)")]
    UnknownSession(String),
    /// The session existed but its KV was lost with a worker: start a new one.
    #[error("session {session:?} was lost: {reason}; start a new session (resend the conversation)")]
    SessionLost { session: String, reason: String },
    #[error("session {0:?} is busy with another request")]
    SessionBusy(String),
    /// A new session's name is taken (a client chose a key already in use on this node).
    #[error("session {0:?} already exists: continue it with session_id, or choose another key")]
    SessionExists(String),
    /// The session is named for another node: a balancer sent it here because its node no
    /// longer serves (drained, stopped) or does not route on the session id.
    #[error("session {session:?} is held by node {node:?}, not by this node ({here:?}): its KV is not here (node {node:?} is draining, stopped, or the balancer does not route on the session id); start a new session (resend the conversation)")]
    SessionElsewhere { session: String, node: String, here: String },
    /// A worker failed or is restarting.
    #[error("{0}")]
    Unavailable(String),
    /// The gateway is still starting its workers and loading the model.
    #[error("the server is loading the model; retry shortly")]
    Loading,
    /// The gateway is stopping.
    #[error("the gateway is shutting down")]
    ShuttingDown,
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<GatewayError> for Status {
    fn from(e: GatewayError) -> Status {
        let msg = e.to_string();
        match e {
            GatewayError::InvalidArgument(_) | GatewayError::PromptTooLong { .. } | GatewayError::ContextExceeded { .. } => {
                Status::invalid_argument(msg)
            }
            GatewayError::ResourceExhausted(_) => Status::resource_exhausted(msg),
            GatewayError::UnknownSession(_) => Status::not_found(msg),
            GatewayError::SessionBusy(_) | GatewayError::SessionLost { .. } | GatewayError::SessionElsewhere { .. } => {
                Status::failed_precondition(msg)
            }
            GatewayError::SessionExists(_) => Status::already_exists(msg),
            GatewayError::Unavailable(_) | GatewayError::Loading | GatewayError::ShuttingDown => Status::unavailable(msg),
            GatewayError::Internal(_) => Status::internal(msg),
        }
    }
}

impl From<duet_model::Error> for GatewayError {
    /// What a request's own text, token ids or messages cause is the client's error; the
    /// model's files (read at start) failing is the server's.
    fn from(e: duet_model::Error) -> Self {
        use duet_model::Error as E;
        match e {
            E::TokenOutOfRange { .. } | E::Encode(_) | E::Template(_) => GatewayError::InvalidArgument(e.to_string()),
            E::Gguf(_) | E::UnsupportedModel(_) | E::TensorShape { .. } | E::Tokenizer(_) | E::Io { .. } => GatewayError::Internal(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clients_errors_are_invalid_arguments_and_the_models_are_internal() {
        use duet_model::Error as E;
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        for client in [E::TokenOutOfRange { id: 9, n_vocab: 4 }, E::Encode("bad".into()), E::Template("raised".into())] {
            assert_eq!(Status::from(GatewayError::from(client)).code(), tonic::Code::InvalidArgument);
        }
        for server in [E::UnsupportedModel("x".into()), E::Tokenizer("x".into()), E::Io { path: "m".into(), source: io() }] {
            assert_eq!(Status::from(GatewayError::from(server)).code(), tonic::Code::Internal);
        }
    }
}
