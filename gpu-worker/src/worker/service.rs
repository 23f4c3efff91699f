//! The gRPC face of worker mode (`duet.v1.GpuWorker`): one executor behind a mutex, its
//! blocking work on tokio's blocking threads, steps run in the order the gateway gives them
//! (`after_step`: it sends the next step while one runs), errors mapped to gRPC status codes
//! here and nowhere else.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use duet_model::gguf::GgufFile;
use duet_model::grammar::Grammars;
use duet_model::names::GeneralKey;
use duet_model::tokenizer::Tokenizer;
use duet_proto::pb::gpu_worker_server::{GpuWorker, GpuWorkerServer};
use duet_proto::{pb, Listener};
use tonic::{Request, Response, Status};

use super::executor::Executor;
use super::step_order::Ordered;
use super::StepError;
use crate::device::{AnyDevice, Device, KvAccessError, Placement};
use crate::error::GpuWorkerError;

/// The service state.
pub struct GpuWorkerService<D: Device> {
    executor: Arc<Ordered<Executor<D>>>,
    info: pb::GpuInfoResponse,
}

/// How the service runs its steps.
#[derive(Debug, Clone, Copy)]
pub struct ServiceOptions {
    /// Longest wait for a cpu-worker's answer to one job.
    pub job_timeout: Duration,
    /// Experts of each layer the device holds itself, the most used (when it leaves a
    /// mixture's experts to the cpu-workers; see [`Executor::with_hot_experts`]).
    pub hot_experts: usize,
    /// Benchmarks only: see [`Executor::with_synthetic_prefill`].
    pub synthetic_prefill: bool,
}

/// Steps between two plans of the hot experts (`--device-experts`).
const HOT_EXPERTS_EVERY: u64 = 64;

/// Longest wait of a step for the step it comes after (sent just before it, so it is running
/// or arriving; longer means it was lost).
const ORDER_WAIT: Duration = Duration::from_secs(60);

impl GpuWorkerService<AnyDevice> {
    /// Loads the model at `path` where `placement` says (a mixture's routed experts
    /// too with `local_experts`, else the cpu-workers serve them, and the device holds the
    /// `options.hot_experts` most used of each layer).
    pub fn load(path: &Path, placement: Placement, local_experts: bool, options: ServiceOptions) -> Result<Self, StepError> {
        let file = Arc::new(GgufFile::open(path).map_err(GpuWorkerError::from)?);
        let name = file
            .get(GeneralKey::Name.key())
            .and_then(|v| v.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default());
        // Structured output needs the vocabulary; without a usable one, grammars are refused.
        let grammars = Tokenizer::from_gguf(&file)
            .map_err(|e| e.to_string())
            .and_then(|t| Grammars::new(&t).map_err(|e| e.to_string()))
            .inspect_err(|e| tracing::warn!("no structured output: {e}"))
            .ok();
        let device = crate::device::open(placement, file, local_experts)?;
        GpuWorkerService::new(device, name, grammars, options)
    }
}

