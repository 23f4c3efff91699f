//! The errors of duet-gpu-worker: [`GpuWorkerError`], one variant per step that can fail,
//! and the two it wraps from the devices (KV rows out of reach, the GPU's own failures).

use duet_kernels::quant::GgmlType;

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
    Kv(#[from] KvAccessError),
    #[error("GPU: {0}")]
    Cuda(#[from] CudaError),
    #[error("routed experts{}: {what}", worker.map(|w| format!(" on cpu-worker {w}")).unwrap_or_default())]
    RemoteExperts { worker: Option<u32>, what: String },
    #[error("the {device} device cannot be used: {why}")]
    DeviceUnavailable { device: &'static str, why: String },
}

/// Why KV rows could not be reached.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvAccessError {
    #[error("position {position} has no KV block")]
    NoBlock { position: usize },
    #[error("cpu-worker {0} is not attached")]
    WorkerNotAttached(u32),
    #[error("batch row {row} belongs to no sequence of the step")]
    NoRow { row: usize },
    #[error("a sequence's KV rows are of different types (f16 and q8_0 arenas)")]
    MixedRowTypes,
}

/// What went wrong on the GPU side.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLAS: {0:?}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    #[error("NVRTC could not compile {file}: {log}")]
    Compile { file: &'static str, log: String },
    #[error("NVRTC version unknown ({0})")]
    NvrtcVersion(String),
    #[error("no kernel named {0} was loaded")]
    NoKernel(String),
    #[error("tensor {tensor} is {ty:?}, a type the CUDA device has no kernels for")]
    UnsupportedType { tensor: String, ty: GgmlType },
    #[error("the weights need {need} bytes of GPU memory; {gpu} has {free} free")]
    OutOfMemory { need: usize, free: usize, gpu: String },
    #[error("the weights and workspace need {need} bytes of GPU memory, over the {budget} that --gpu-mem-bytes allows")]
    OverBudget { need: usize, budget: usize },
    #[error("{name}: {why}")]
    Setting { name: &'static str, why: String },
}

impl From<duet_model::gguf::GgufError> for GpuWorkerError {
    fn from(e: duet_model::gguf::GgufError) -> Self {
        GpuWorkerError::Model(e.into())
    }
}

pub type Result<T, E = GpuWorkerError> = std::result::Result<T, E>;
