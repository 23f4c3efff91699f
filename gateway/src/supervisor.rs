//! The workers as the gateway manages them. In local mode it spawns one gpu-worker and the
//! cpu-workers (by default one per NUMA node with CPUs, bound to it) on Unix sockets in a
//! private runtime directory, restarts one that dies and stops them all at the end; with
//! given addresses (systemd-managed workers) it only connects. Either way a watcher polls
//! each worker's `Info`: a cpu-worker that comes back with a new process id is attached to
//! the gpu-worker again, and the scheduler is told when a worker goes down and comes back.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use duet_proto::pb::cpu_worker_client::CpuWorkerClient;
use duet_proto::pb::gpu_worker_client::GpuWorkerClient;
use duet_proto::{channel, pb, Address};
use duet_topology::{NumaNode, Topology};
use tokio::process::{Child, Command as Process};
use tokio::sync::{mpsc, watch};
use tonic::transport::Channel;

use crate::scheduler::Command;

/// How to start local workers.
#[derive(Debug, Clone)]
pub struct LocalWorkers {
    pub model: PathBuf,
    pub cpu_workers: u32,
    /// KV arena bytes per cpu-worker, as the cpu-worker's --kv-bytes takes it (e.g. 1G).
    pub kv_bytes: String,
    /// The cpu-workers' KV cache type (`--kv-type`).
    pub kv_type: duet_kv::KvDtype,
    /// Instance name in the segment names.
    pub instance: String,
    /// Private directory for the sockets (created 0700, removed at the end).
    pub runtime_dir: PathBuf,
    /// Threads of the gpu-worker's CPU device (default: all cores).
    pub gpu_threads: Option<usize>,
    /// The most sequences a step runs (the scheduler's max_running): each cpu-worker sizes its
    /// ring slots for one layer's attention job of that many (`--step-sequences`).
    pub max_running: usize,
    /// The gpu-worker's `--device` (auto, cpu or cuda).
    pub device: String,
    /// The gpu-worker's `--gpu-layers` (a layer count or `auto`: layers on its device, the
    /// rest on its CPU device).
    pub gpu_layers: Option<String>,
    /// The gpu-worker's `--gpu-mem-bytes` and `--gpu-kv-bytes`.
    pub gpu_mem_bytes: Option<usize>,
    pub gpu_kv_bytes: Option<usize>,
    /// A mixture's routed experts on the cpu-workers (`--experts-on cpu-workers`; cpu-worker
    /// `w` serves share `w` of them), else on the gpu-worker's device.
    pub experts_on_cpu_workers: bool,
    /// Hot experts per layer the gpu-worker's device computes beside the cpu-workers
    /// (`--device-experts`; 0: none).
    pub device_experts: usize,
    /// The gpu-worker's `--synthetic-prefill` (benchmarks only).
    pub synthetic_prefill: bool,
}

/// One worker the gateway talks to.
#[derive(Debug, Clone)]
pub struct WorkerAddr {
    pub address: Address,
}

/// Live connections to the workers.
#[derive(Clone)]
pub struct Workers {
    pub gpu: GpuWorkerClient<Channel>,
    pub gpu_info: pb::GpuInfoResponse,
    pub cpus: Vec<CpuWorkerClient<Channel>>,
    pub cpu_infos: Vec<pb::CpuInfoResponse>,
}

/// How long to wait for a worker to come up.
const READY_TIMEOUT: Duration = Duration::from_secs(300);
/// How often the watcher polls the workers.
const WATCH_PERIOD: Duration = Duration::from_millis(250);

/// Finds a sibling binary: next to this executable, or one folder up (a test binary of
/// `target/*/deps` running the gateway in-process), else on PATH.
pub fn worker_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().ok();
    let dir = exe.as_deref().and_then(std::path::Path::parent);
    let found = [dir, dir.and_then(std::path::Path::parent)].into_iter().flatten().map(|d| d.join(name)).find(|p| p.exists());
    found.unwrap_or_else(|| PathBuf::from(name))
}

