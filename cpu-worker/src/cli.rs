//! Command-line flags of duet-cpu-worker (each also read from a `DUET_*` environment
//! variable) and their conversion into a [`Config`].

use std::path::PathBuf;

use clap::Parser;
use duet_kv::shm::expert_job::EXPERT_SLOT_BYTES;
use duet_kv::shm::job::{slot_bytes_for, DEFAULT_SLOT_BYTES};
use duet_kv::{parse_bytes, KvShape};
use duet_proto::Address;
use duet_topology::parse_cpu_list;

use crate::{Config, KvSize, CpuWorkerError};

#[derive(Debug, Clone, Parser)]
#[command(
    name = "duet-cpu-worker",
    version,
    about = "Duet's cpu-worker: a KV arena in pinned shared memory, serving decode-attention jobs"
)]
pub struct Args {
    /// Instance name shared by one Duet service's processes: segments are
    /// /dev/shm/duet-<instance>-kv-<worker> and /dev/shm/duet-<instance>-xchg-<worker>.
    #[arg(long, env = "DUET_INSTANCE", default_value = "duet")]
    pub instance: String,
    /// Index of this cpu-worker in its instance, the <worker> of its segment names
    /// (default: the --numa-node value, else 0).
    #[arg(long, env = "DUET_WORKER")]
    pub worker: Option<u32>,
    /// GGUF model to read the KV shape from (ignored when --n-layer, --n-kv-head and
    /// --head-dim are given).
    #[arg(long, env = "DUET_MODEL")]
    pub model: Option<PathBuf>,
    /// Model layers (with --n-kv-head and --head-dim, instead of --model).
    #[arg(long, env = "DUET_N_LAYER")]
    pub n_layer: Option<u32>,
    /// KV heads per layer (with --n-layer and --head-dim).
    #[arg(long, env = "DUET_N_KV_HEAD")]
    pub n_kv_head: Option<u32>,
    /// Dimension of one attention head (with --n-layer and --n-kv-head).
    #[arg(long, env = "DUET_HEAD_DIM")]
    pub head_dim: Option<u32>,
    /// Tokens per KV block.
    #[arg(long, env = "DUET_BLOCK_SIZE", default_value_t = duet_kv::layout::DEFAULT_BLOCK_SIZE)]
    pub block_size: u32,
    /// KV cache type: f16, or q8_0 (ggml's 8-bit blocks of 32: 53 % of the bytes, so about
    /// 1.9 times the tokens in the same --kv-bytes; as llama.cpp's `-ctk q8_0 -ctv q8_0`).
    #[arg(long, env = "DUET_KV_TYPE", default_value = "f16", value_parser = duet_kv::parse_kv_type)]
    pub kv_type: duet_kv::KvDtype,
    /// KV arena size in blocks (or give --kv-bytes).
    #[arg(long, env = "DUET_KV_BLOCKS", conflicts_with = "kv_bytes")]
    pub kv_blocks: Option<u32>,
    /// KV arena size in bytes, e.g. 512M or 64G (binary units): as many blocks as fit.
    #[arg(long, env = "DUET_KV_BYTES", value_parser = parse_bytes)]
    pub kv_bytes: Option<usize>,
    /// CPUs to run on, e.g. 1 or 0-3,8: one pinned worker thread per CPU.
    #[arg(long, env = "DUET_CPUS")]
    pub cpus: Option<String>,
    /// NUMA node: the KV arena is bound to it (mbind) and, without --cpus, the threads are
    /// pinned to its CPUs. A node the machine lacks gives a warning, not an error.
    #[arg(long, env = "DUET_NUMA_NODE")]
    pub numa_node: Option<u32>,
    /// Worker threads (default: one per CPU of --cpus or of the node, else every core).
    #[arg(long, env = "DUET_CPU_THREADS")]
    pub threads: Option<usize>,
    /// Slots of the exchange ring: attention jobs that can be in flight at once.
    #[arg(long, env = "DUET_RING_SLOTS", default_value_t = 4)]
    pub ring_slots: u32,
    /// Bytes per ring slot, e.g. 4M: one job's block ids, queries and results must fit.
    /// Default: with --model, one layer's attention job for a step of --step-sequences
    /// sequences over the model's whole context, and 8M at least when serving experts; else 1M.
    #[arg(long, env = "DUET_SLOT_BYTES", value_parser = parse_bytes)]
    pub slot_bytes: Option<usize>,
    /// The most sequences one step attends (the gateway's max_running): what the default
    /// --slot-bytes is sized for.
    #[arg(long, env = "DUET_STEP_SEQUENCES", default_value_t = 64)]
    pub step_sequences: usize,
    /// Serve the gRPC control plane (duet.v1.CpuWorker and grpc.health.v1.Health) on
    /// unix:PATH (socket made 0600) or HOST:PORT. It answers once the arena and the exchange
    /// ring exist: a successful Info or health check means ready for jobs.
    #[arg(long, env = "DUET_CPU_LISTEN")]
    pub listen: Option<Address>,
    /// Remove segments of this worker's names left behind by a previous worker that died
    /// without removing them (e.g. killed by SIGKILL). A running worker's are never removed.
    #[arg(long, env = "DUET_CPU_REPLACE", value_parser = clap::builder::BoolishValueParser::new())]
    pub replace: bool,
    /// Keep the KV arena a previous worker of this name left behind (it crashed: its K/V is
    /// still there) when its header has this worker's layout and model; otherwise rebuild it,
    /// saying why. The exchange ring is rebuilt either way. Needs --model (the model's
    /// identity is checked).
    #[arg(long, env = "DUET_CPU_REATTACH", value_parser = clap::builder::BoolishValueParser::new())]
    pub reattach: bool,
    /// Serve share I of N of a mixture-of-experts model's routed experts (e.g. 0/1: all of
    /// them; 1/2: the second half), computing the expert jobs the gpu-worker posts. Needs
    /// --model.
    #[arg(long, env = "DUET_EXPERTS_OF", conflicts_with = "expert_shares")]
    pub experts_of: Option<crate::experts::ExpertShare>,
    /// Serve share W of N of the routed experts, W being this worker's number (--worker, else
    /// --numa-node): --experts-of W/N for units started per node (systemd's
    /// duet-cpu-worker@W with DUET_EXPERT_SHARES=N in the shared environment file).
    #[arg(long, env = "DUET_EXPERT_SHARES")]
    pub expert_shares: Option<u32>,
    /// Stop, as on SIGTERM, when process PID (which must be this worker's parent) exits:
    /// `duet-gateway serve` passes its own, so that its workers never outlive it.
    #[arg(long)]
    pub parent_pid: Option<u32>,
}

