//! The real duet-cpu-worker binary's control plane over a real Unix socket: Info reports
//! the worker's segments, layout and live job counters (jobs posted through the exchange
//! ring as the gpu-worker does), health says SERVING, and SIGTERM tells health watchers
//! NOT_SERVING and removes the socket and the segments.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use duet_common::kernels::attention::KV_PADDING;
use duet_common::rpc::pb::cpu_worker_client::CpuWorkerClient;
use duet_common::rpc::pb::{CpuInfoRequest, CpuInfoResponse};
use duet_common::rpc::{channel, Address};
use duet_common::shm::job::{encode_job, read_results, AttnJob, JobError};
use duet_common::shm::Producer;
use duet_cpu_worker::{arena_name, ring_name};
use support::{attach, TempDir, Worker, BLOCK_SIZE, SHAPE, WAIT};
use tokio::runtime::Runtime;
use tonic::transport::Channel;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::HealthCheckRequest;

const CPU_WORKER_SERVICE: &str = "duet.v1.CpuWorker";
/// Longest a single RPC may take before the test retries or fails.
const RPC_TIMEOUT: Duration = Duration::from_secs(5);

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime")
}

/// Asks for Info until the worker answers (it serves once its arena and ring exist).
fn wait_ready(rt: &Runtime, client: &mut CpuWorkerClient<Channel>, worker: &mut Worker) -> CpuInfoResponse {
    let start = Instant::now();
    loop {
        let attempt = rt.block_on(tokio::time::timeout(Duration::from_secs(1), client.info(CpuInfoRequest {})));
        match attempt {
            Ok(Ok(info)) => return info.into_inner(),
            failed => {
                worker.assert_running(&format!("before its control plane answered ({failed:?})"));
                assert!(start.elapsed() < WAIT, "no Info answer after {WAIT:?}: {failed:?}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn info(rt: &Runtime, client: &mut CpuWorkerClient<Channel>) -> CpuInfoResponse {
    rt.block_on(tokio::time::timeout(RPC_TIMEOUT, client.info(CpuInfoRequest {})))
        .expect("Info timed out")
        .expect("Info")
        .into_inner()
}

fn health(rt: &Runtime, client: &mut HealthClient<Channel>, service: &str) -> Result<ServingStatus, tonic::Status> {
    let request = HealthCheckRequest { service: service.into() };
    let response = rt.block_on(tokio::time::timeout(RPC_TIMEOUT, client.check(request))).expect("Check timed out")?;
    Ok(response.into_inner().status())
}

/// Waits for the worker to exit while driving the test's runtime, so that the client end of
/// an open connection answers the server's shutdown (as a real client's runtime would).
fn wait_exit_driving(rt: &Runtime, worker: &mut Worker) -> ExitStatus {
    let start = Instant::now();
    rt.block_on(async {
        loop {
            if let Some(status) = worker.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(start.elapsed() < WAIT, "the worker did not exit within {WAIT:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
}

/// Posts a job with no sequences (valid: answered with no results) and waits for it.
fn post_empty_job(producer: &mut Producer) -> Result<(), JobError> {
    let job = AttnJob {
        layer: 0,
        n_head: SHAPE.n_head as u32,
        n_kv_head: SHAPE.n_kv_head as u32,
        head_dim: SHAPE.head_dim as u32,
        kv_padding: KV_PADDING as u32,
        seqs: vec![],
    };
    let mut encoded = Ok(());
    let seq = producer.post(|slot| encoded = encode_job(&job, slot)).unwrap();
    encoded.expect("an empty job fits the slot");
    read_results(producer.wait_done_timeout(seq, WAIT).unwrap()).map(|results| assert!(results.is_empty()))
}

/// Posts garbage (no job magic) and waits for its rejection.
fn post_garbage(producer: &mut Producer) {
    let seq = producer.post(|slot| slot[..4096].fill(0xA5)).unwrap();
    let answer = read_results(producer.wait_done_timeout(seq, WAIT).unwrap());
    assert!(matches!(answer, Err(JobError::Rejected { .. })), "{answer:?}");
}

#[test]
fn info_health_and_shutdown() {
    let dir = TempDir::new("info");
    let socket = dir.join("cpu.sock");
    let address = Address::Unix(socket.clone());
    let instance = format!("ctl{}", std::process::id());
    let listen = address.to_string();
    let mut worker = Worker::start(&instance, 2, 24, &["--listen", &listen]);

    let rt = runtime();
    let _context = rt.enter();
    let chan = channel(&address).unwrap();
    let mut client = CpuWorkerClient::new(chan.clone());
    let ready = wait_ready(&rt, &mut client, &mut worker);
    assert_eq!(ready.worker, 2);
    assert_eq!(ready.arena_segment, arena_name(&instance, 2));
    assert_eq!(ready.ring_segment, ring_name(&instance, 2));
    for path in worker.segment_paths() {
        assert!(path.exists(), "Info answered before {} existed", path.display());
    }
    assert_eq!((ready.kv_blocks, ready.block_size as usize), (24, BLOCK_SIZE));
    assert_eq!(ready.pid, worker.child.id());
    assert_eq!((ready.threads, ready.numa_node), (1, None));
    assert_eq!((ready.jobs_served, ready.jobs_rejected), (0, 0));
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");

    let mut health_client = HealthClient::new(chan);
    for service in ["", CPU_WORKER_SERVICE] {
        assert_eq!(health(&rt, &mut health_client, service).unwrap(), ServingStatus::Serving, "{service:?}");
    }
    let unknown = health(&rt, &mut health_client, "duet.v1.Nothing").unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    let request = HealthCheckRequest { service: CPU_WORKER_SERVICE.into() };
    let mut watch = rt.block_on(health_client.watch(request)).unwrap().into_inner();
    let first = rt.block_on(watch.message()).unwrap().expect("a first status");
    assert_eq!(first.status(), ServingStatus::Serving);

    // The counters are live: jobs through the ring show up in the next Info.
    let (_arena, layout, mut producer) = attach(&mut worker);
    assert_eq!(layout.n_blocks, 24);
    post_empty_job(&mut producer).unwrap();
    post_empty_job(&mut producer).unwrap();
    let after = info(&rt, &mut client);
    assert_eq!((after.jobs_served, after.jobs_rejected), (2, 0));
    post_garbage(&mut producer);
    let after = info(&rt, &mut client);
    assert_eq!((after.jobs_served, after.jobs_rejected), (2, 1));
    assert_eq!(CpuInfoResponse { jobs_served: 0, jobs_rejected: 0, ..after }, ready, "only the counters change");

    // SIGTERM: watchers see NOT_SERVING and their stream ends; the worker exits cleanly and
    // removes its socket and segments.
    let stop = Instant::now();
    worker.signal(libc::SIGTERM);
    let next = rt.block_on(tokio::time::timeout(WAIT, watch.message())).expect("no status after SIGTERM");
    assert_eq!(next.unwrap().expect("a status after SIGTERM").status(), ServingStatus::NotServing);
    let end = rt.block_on(tokio::time::timeout(WAIT, watch.message())).expect("the watch did not end");
    assert!(matches!(end, Ok(None)), "the watch should end cleanly: {end:?}");
    let status = wait_exit_driving(&rt, &mut worker);
    println!("stopped {:?} after SIGTERM, with a health watch open", stop.elapsed());
    assert!(status.success(), "worker exit status after SIGTERM: {status}");
    assert!(!socket.exists(), "the socket was not removed");
    for path in worker.segment_paths() {
        assert!(!path.exists(), "{} was not removed", path.display());
    }
}