fn cpu_count() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// This machine's NUMA topology, read from `/sys/devices/system/node` and logged the first
/// time it is asked for. A topology that cannot be read (after a warning) is one node with
/// every core, as on a machine without NUMA.
pub fn topology() -> &'static Topology {
    static TOPOLOGY: OnceLock<Topology> = OnceLock::new();
    TOPOLOGY.get_or_init(|| {
        let t = Topology::read().unwrap_or_else(|e| {
            tracing::warn!("reading the NUMA topology failed ({e}): treating the machine as one node");
            Topology::without_numa().unwrap_or_else(|e| {
                tracing::warn!("{e}: the node's memory is unknown");
                Topology { nodes: vec![NumaNode { id: 0, cpus: (0..cpu_count()).collect(), memory_bytes: 0 }] }
            })
        });
        tracing::info!(
            nodes = t.nodes.len(),
            nodes_with_cpus = t.nodes_with_cpus().count(),
            cpus = t.cpu_count(),
            memory_gib = format!("{:.1}", t.memory_bytes() as f64 / (1u64 << 30) as f64),
            "NUMA topology: {t}"
        );
        t
    })
}

/// NUMA nodes with CPUs on this machine (at least 1): local mode's default number of
/// cpu-workers, one per node.
pub fn cpu_nodes() -> usize {
    topology().nodes_with_cpus().count().max(1)
}

/// The NUMA node local cpu-worker `worker` (of `workers`) is bound to: the `worker`-th node
/// with CPUs when there are several workers and a node with CPUs for each, else `None`
/// (one node, or more workers than nodes: the workers share the cores, unpinned).
fn worker_node(topology: &Topology, workers: u32, worker: u32) -> Option<u32> {
    if workers < 2 || topology.nodes_with_cpus().count() < workers as usize {
        return None;
    }
    topology.nodes_with_cpus().nth(worker as usize).map(|n| n.id)
}

impl LocalWorkers {
    pub fn gpu_address(&self) -> Address {
        Address::Unix(self.runtime_dir.join("gpu.sock"))
    }

    pub fn cpu_address(&self, worker: u32) -> Address {
        Address::Unix(self.runtime_dir.join(format!("cpu-{worker}.sock")))
    }

    fn spawn_gpu(&self) -> std::io::Result<Child> {
        let mut cmd = Process::new(worker_binary("duet-gpu-worker"));
        cmd.arg("serve").arg("--model").arg(&self.model).arg("--listen").arg(self.gpu_address().to_string());
        cmd.arg("--device").arg(&self.device);
        if let Some(n) = &self.gpu_layers {
            cmd.args(["--gpu-layers", n]);
        }
        for (flag, bytes) in [("--gpu-mem-bytes", self.gpu_mem_bytes), ("--gpu-kv-bytes", self.gpu_kv_bytes)] {
            if let Some(b) = bytes {
                cmd.arg(flag).arg(b.to_string());
            }
        }
        if self.experts_on_cpu_workers {
            cmd.args(["--experts-on", "cpu-workers"]);
        }
        if self.device_experts > 0 {
            cmd.args(["--device-experts", &self.device_experts.to_string()]);
        }
        if let Some(t) = self.gpu_threads {
            cmd.arg("--threads").arg(t.to_string());
        }
        if self.synthetic_prefill {
            cmd.arg("--synthetic-prefill");
        }
        spawn(cmd)
    }

    /// Starts cpu-worker `worker`: the first time after removing whatever a previous instance
    /// of this name left (`fresh`), after a crash keeping its KV arena when the arena still
    /// fits (`--reattach`: the sessions with KV on it survive).
    fn spawn_cpu(&self, worker: u32, fresh: bool) -> std::io::Result<Child> {
        let mut cmd = Process::new(worker_binary("duet-cpu-worker"));
        cmd.args(["--instance", &self.instance, "--worker", &worker.to_string(), "--kv-bytes", &self.kv_bytes])
            .args(["--kv-type", &self.kv_type.to_string()])
            .arg("--model")
            .arg(&self.model)
            .arg("--listen")
            .arg(self.cpu_address(worker).to_string());
        if let Some(node) = worker_node(topology(), self.cpu_workers, worker) {
            // The worker binds its arena to the node and pins one thread to each of the
            // node's CPUs it may use.
            cmd.args(["--numa-node", &node.to_string()]);
        } else {
            // One node: share the cores between the workers (unpinned).
            cmd.args(["--threads", &(cpu_count() / self.cpu_workers as usize).max(1).to_string()]);
        }
        if self.experts_on_cpu_workers {
            cmd.args(["--experts-of", &format!("{worker}/{}", self.cpu_workers)]);
        }
        cmd.args(["--step-sequences", &self.max_running.to_string()]);
        cmd.arg(if fresh { "--replace" } else { "--reattach" });
        spawn(cmd)
    }
}