impl Args {
    /// The configuration these flags describe (reads the model's metadata for its shape and
    /// the default slot size).
    pub fn into_config(self) -> Result<Config, CpuWorkerError> {
        let model = self.model.as_deref().map(|m| Ok::<_, CpuWorkerError>((m, crate::model_config(m)?))).transpose()?;
        let shape = match (self.n_layer, self.n_kv_head, self.head_dim, &model) {
            (Some(n_layer), Some(n_kv_head), Some(head_dim), _) => KvShape { n_layer, n_kv_head, head_dim },
            (None, None, None, Some((path, c))) => c.kv_shape().map_err(|source| CpuWorkerError::Model { path: path.to_path_buf(), source })?,
            (None, None, None, None) => {
                return Err(CpuWorkerError::Config("give --model, or --n-layer, --n-kv-head and --head-dim".into()))
            }
            _ => return Err(CpuWorkerError::Config("--n-layer, --n-kv-head and --head-dim go together".into())),
        };
        let kv_size = match (self.kv_blocks, self.kv_bytes) {
            (Some(n), None) => KvSize::Blocks(n),
            (None, Some(bytes)) => KvSize::Bytes(bytes),
            (None, None) => return Err(CpuWorkerError::Config("give the KV arena size: --kv-blocks or --kv-bytes".into())),
            (Some(_), Some(_)) => return Err(CpuWorkerError::Config("--kv-blocks and --kv-bytes exclude each other".into())),
        };
        let cpus = self.cpus.as_deref().map(parse_cpu_list).transpose().map_err(|e| CpuWorkerError::Config(e.to_string()))?;
        let model_id = self.model.as_deref().map(crate::model_identity).transpose()?.unwrap_or(0);
        let worker = self.worker.or(self.numa_node).unwrap_or(0);
        let share = match (self.experts_of, self.expert_shares) {
            (Some(share), _) => Some(share),
            (None, Some(of)) => Some(
                format!("{worker}/{of}").parse::<crate::experts::ExpertShare>().map_err(|e| CpuWorkerError::Config(format!("--expert-shares {of} for worker {worker}: {e}")))?,
            ),
            (None, None) => None,
        };
        let experts = match (share, &self.model) {
            (Some(share), Some(model)) => Some((model.clone(), share)),
            (Some(_), None) => return Err(CpuWorkerError::Config("--experts-of needs --model: the experts are read from it".into())),
            (None, _) => None,
        };
        let slot_bytes = match (self.slot_bytes, &model) {
            (Some(bytes), _) => bytes,
            (None, Some((_, c))) => {
                let attention = slot_bytes_for(self.step_sequences, c.n_head as u32, c.head_dim as u32, c.n_ctx_train, self.block_size as usize);
                if experts.is_some() { attention.max(EXPERT_SLOT_BYTES) } else { attention }
            }
            (None, None) => DEFAULT_SLOT_BYTES,
        };
        if self.reattach && model_id == 0 {
            return Err(CpuWorkerError::Config("--reattach needs --model: the arena's model is checked before its K/V is kept".into()));
        }
        Ok(Config {
            instance: self.instance,
            worker,
            shape,
            block_size: self.block_size,
            kv_type: self.kv_type,
            kv_size,
            cpus,
            numa_node: self.numa_node,
            threads: self.threads,
            ring_slots: self.ring_slots,
            slot_bytes,
            poll: Config::DEFAULT_POLL,
            listen: self.listen,
            replace: self.replace,
            reattach: self.reattach,
            model_id,
            experts,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_kv::layout::DEFAULT_BLOCK_SIZE;

    fn args(extra: &[&str]) -> Args {
        let base = ["duet-cpu-worker", "--instance", "t", "--n-layer", "2", "--n-kv-head", "1", "--head-dim", "8"];
        Args::try_parse_from(base.iter().chain(extra)).unwrap()
    }

    #[test]
    fn flags_to_config() {
        let c = args(&["--kv-blocks", "10", "--cpus", "0-1", "--numa-node", "1"]).into_config().unwrap();
        assert_eq!(c.shape, KvShape { n_layer: 2, n_kv_head: 1, head_dim: 8 });
        assert_eq!((c.kv_size, c.cpus.clone(), c.worker), (KvSize::Blocks(10), Some(vec![0, 1]), 1));
        assert_eq!(c.layout().unwrap().n_blocks, 10);
        let c = args(&["--kv-bytes", "1M", "--worker", "3"]).into_config().unwrap();
        assert_eq!(c.worker, 3);
        let block = 2 * 2 * DEFAULT_BLOCK_SIZE as usize * 8 * 2; // layers x K/V x tokens x dims x bytes
        assert_eq!(c.layout().unwrap().n_blocks as usize, ((1 << 20) - 4096) / block);
        for bad in [&["--cpus", "1-0", "--kv-blocks", "1"][..], &[], &["--kv-bytes", "100"]] {
            assert!(args(bad).into_config().and_then(|c| c.layout()).is_err(), "{bad:?}");
        }
        assert!(Args::try_parse_from(["w", "--kv-blocks", "1", "--kv-bytes", "1M"]).is_err());
        let partial = Args::try_parse_from(["w", "--n-layer", "2", "--kv-blocks", "1"]).unwrap();
        assert!(matches!(partial.into_config(), Err(CpuWorkerError::Config(_))));
    }

    #[test]
    fn control_flags() {
        let c = args(&["--kv-blocks", "1"]).into_config().unwrap();
        assert_eq!((c.listen, c.replace), (None, false));
        let c = args(&["--kv-blocks", "1", "--listen", "unix:/run/duet/cpu0.sock", "--replace"]).into_config().unwrap();
        assert_eq!((c.listen, c.replace), (Some(Address::Unix("/run/duet/cpu0.sock".into())), true));
        let c = args(&["--kv-blocks", "1", "--listen", "127.0.0.1:0"]).into_config().unwrap();
        assert_eq!(c.listen, Some(Address::Tcp("127.0.0.1:0".into())));
        let base = ["w", "--n-layer", "2", "--n-kv-head", "1", "--head-dim", "8", "--kv-blocks", "1"];
        assert!(Args::try_parse_from(base.iter().chain(&["--listen", "nowhere"])).is_err());
    }

    /// Ring slots: 1M without a model, else sized for a step of --step-sequences (64) over the
    /// model's context, at least 8M when serving experts; an explicit --slot-bytes wins. Expert shares:
    /// --expert-shares N serves share W/N, W the worker's number.
    #[test]
    fn slot_sizes_and_expert_shares() {
        let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/tiny/random_q4_k_m.gguf");
        let with_model = |extra: &[&str]| {
            let base = ["w", "--instance", "t", "--kv-blocks", "1", "--model", model];
            Args::try_parse_from(base.iter().chain(extra)).unwrap().into_config()
        };
        assert_eq!(args(&["--kv-blocks", "1"]).into_config().unwrap().slot_bytes, DEFAULT_SLOT_BYTES);
        assert_eq!(args(&["--kv-blocks", "1", "--slot-bytes", "3M"]).into_config().unwrap().slot_bytes, 3 << 20);
        let c = crate::model_config(std::path::Path::new(model)).unwrap();
        let sized = slot_bytes_for(64, c.n_head as u32, c.head_dim as u32, c.n_ctx_train, DEFAULT_BLOCK_SIZE as usize);
        assert_eq!(with_model(&[]).unwrap().slot_bytes, sized);
        // A gateway running up to 1024 sequences a step says so: bigger slots, whole MiBs.
        let big = with_model(&["--step-sequences", "1024"]).unwrap().slot_bytes;
        let need = duet_kv::shm::job::AttnJob::slot_bytes_bound(1024, c.n_head as u32, c.head_dim as u32, c.n_ctx_train.div_ceil(64) + 1).unwrap();
        assert!(big >= need && big > DEFAULT_SLOT_BYTES && big.is_multiple_of(1 << 20), "{big} for {need}");
        let c = with_model(&["--worker", "1", "--expert-shares", "2"]).unwrap();
        assert_eq!(c.experts.map(|(_, share)| share), Some(crate::experts::ExpertShare { index: 1, of: 2 }));
        assert_eq!(c.slot_bytes, sized.max(EXPERT_SLOT_BYTES));
        assert_eq!(with_model(&["--expert-shares", "2", "--slot-bytes", "2M"]).unwrap().slot_bytes, 2 << 20);
        assert!(matches!(with_model(&["--worker", "2", "--expert-shares", "2"]), Err(CpuWorkerError::Config(_))), "worker 2 of 2");
        let base = ["w", "--instance", "t", "--kv-blocks", "1", "--model", model];
        assert!(Args::try_parse_from(base.iter().chain(&["--experts-of", "0/2", "--expert-shares", "2"])).is_err(), "one or the other");
    }
}