impl<D: Device + 'static> GpuWorkerService<D> {
    /// Serves `device`, with the model named `name` (and structured output over `grammars`).
    pub fn new(device: D, name: String, grammars: Option<Grammars>, options: ServiceOptions) -> Result<Self, StepError> {
        let ServiceOptions { job_timeout, hot_experts, synthetic_prefill } = options;
        let c = device.config();
        let info = pb::GpuInfoResponse {
            model: name,
            n_layer: c.n_layer as u32,
            n_head: c.n_head as u32,
            n_kv_head: c.n_kv_head as u32,
            head_dim: c.head_dim as u32,
            n_vocab: c.n_vocab as u32,
            context_length: c.n_ctx_train as u32,
            device: device.describe(),
            pid: std::process::id(),
            device_kind: device.kind() as i32,
            prefill_chunk_tokens: u32::try_from(device.prefill_chunk()).unwrap_or(u32::MAX),
            experts_on_cpu_workers: !device.holds_all_experts(),
            host_layers: device.host_layers() as u32,
            gpu_kv_positions: device.gpu_kv_positions() as u64,
            synthetic_prefill,
        };
        let mut executor = Executor::new(device, job_timeout)?;
        if let Some(g) = grammars {
            executor = executor.with_grammars(g);
        }
        if hot_experts > 0 {
            executor = executor.with_hot_experts(hot_experts, HOT_EXPERTS_EVERY)?;
        }
        if synthetic_prefill {
            tracing::warn!("synthetic prefill (benchmarks only): prompts' K/V rows are made up, not computed; the text is noise");
            executor = executor.with_synthetic_prefill();
        }
        Ok(GpuWorkerService { executor: Arc::new(Ordered::new(executor)), info })
    }

    /// The device in words (as `Info` reports it).
    pub fn device(&self) -> &str {
        &self.info.device
    }

    /// Runs `f` on the executor on a blocking thread: as step `step` once step `after` has
    /// run (`after` 0: at once; `step` `None`: not a step).
    async fn with_executor<T: Send + 'static>(
        &self,
        after: u64,
        step: Option<u64>,
        f: impl FnOnce(&mut Executor<D>) -> Result<T, StepError> + Send + 'static,
    ) -> Result<T, Status> {
        let executor = self.executor.clone();
        // Set when this call's future is dropped: the gateway went away (or gave up on it).
        let gone = CancelOnDrop(Arc::new(AtomicBool::new(false)));
        let cancelled = gone.0.clone();
        tokio::task::spawn_blocking(move || {
            // On a thread of the pool: the step's many small parallel loops then hand work to
            // the other threads directly, instead of each being injected into the pool from
            // outside and waited for (which cost ~40% of a batch-1 decode step).
            executor.run_after(after, step, ORDER_WAIT, &cancelled, |ex| rayon::scope(move |_| f(ex))).unwrap_or_else(|| {
                Err(StepError::OutOfOrder { after, waited: ORDER_WAIT })
            })
        })
        .await
        .map_err(|e| Status::internal(format!("step task: {e}")))?
        .map_err(status)
    }
}

/// Sets its flag when dropped.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// The gRPC status of a step error.
pub fn status(e: StepError) -> Status {
    let msg = e.to_string();
    match e {
        StepError::DuplicateSequence(_)
        | StepError::Sequence { .. }
        | StepError::BlockOutOfRange { .. }
        | StepError::SharedBlock { .. }
        | StepError::JobTooLarge { .. }
        | StepError::JobEncoding { .. }
        | StepError::Model(GpuWorkerError::InvalidRequest(_)) => Status::invalid_argument(msg),
        StepError::NoArena => Status::failed_precondition(msg),
        StepError::MaskThread => Status::internal(msg),
        StepError::Model(GpuWorkerError::Model(duet_model::Error::TokenOutOfRange { .. })) => Status::invalid_argument(msg),
        StepError::UnknownSequence(_) | StepError::Attach { .. } | StepError::OutOfOrder { .. } => Status::failed_precondition(msg),
        StepError::Kv(KvAccessError::WorkerNotAttached(_))
        | StepError::Model(GpuWorkerError::Kv(KvAccessError::WorkerNotAttached(_)))
        | StepError::CpuWorker { .. } => Status::unavailable(msg),
        StepError::Kv(KvAccessError::NoBlock { .. }) | StepError::Model(GpuWorkerError::Kv(KvAccessError::NoBlock { .. })) => Status::invalid_argument(msg),
        StepError::Kv(KvAccessError::NoRow { .. } | KvAccessError::MixedRowTypes) => Status::internal(msg),
        StepError::Model(GpuWorkerError::DeviceUnavailable { .. }) => Status::unavailable(msg),
        StepError::Model(_) => Status::internal(msg),
    }
}