/// With the routed experts left to the cpu-workers, cpu-worker `i` of `n` must serve share
/// `i/n` of them: said at start, not as a failed step.
fn check_expert_share(gpu: &pb::GpuInfoResponse, cpu: &pb::CpuInfoResponse, i: u32, n: u32) -> anyhow::Result<()> {
    let share = cpu.expert_share.zip(cpu.expert_shares);
    match (gpu.experts_on_cpu_workers, share) {
        (true, Some(s)) if s == (i, n) => Ok(()),
        (true, s) => {
            let serves = s.map_or("no experts".to_string(), |(a, b)| format!("share {a}/{b} of the experts"));
            anyhow::bail!("the gpu-worker leaves the routed experts to the cpu-workers, but cpu-worker {i} serves {serves}: start it with --experts-of {i}/{n}")
        }
        (false, Some(_)) => {
            tracing::warn!("cpu-worker {i} holds routed experts the gpu-worker computes itself (start the gpu-worker with --experts-on cpu-workers to use them)");
            Ok(())
        }
        (false, None) => Ok(()),
    }
}

#[cfg(test)]
mod expert_share_tests {
    use super::*;

    #[test]
    fn the_cpu_workers_must_serve_their_shares_of_remote_experts() {
        let gpu = |remote| pb::GpuInfoResponse { experts_on_cpu_workers: remote, ..Default::default() };
        let cpu = |share: Option<(u32, u32)>| pb::CpuInfoResponse { expert_share: share.map(|s| s.0), expert_shares: share.map(|s| s.1), ..Default::default() };
        assert!(check_expert_share(&gpu(true), &cpu(Some((1, 2))), 1, 2).is_ok());
        let err = check_expert_share(&gpu(true), &cpu(None), 1, 2).unwrap_err().to_string();
        assert!(err.contains("serves no experts") && err.contains("--experts-of 1/2"), "{err}");
        assert!(check_expert_share(&gpu(true), &cpu(Some((0, 2))), 1, 2).is_err());
        assert!(check_expert_share(&gpu(false), &cpu(None), 0, 1).is_ok());
        assert!(check_expert_share(&gpu(false), &cpu(Some((0, 1))), 0, 1).is_ok());
    }
}

fn spawn(mut cmd: Process) -> std::io::Result<Child> {
    // Workers log to the gateway's stderr. They are killed when their handle drops, and stop
    // by themselves when the gateway dies without dropping it (SIGKILL, the OOM killer).
    cmd.arg("--parent-pid").arg(std::process::id().to_string());
    cmd.stdin(Stdio::null()).stdout(Stdio::inherit()).stderr(Stdio::inherit()).kill_on_drop(true);
    let child = cmd.spawn()?;
    Ok(child)
}

