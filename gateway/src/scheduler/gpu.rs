//! What the scheduler needs of the gpu-worker — run one step — behind a trait: the gRPC client
//! in the service, a fake in the scheduler's unit tests (scheduler/tests.rs).

use duet_proto::pb;
use duet_proto::pb::gpu_worker_client::GpuWorkerClient;
use futures_util::future::BoxFuture;
use tonic::transport::Channel;

/// Runs steps (the gpu-worker's `Step` call).
pub trait StepRunner: Send + Sync + 'static {
    /// Runs `req`; the future is spawned, so it owns what it needs.
    fn step(&self, req: pb::StepRequest) -> BoxFuture<'static, Result<pb::StepResponse, tonic::Status>>;
}

impl StepRunner for GpuWorkerClient<Channel> {
    fn step(&self, req: pb::StepRequest) -> BoxFuture<'static, Result<pb::StepResponse, tonic::Status>> {
        let mut client = self.clone();
        Box::pin(async move { GpuWorkerClient::step(&mut client, req).await.map(tonic::Response::into_inner) })
    }
}
