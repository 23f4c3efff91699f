//! The real duet-cpu-worker binary's control plane over a real Unix socket: Info reports
//! the worker's segments, layout and live job counters (jobs posted through the exchange
//! ring as the gpu-worker does), health says SERVING, and SIGTERM tells health watchers
//! NOT_SERVING and removes the socket and the segments. After a SIGKILL the leftovers stop
//! a new worker of the same name with an error naming --replace; with --replace it comes
//! up, and a running worker's segments are never replaced.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use duet_kernels::attention::KV_PADDING;
use duet_proto::pb::cpu_worker_client::CpuWorkerClient;
use duet_proto::pb::{CpuInfoRequest, CpuInfoResponse};
use duet_proto::{channel, Address};
use duet_kv::shm::job::{encode_job, read_results, AttnJob, JobError};
use duet_kv::shm::Producer;
use duet_cpu_worker::{arena_name, ring_name};
use support::{attach, wait_exit, TempDir, Worker, BLOCK_SIZE, SHAPE, WAIT};
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
        softcap: None,
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

#[test]
fn replace_after_sigkill() {
    let dir = TempDir::new("replace");
    let socket = dir.join("cpu.sock");
    let address = Address::Unix(socket.clone());
    let listen = address.to_string();
    let instance = format!("rpl{}", std::process::id());
    let rt = runtime();
    let _context = rt.enter();
    let mut client = CpuWorkerClient::new(channel(&address).unwrap());

    // A worker killed without a chance to clean up leaves its segments and socket behind.
    let mut first = Worker::start(&instance, 0, 16, &["--listen", &listen]);
    let first_info = wait_ready(&rt, &mut client, &mut first);
    first.signal(libc::SIGKILL);
    first.wait_exit(WAIT);
    for path in first.segment_paths().iter().chain([&socket]) {
        assert!(path.exists(), "{} should be left behind by SIGKILL", path.display());
    }

    // Without --replace: a clear error naming the segment and --replace, nothing removed.
    let log = dir.join("refused.log");
    let mut cmd = Worker::command(&instance, 0, 16, &["--listen", &listen]);
    cmd.stderr(std::fs::File::create(&log).unwrap());
    let mut refused = cmd.spawn().unwrap();
    let status = wait_exit(&mut refused, WAIT);
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(!status.success(), "started over a dead worker's segments without --replace");
    assert!(stderr.contains("--replace") && stderr.contains(&arena_name(&instance, 0)), "{stderr}");
    for path in first.segment_paths() {
        assert!(path.exists(), "{} removed without --replace", path.display());
    }

    // With --replace (here from the environment): it comes up on the same names.
    let log = dir.join("replacing.log");
    let mut cmd = Worker::command(&instance, 0, 16, &["--listen", &listen]);
    cmd.env("DUET_CPU_REPLACE", "1").stderr(std::fs::File::create(&log).unwrap());
    let mut second = Worker::spawn(cmd, &instance, 0);
    let second_info = wait_ready(&rt, &mut client, &mut second);
    assert_eq!(second_info.pid, second.child.id());
    assert_ne!(second_info.pid, first_info.pid);
    let (_arena, _layout, mut producer) = attach(&mut second);
    post_empty_job(&mut producer).unwrap();

    // A running worker's segments are never replaced: on its socket the address is in use,
    // elsewhere its arena's lock refuses.
    let other_socket = Address::Unix(dir.join("other.sock")).to_string();
    for (extra, expect) in [
        (&["--replace", "--listen", &listen][..], "in use"),
        (&["--replace", "--listen", &other_socket][..], "running cpu-worker"),
        (&["--replace"][..], "running cpu-worker"),
    ] {
        let output = Worker::command(&instance, 0, 16, extra).stderr(Stdio::piped()).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success() && stderr.contains(expect), "{extra:?}: {}\n{stderr}", output.status);
    }
    assert!(!Path::new(&dir.join("other.sock")).exists(), "a refused worker left its socket");
    post_empty_job(&mut producer).unwrap();
    assert_eq!(info(&rt, &mut client).jobs_served, 2, "the running worker kept serving");

    second.signal(libc::SIGTERM);
    assert!(wait_exit_driving(&rt, &mut second).success());
    let stderr = std::fs::read_to_string(&log).unwrap();
    for name in [arena_name(&instance, 0), ring_name(&instance, 0)] {
        assert!(stderr.contains("--replace: removed") && stderr.contains(&name), "no warning naming {name}:\n{stderr}");
    }
    for path in second.segment_paths().iter().chain([&socket]) {
        assert!(!path.exists(), "{} was not removed", path.display());
    }
}
