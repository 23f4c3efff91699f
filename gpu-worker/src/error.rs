//! The error type of duet-gpu-worker, one variant per step that can fail.

#[derive(Debug, thiserror::Error)]
pub enum GpuWorkerError {
    #[error("model: {0}")]
    Model(#[from] duet_model::Error),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("the prompt of {prompt} tokens does not fit the model's context of {context} tokens (one position must stay free to generate)")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("context full: {needed} positions needed, the KV cache holds {capacity}")]
    ContextFull { needed: usize, capacity: usize },
    #[error("KV: {0}")]
    Kv(#[from] crate::device::KvAccessError),
    #[error("GPU: {0}")]
    Cuda(#[from] crate::device::cuda::CudaError),
    #[error("the {device} device cannot be used: {why}")]
    DeviceUnavailable { device: &'static str, why: String },
}

impl From<duet_model::gguf::GgufError> for GpuWorkerError {
    fn from(e: duet_model::gguf::GgufError) -> Self {
        GpuWorkerError::Model(e.into())
    }
}

pub type Result<T, E = GpuWorkerError> = std::result::Result<T, E>;