/// Polls `info` until it answers, failing early if `child` exits.
async fn wait_ready<T, F, Fut>(what: &str, child: Option<&mut Child>, mut info: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let start = Instant::now();
    let mut child = child;
    loop {
        match info().await {
            Ok(v) => return Ok(v),
            Err(e) if start.elapsed() > READY_TIMEOUT => anyhow::bail!("{what} not ready after {READY_TIMEOUT:?}: {e}"),
            Err(_) => {}
        }
        if let Some(c) = child.as_deref_mut() {
            if let Some(status) = c.try_wait()? {
                anyhow::bail!("{what} exited before it was ready ({status})");
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn gpu_info(c: &mut GpuWorkerClient<Channel>) -> Result<pb::GpuInfoResponse, tonic::Status> {
    c.info(pb::GpuInfoRequest {}).await.map(|r| r.into_inner())
}

async fn cpu_info(c: &mut CpuWorkerClient<Channel>) -> Result<pb::CpuInfoResponse, tonic::Status> {
    c.info(pb::CpuInfoRequest {}).await.map(|r| r.into_inner())
}

async fn attach(gpu: &mut GpuWorkerClient<Channel>, info: &pb::CpuInfoResponse, local: bool) -> anyhow::Result<u32> {
    let req = pb::AttachCpuWorkerRequest {
        worker: info.worker,
        arena_segment: info.arena_segment.clone(),
        ring_segment: info.ring_segment.clone(),
        pid: if local { info.pid } else { 0 },
    };
    let r = gpu.attach_cpu_worker(req).await.map_err(|e| anyhow::anyhow!("attaching cpu-worker {}: {}", info.worker, e.message()))?;
    Ok(r.into_inner().kv_blocks)
}

/// Connects to running workers (given addresses, or local ones just spawned), waits until
/// they answer and attaches every cpu-worker to the gpu-worker.
pub async fn connect(gpu_addr: &Address, cpu_addrs: &[Address], mut children: Option<&mut LocalChildren>, local: bool) -> anyhow::Result<Workers> {
    let mut gpu = GpuWorkerClient::new(channel(gpu_addr)?).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20);
    let gpu_child = children.as_deref_mut().map(|c| &mut c.gpu);
    let gpu_info = wait_ready(&format!("gpu-worker at {gpu_addr}"), gpu_child, || {
        let mut g = gpu.clone();
        async move { gpu_info(&mut g).await }
    })
    .await?;
    let (mut cpus, mut cpu_infos) = (Vec::new(), Vec::new());
    for (i, addr) in cpu_addrs.iter().enumerate() {
        let client = CpuWorkerClient::new(channel(addr)?);
        let child = children.as_deref_mut().map(|c| &mut c.cpus[i]);
        let info = wait_ready(&format!("cpu-worker {i} at {addr}"), child, || {
            let mut c = client.clone();
            async move { cpu_info(&mut c).await }
        })
        .await?;
        if info.worker != i as u32 {
            anyhow::bail!("the cpu-worker at {addr} says it is worker {}, expected {i}", info.worker);
        }
        check_expert_share(&gpu_info, &info, i as u32, cpu_addrs.len() as u32)?;
        attach(&mut gpu, &info, local).await?;
        cpus.push(client);
        cpu_infos.push(info);
    }
    Ok(Workers { gpu, gpu_info, cpus, cpu_infos })
}

/// The local worker processes.
pub struct LocalChildren {
    pub gpu: Child,
    pub cpus: Vec<Child>,
}

/// Creates the runtime directory and spawns the workers.
pub fn spawn_local(cfg: &LocalWorkers) -> anyhow::Result<LocalChildren> {
    use std::os::unix::fs::DirBuilderExt;
    topology(); // logged before the workers start
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&cfg.runtime_dir)
        .map_err(|e| anyhow::anyhow!("creating the runtime directory {}: {e}", cfg.runtime_dir.display()))?;
    let gpu = cfg.spawn_gpu().map_err(|e| anyhow::anyhow!("starting duet-gpu-worker: {e}"))?;
    let cpus = (0..cfg.cpu_workers)
        .map(|w| cfg.spawn_cpu(w, true).map_err(|e| anyhow::anyhow!("starting duet-cpu-worker {w}: {e}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(LocalChildren { gpu, cpus })
}

/// Keeps local workers running: restarts one that exits (unless stopping), and on stop
/// sends SIGTERM to all, waits for them, and removes the runtime directory.
pub fn keep_running(cfg: LocalWorkers, children: LocalChildren, mut stop: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let cfg = Arc::new(cfg);
        let mut tasks = Vec::new();
        let LocalChildren { gpu, cpus } = children;
        let gpu_cfg = cfg.clone();
        tasks.push(tokio::spawn(babysit("gpu-worker".into(), gpu, stop.clone(), move || gpu_cfg.spawn_gpu())));
        for (w, child) in cpus.into_iter().enumerate() {
            let c = cfg.clone();
            tasks.push(tokio::spawn(babysit(format!("cpu-worker {w}"), child, stop.clone(), move || c.spawn_cpu(w as u32, false))));
        }
        let _ = stop.wait_for(|s| *s).await;
        for t in tasks {
            let _ = t.await;
        }
        if let Err(e) = std::fs::remove_dir_all(&cfg.runtime_dir) {
            tracing::warn!(dir = %cfg.runtime_dir.display(), "removing the runtime directory: {e}");
        }
    })
}

async fn babysit(name: String, mut child: Child, mut stop: watch::Receiver<bool>, respawn: impl Fn() -> std::io::Result<Child>) {
    loop {
        let exited = tokio::select! {
            status = child.wait() => Some(status),
            _ = stop.wait_for(|s| *s) => None,
        };
        let Some(status) = exited else {
            terminate(&name, &mut child).await;
            return;
        };
        if *stop.borrow() {
            return;
        }
        tracing::error!("{name} exited ({}); restarting it", status.map_or_else(|e| e.to_string(), |s| s.to_string()));
        tokio::time::sleep(Duration::from_millis(200)).await;
        match respawn() {
            Ok(c) => child = c,
            Err(e) => {
                tracing::error!("restarting {name} failed: {e}");
                return;
            }
        }
    }
}

/// SIGTERM, then SIGKILL after 10 s.
async fn terminate(name: &str, child: &mut Child) {
    if let Some(pid) = child.id() {
        // SAFETY: signalling our own child process.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    }
    match tokio::time::timeout(Duration::from_secs(10), child.wait()).await {
        Ok(_) => tracing::info!("{name} stopped"),
        Err(_) => {
            tracing::warn!("{name} did not stop within 10 s: killing it");
            let _ = child.kill().await;
        }
    }
}

/// Watches the workers: tells the scheduler when one goes down, re-attaches a restarted
/// cpu-worker (or every cpu-worker to a restarted gpu-worker) and says when it is back.
pub fn watch(workers: Workers, local: bool, scheduler: mpsc::Sender<Command>, mut stop: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let Workers { mut gpu, gpu_info, mut cpus, cpu_infos } = workers;
        let mut gpu_pid = Some(gpu_info.pid);
        let mut cpu_pids: Vec<Option<u32>> = cpu_infos.iter().map(|i| Some(i.pid)).collect();
        // Each cpu-worker as last seen answering: its process and its arena's generation.
        let mut cpu_seen: Vec<(u32, u64)> = cpu_infos.iter().map(|i| (i.pid, i.arena_generation)).collect();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(WATCH_PERIOD) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            // The gpu-worker: a new pid means every sequence is gone.
            let g = gpu_info_quick(&mut gpu).await;
            match (g.as_ref().map(|i| i.pid), gpu_pid) {
                (Err(_), Some(_)) => {
                    gpu_pid = None;
                    let _ = scheduler.send(Command::GpuDown { reason: "it stopped answering".into() }).await;
                }
                (Ok(pid), old) if old != Some(pid) => {
                    if old.is_some() {
                        let _ = scheduler.send(Command::GpuDown { reason: "it restarted".into() }).await;
                    }
                    tracing::info!(pid, "gpu-worker is up: attaching the cpu-workers again");
                    let mut ok = true;
                    for (w, c) in cpus.iter_mut().enumerate() {
                        if let Ok(info) = cpu_info_quick(c).await {
                            let attached = attach(&mut gpu, &info, local).await.inspect_err(|e| tracing::warn!("{e}")).is_ok();
                            ok &= attached;
                            if attached && cpu_pids[w] != Some(info.pid) {
                                // It went down (or restarted) with the gpu-worker: the loop
                                // below would see it attached and say nothing.
                                cpu_back(&scheduler, w as u32, &info, cpu_pids[w], &mut cpu_seen[w]).await;
                            }
                            cpu_pids[w] = Some(info.pid);
                        } else {
                            ok = false;
                        }
                    }
                    if ok {
                        gpu_pid = Some(pid);
                        let _ = scheduler.send(Command::GpuUp).await;
                    }
                }
                _ => {}
            }
            for (w, c) in cpus.iter_mut().enumerate() {
                let worker = w as u32;
                match (cpu_info_quick(c).await, cpu_pids[w]) {
                    (Err(e), Some(_)) => {
                        cpu_pids[w] = None;
                        let _ = scheduler.send(Command::WorkerDown { worker, reason: format!("it stopped answering: {}", e.message()) }).await;
                    }
                    (Ok(info), old) if old != Some(info.pid) => match attach(&mut gpu, &info, local).await {
                        Ok(_) => {
                            cpu_back(&scheduler, worker, &info, old, &mut cpu_seen[w]).await;
                            cpu_pids[w] = Some(info.pid);
                        }
                        Err(e) => tracing::warn!("re-attaching cpu-worker {worker}: {e}"),
                    },
                    _ => {}
                }
            }
        }
    })
}

/// Tells the scheduler that cpu-worker `worker`, re-attached, serves again (`old`: the
/// process it knew serving, `None` if it saw it go down), and whether the KV is as it was.
async fn cpu_back(scheduler: &mpsc::Sender<Command>, worker: u32, info: &pb::CpuInfoResponse, old: Option<u32>, seen: &mut (u32, u64)) {
    if old.is_some() {
        let _ = scheduler.send(Command::WorkerDown { worker, reason: "it restarted".into() }).await;
    }
    let restarted = info.pid != seen.0;
    let kv_kept = !restarted || old_generation_kept(seen.1, info.arena_generation);
    *seen = (info.pid, info.arena_generation);
    let _ = scheduler.send(Command::WorkerUp { worker, kv_kept, restarted }).await;
}

/// Whether a restarted cpu-worker re-attached to the arena its predecessor had: the
/// generation counts each attach, so more than before means the same arena, K/V intact (one
/// more a restart, more if it restarted again between two looks). A rebuilt arena starts
/// again at 1, so it would take `before` more restarts within one look to pass for the old
/// one; 0 is a worker that does not say.
fn old_generation_kept(before: u64, now: u64) -> bool {
    before > 0 && now > before
}

async fn gpu_info_quick(c: &mut GpuWorkerClient<Channel>) -> Result<pb::GpuInfoResponse, tonic::Status> {
    let mut req = tonic::Request::new(pb::GpuInfoRequest {});
    req.set_timeout(Duration::from_secs(2));
    c.info(req).await.map(|r| r.into_inner())
}

async fn cpu_info_quick(c: &mut CpuWorkerClient<Channel>) -> Result<pb::CpuInfoResponse, tonic::Status> {
    let mut req = tonic::Request::new(pb::CpuInfoRequest {});
    req.set_timeout(Duration::from_secs(2));
    c.info(req).await.map(|r| r.into_inner())
}

/// A private runtime directory for instance `instance`: under $XDG_RUNTIME_DIR, else /tmp.
pub fn default_runtime_dir(instance: &str) -> PathBuf {
    let base = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).filter(|p| p.is_dir()).unwrap_or_else(|| Path::new("/tmp").to_path_buf());
    base.join(format!("duet-{instance}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Topology {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../topology/tests/fixtures/sysfs").join(name);
        Topology::read_from(&dir).unwrap()
    }

    #[test]
    fn a_restarted_worker_kept_its_kv_only_at_the_next_generation() {
        assert!(old_generation_kept(1, 2));
        assert!(old_generation_kept(5, 6));
        assert!(!old_generation_kept(3, 1), "a rebuilt arena starts again at 1");
        assert!(!old_generation_kept(1, 1), "the same generation is another arena created afresh");
        assert!(!old_generation_kept(0, 1), "a worker that did not say");
        assert!(old_generation_kept(2, 4), "it restarted twice between two looks, re-attaching each time");
    }

    #[test]
    fn one_cpu_worker_per_node_with_cpus() {
        let one = fixture("one-node");
        assert_eq!((worker_node(&one, 1, 0), worker_node(&one, 2, 1)), (None, None));
        let two = fixture("two-node");
        assert_eq!([worker_node(&two, 2, 0), worker_node(&two, 2, 1)], [Some(0), Some(1)]);
        assert_eq!(worker_node(&two, 1, 0), None);
        assert_eq!(worker_node(&two, 3, 0), None);
        // Four nodes, two of them memory-only: two workers, on the nodes with CPUs.
        let four = fixture("four-node");
        assert_eq!([worker_node(&four, 2, 0), worker_node(&four, 2, 1)], [Some(0), Some(1)]);
        assert_eq!(worker_node(&four, 4, 2), None);
        // Node ids with gaps: the second worker goes to node 2.
        let gaps = Topology { nodes: vec![two.nodes[0].clone(), NumaNode { id: 2, ..two.nodes[1].clone() }] };
        assert_eq!([worker_node(&gaps, 2, 0), worker_node(&gaps, 2, 1)], [Some(0), Some(2)]);
    }
}
