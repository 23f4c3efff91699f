//! Shared by the integration tests: starting the real duet-cpu-worker binary under a unique
//! instance name, attaching to its exchange ring as the gpu-worker does, signalling it and
//! waiting for it to exit; everything is killed and removed if a test fails midway.

#![allow(dead_code)] // each test binary uses its own part

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use duet_kernels::attention::AttnShape;
use duet_kv::layout::HEADER_BYTES as ARENA_HEADER_BYTES;
use duet_kv::ArenaLayout;
use duet_kv::shm::{Producer, Ring, Segment};
use duet_cpu_worker::{arena_name, ring_name};

pub const SHAPE: AttnShape = AttnShape { n_head: 6, n_kv_head: 2, head_dim: 64, softcap: None };
pub const N_LAYER: u32 = 2;
pub const BLOCK_SIZE: usize = 16;
pub const WAIT: Duration = Duration::from_secs(20);

/// A worker process; killed, and its segments removed, if still there when dropped.
pub struct Worker {
    pub child: Child,
    pub instance: String,
    pub worker: u32,
}

impl Drop for Worker {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = Segment::remove(&arena_name(&self.instance, self.worker));
        let _ = Segment::remove(&ring_name(&self.instance, self.worker));
    }
}

impl Worker {
    /// The command line of worker `worker` of `instance` with `kv_blocks` blocks of the
    /// tests' shape on CPU 1, plus `extra` flags; stdout discarded.
    pub fn command(instance: &str, worker: u32, kv_blocks: u32, extra: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_duet-cpu-worker"));
        cmd.args(["--instance", instance, "--worker", &worker.to_string(), "--cpus", "1"])
            .args(["--n-layer", &N_LAYER.to_string(), "--n-kv-head", &SHAPE.n_kv_head.to_string()])
            .args(["--head-dim", &SHAPE.head_dim.to_string(), "--block-size", &BLOCK_SIZE.to_string()])
            .args(["--kv-blocks", &kv_blocks.to_string(), "--slot-bytes", "256K"])
            .args(extra)
            .env_remove("DUET_MODEL")
            .env_remove("DUET_CPU_LISTEN")
            .env_remove("DUET_CPU_REPLACE")
            .stdout(Stdio::null());
        cmd
    }

    /// Starts `cmd` as worker `worker` of `instance`.
    pub fn spawn(mut cmd: Command, instance: &str, worker: u32) -> Worker {
        let child = cmd.spawn().expect("starting duet-cpu-worker");
        Worker { child, instance: instance.to_string(), worker }
    }

    /// Starts worker `worker` of `instance` (see [`Worker::command`]).
    pub fn start(instance: &str, worker: u32, kv_blocks: u32, extra: &[&str]) -> Worker {
        Worker::spawn(Worker::command(instance, worker, kv_blocks, extra), instance, worker)
    }

    /// Sends `signal` to the worker.
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill has no memory effects; the pid is our child's, not yet reaped.
        assert_eq!(unsafe { libc::kill(self.child.id() as libc::pid_t, signal) }, 0, "kill({signal})");
    }

    /// Waits up to `within` for the worker to exit.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        wait_exit(&mut self.child, within)
    }

    /// Panics if the worker has exited (`why` says what it was waited for).
    pub fn assert_running(&mut self, why: &str) {
        if let Some(status) = self.child.try_wait().expect("try_wait") {
            panic!("the worker exited with {status} {why}");
        }
    }

    /// The worker's segment files in /dev/shm.
    pub fn segment_paths(&self) -> [PathBuf; 2] {
        [arena_name(&self.instance, self.worker), ring_name(&self.instance, self.worker)]
            .map(|name| Path::new(duet_kv::shm::SHM_DIR).join(name))
    }
}

/// Waits up to `within` for `child` to exit.
pub fn wait_exit(child: &mut Child, within: Duration) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        assert!(start.elapsed() < within, "the worker did not exit within {within:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until the worker's ring exists and attaches (the arena is ready by then); returns
/// the arena segment, its layout (read from its header) and a producer on the ring.
pub fn attach(worker: &mut Worker) -> (Segment, ArenaLayout, Producer) {
    let start = Instant::now();
    let producer = loop {
        let ring = Segment::open(&ring_name(&worker.instance, worker.worker))
            .map_err(|e| e.to_string())
            .and_then(|seg| Ring::attach(seg).map_err(|e| e.to_string()));
        match ring {
            Ok(ring) => break ring.producer(),
            Err(e) => {
                worker.assert_running(&format!("before its ring appeared ({e})"));
                assert!(start.elapsed() < WAIT, "no exchange ring after {WAIT:?}: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    };
    let arena = Segment::open(&arena_name(&worker.instance, worker.worker)).unwrap();
    // SAFETY: the worker wrote the header before creating the ring and never writes it again.
    let layout = ArenaLayout::decode_header(unsafe { arena.slice::<u8>(0, ARENA_HEADER_BYTES) }).unwrap();
    (arena, layout, producer)
}

/// A directory of its own under the system's temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("duet-cpu-test-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("creating the test's directory");
        TempDir(dir)
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