#[tonic::async_trait]
impl<D: Device + 'static> GpuWorker for GpuWorkerService<D> {
    async fn info(&self, _: Request<pb::GpuInfoRequest>) -> Result<Response<pb::GpuInfoResponse>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn attach_cpu_worker(
        &self,
        req: Request<pb::AttachCpuWorkerRequest>,
    ) -> Result<Response<pb::AttachCpuWorkerResponse>, Status> {
        let r = req.into_inner();
        let kv_blocks = self.with_executor(0, None, move |ex| ex.attach(r.worker, &r.arena_segment, &r.ring_segment, (r.pid != 0).then_some(r.pid))).await?;
        tracing::info!(worker = r.worker, kv_blocks, "cpu-worker attached");
        Ok(Response::new(pb::AttachCpuWorkerResponse { kv_blocks }))
    }

    async fn step(&self, req: Request<pb::StepRequest>) -> Result<Response<pb::StepResponse>, Status> {
        let r = req.into_inner();
        Ok(Response::new(self.with_executor(r.after_step, Some(r.step), move |ex| ex.step(&r)).await?))
    }
}

/// Serves `service` on `listener` (with gRPC health) until `shutdown` resolves.
pub async fn serve<D: Device + 'static>(
    service: GpuWorkerService<D>,
    listener: Listener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<GpuWorkerServer<GpuWorkerService<D>>>().await;
    let router = tonic::transport::Server::builder()
        .add_service(health)
        .add_service(GpuWorkerServer::new(service).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20));
    listener.serve(router, shutdown).await
}

#[cfg(test)]
mod tests {
    use duet_kv::BlockId;
    use duet_model::grammar::GrammarError;
    use tonic::Code;

    use super::*;
    use crate::worker::SequenceError;

    /// What the gateway may cause is INVALID_ARGUMENT, what it must fix first
    /// FAILED_PRECONDITION, a worker's failure UNAVAILABLE, our own bugs INTERNAL.
    #[test]
    fn every_step_error_maps_to_its_status() {
        let seq = |problem| StepError::Sequence { seq_id: 7, problem };
        let cases = [
            (StepError::DuplicateSequence(7), Code::InvalidArgument),
            (seq(SequenceError::SubBatch(2)), Code::InvalidArgument),
            (seq(SequenceError::NoTokens), Code::InvalidArgument),
            (seq(SequenceError::PastContext { positions: 9000, n_ctx: 8192 }), Code::InvalidArgument),
            (seq(SequenceError::Grammar(GrammarError::Unset)), Code::InvalidArgument),
            (seq(SequenceError::ShareElsewhere { worker: 1, range: 0..16, block: BlockId(3), owner: 0 }), Code::InvalidArgument),
            (StepError::BlockOutOfRange { worker: 0, block: BlockId(99), n_blocks: 10 }, Code::InvalidArgument),
            (StepError::JobTooLarge { layer: 3, worker: 0, need: 1 << 20, slot_bytes: 1 << 16 }, Code::InvalidArgument),
            (StepError::Model(GpuWorkerError::InvalidRequest("x".into())), Code::InvalidArgument),
            (StepError::Model(GpuWorkerError::Model(duet_model::Error::TokenOutOfRange { id: 1 << 30, n_vocab: 10 })), Code::InvalidArgument),
            (StepError::NoArena, Code::FailedPrecondition),
            (StepError::UnknownSequence(7), Code::FailedPrecondition),
            (StepError::OutOfOrder { after: 4, waited: Duration::from_secs(30) }, Code::FailedPrecondition),
            (StepError::Attach { worker: 0, what: "no such segment".into() }, Code::FailedPrecondition),
            (StepError::Kv(KvAccessError::WorkerNotAttached(1)), Code::Unavailable),
            (StepError::CpuWorker { worker: 1, what: "timed out".into() }, Code::Unavailable),
            (StepError::Model(GpuWorkerError::DeviceUnavailable { device: "cuda", why: "no driver".into() }), Code::Unavailable),
            (StepError::MaskThread, Code::Internal),
            (StepError::Kv(KvAccessError::NoRow { row: 3 }), Code::Internal),
        ];
        for (e, code) in cases {
            let text = e.to_string();
            let s = status(e);
            assert_eq!(s.code(), code, "{text}");
            assert_eq!(s.message(), text);
        }
    }
}
