//! The worker's gRPC control plane: `duet.v1.CpuWorker` (Info: segments, arena layout, live
//! job counters) and `grpc.health.v1.Health`, served by a one-thread tokio runtime on a
//! thread of its own, so the job loop's pinned pool never runs async work.
//!
//! The address is bound before the arena is created (a busy address fails fast, and before
//! `--replace` could touch anything) but served only once the arena and the exchange ring
//! exist: a successful call means "ready for jobs"; until then connections wait.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{Scope, ScopedJoinHandle};
use std::time::Duration;

use duet_proto::pb::cpu_worker_server::{CpuWorker, CpuWorkerServer};
use duet_proto::pb::{CpuInfoRequest, CpuInfoResponse};
use duet_proto::{Address, Listener};
use tokio::runtime::Runtime;
use tokio::sync::watch;
use tonic::server::NamedService;
use tonic::transport::Server;
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;

use crate::serve::JobCounters;
use crate::CpuWorkerError;

/// How long open connections (e.g. a health Watch) may take to close after a stop before
/// they are dropped.
const GRACE: Duration = Duration::from_secs(2);

/// The health service names reported: the whole server ("") and the worker service.
const HEALTH_NAMES: [&str; 2] = ["", <CpuWorkerServer<InfoService> as NamedService>::NAME];

/// `duet.v1.CpuWorker`: the worker's fixed facts plus its live counters.
#[derive(Debug, Clone)]
pub struct InfoService {
    fixed: CpuInfoResponse,
    counters: Arc<JobCounters>,
}

impl InfoService {
    /// `fixed` with its job counters replaced by `counters` at each call.
    pub fn new(fixed: CpuInfoResponse, counters: Arc<JobCounters>) -> InfoService {
        InfoService { fixed, counters }
    }

    /// The answer to Info now.
    pub fn info(&self) -> CpuInfoResponse {
        let stats = self.counters.snapshot();
        CpuInfoResponse { jobs_served: stats.served, jobs_rejected: stats.rejected, ..self.fixed.clone() }
    }
}

#[tonic::async_trait]
impl CpuWorker for InfoService {
    async fn info(&self, _request: Request<CpuInfoRequest>) -> Result<Response<CpuInfoResponse>, Status> {
        Ok(Response::new(InfoService::info(self)))
    }
}

/// A bound, not yet serving, control address with the runtime that will serve it.
#[derive(Debug)]
pub struct ControlPlane {
    runtime: Runtime,
    listener: Listener,
    address: Address,
    socket: SocketFile,
}

impl ControlPlane {
    /// Builds the runtime and binds `address` (a Unix socket is made 0600; a stale socket
    /// file is replaced, a live one is an error).
    pub fn bind(address: &Address) -> Result<ControlPlane, CpuWorkerError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("duet-cpu-control")
            .build()
            .map_err(CpuWorkerError::Runtime)?;
        let listener = runtime
            .block_on(Listener::bind(address))
            .map_err(|source| CpuWorkerError::Listen { address: address.clone(), source })?;
        let socket = SocketFile(match address {
            Address::Unix(path) => Some(path.clone()),
            Address::Tcp(_) => None,
        });
        let address = listener.local_address().unwrap_or_else(|_| address.clone());
        Ok(ControlPlane { runtime, listener, address, socket })
    }

    /// The address bound (with the real port when TCP port 0 was asked for).
    pub fn address(&self) -> &Address {
        &self.address
    }

    /// Serves `service` and health (SERVING for "" and `duet.v1.CpuWorker`) on a thread of
    /// `scope` until [`Serving::stop`]. Should the server fail, it logs the error and sets
    /// `shutdown`, so the whole worker stops rather than serving jobs no one can see.
    pub fn serve<'scope>(
        self,
        scope: &'scope Scope<'scope, '_>,
        service: InfoService,
        shutdown: &'scope AtomicBool,
    ) -> Result<Serving<'scope>, CpuWorkerError> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let ControlPlane { runtime, listener, address, socket } = self;
        let thread = std::thread::Builder::new()
            .name("duet-cpu-control".into())
            .spawn_scoped(scope, move || {
                let result = runtime.block_on(serve(listener, service, stop_rx));
                // Dropping the runtime closes connections still open after the grace period;
                // then the socket file goes.
                drop(runtime);
                drop(socket);
                if let Err(e) = &result {
                    tracing::error!(%address, "control plane failed, stopping the worker: {e}");
                    shutdown.store(true, Ordering::SeqCst);
                }
                result
            })
            .map_err(CpuWorkerError::Runtime)?;
        Ok(Serving { stop: stop_tx, thread })
    }
}

/// A serving control plane.
#[derive(Debug)]
pub struct Serving<'scope> {
    stop: watch::Sender<bool>,
    thread: ScopedJoinHandle<'scope, Result<(), CpuWorkerError>>,
}

impl Serving<'_> {
    /// Reports NOT_SERVING to health watchers and ends their streams, stops accepting,
    /// waits up to [`GRACE`] for open connections, then removes the socket file.
    pub fn stop(self) -> Result<(), CpuWorkerError> {
        // An error means the server already stopped (and said why through the join).
        let _ = self.stop.send(true);
        self.thread.join().map_err(|_| CpuWorkerError::ControlPanic)?
    }
}

async fn serve(listener: Listener, service: InfoService, mut stop: watch::Receiver<bool>) -> Result<(), CpuWorkerError> {
    let (mut reporter, health) = tonic_health::server::health_reporter();
    for name in HEALTH_NAMES {
        reporter.set_service_status(name, ServingStatus::Serving).await;
    }
    let router = Server::builder().add_service(health).add_service(CpuWorkerServer::new(service));
    let mut grace = stop.clone();
    let stopping = async move {
        // A dropped sender counts as a stop.
        let _ = stop.wait_for(|stopped| *stopped).await;
        for name in HEALTH_NAMES {
            reporter.set_service_status(name, ServingStatus::NotServing).await;
            // Dropping a status's sender ends the Watch streams on it (after they have seen
            // NOT_SERVING), so their connections can close gracefully.
            reporter.clear_service_status(name).await;
        }
    };
    let served = listener.serve(router, stopping);
    tokio::select! {
        result = served => result.map_err(CpuWorkerError::Serve),
        () = async {
            let _ = grace.wait_for(|stopped| *stopped).await;
            tokio::time::sleep(GRACE).await;
        } => {
            tracing::warn!("control-plane connections still open {GRACE:?} after the stop: closing them");
            Ok(())
        }
    }
}

/// The Unix socket file of the control address, removed when this drops (serving removes
/// it too; this covers a worker that fails before serving and a grace period that ran out).
#[derive(Debug)]
struct SocketFile(Option<PathBuf>);

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            if let Err(e) = std::fs::remove_file(path) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %path.display(), "removing the control socket: {e}");
                }
            }
        }
    }
}
