//! The machine's NUMA topology as Linux describes it in `/sys/devices/system/node`: each
//! node's CPUs (`nodeN/cpulist`) and memory (`nodeN/meminfo`), and the CPU-list syntax
//! (`0-3,8`) those files, `--cpus` flags and systemd's `CPUAffinity=` share.
//!
//! A machine whose kernel has no NUMA support (no `/sys/devices/system/node`) is one node 0
//! holding the CPUs this process may run on and all of `/proc/meminfo`'s memory.

use std::fmt;
use std::path::{Path, PathBuf};

/// Where Linux describes NUMA nodes.
pub const SYSFS_NODE_DIR: &str = "/sys/devices/system/node";
/// Where Linux gives the machine's total memory (used without NUMA).
const PROC_MEMINFO: &str = "/proc/meminfo";
/// Highest CPU number + 1 that an affinity mask (`cpu_set_t`) holds.
pub const MAX_CPUS: usize = libc::CPU_SETSIZE as usize;

/// Why a CPU list such as `0-3,8` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CpuListError {
    #[error("empty entry in CPU list {list:?}")]
    EmptyEntry { list: String },
    #[error("{entry:?} in CPU list {list:?} is not a CPU number")]
    NotANumber { entry: String, list: String },
    #[error("reversed range {entry:?} in CPU list {list:?}")]
    Reversed { entry: String, list: String },
    #[error("CPU {cpu} in {list:?} is beyond the {MAX_CPUS} CPUs an affinity mask holds")]
    TooLarge { cpu: usize, list: String },
}

/// Parses a Linux CPU list such as `1`, `0-3,8` or `0-1, 4-5` into sorted, distinct CPU
/// numbers. Refuses empty lists, reversed ranges and CPUs an affinity mask cannot hold
/// (at or beyond [`MAX_CPUS`]).
pub fn parse_cpu_list(list: &str) -> Result<Vec<usize>, CpuListError> {
    let mut cpus = Vec::new();
    for part in list.split(',').map(str::trim) {
        if part.is_empty() {
            return Err(CpuListError::EmptyEntry { list: list.into() });
        }
        let num = |s: &str| {
            s.trim().parse::<usize>().map_err(|_| CpuListError::NotANumber { entry: s.into(), list: list.into() })
        };
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(part)?, num(part)?),
        };
        if lo > hi {
            return Err(CpuListError::Reversed { entry: part.into(), list: list.into() });
        }
        if hi >= MAX_CPUS {
            return Err(CpuListError::TooLarge { cpu: hi, list: list.into() });
        }
        cpus.extend(lo..=hi);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// Writes CPU numbers as a Linux CPU list, runs as ranges: `[0, 1, 2, 3, 8]` is `0-3,8`
/// (the form `--cpus` and systemd's `CPUAffinity=` take). The input need not be sorted;
/// duplicates are dropped; an empty slice gives an empty string.
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        parts.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
        i += 1;
    }
    parts.join(",")
}

/// The CPUs this process may run on (`sched_getaffinity`), or `None` if it cannot be read.
pub fn allowed_cpus() -> Option<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data (all-zero is the empty set); sched_getaffinity writes
    // at most `size_of::<cpu_set_t>()` bytes into it; CPU_ISSET reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        Some((0..MAX_CPUS).filter(|&c| libc::CPU_ISSET(c, &set)).collect())
    }
}

/// Why the topology could not be read. Each variant names the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("reading {}: {source}", path.display())]
    Unreadable { path: PathBuf, source: std::io::Error },
    #[error("{}: bad CPU list: {source}", path.display())]
    BadCpuList { path: PathBuf, source: CpuListError },
    #[error("{} line {line}: {text:?} is not a `[Node N] MemTotal: <number> kB` line", path.display())]
    BadMeminfoLine { path: PathBuf, line: usize, text: String },
    #[error("{}: no MemTotal line", path.display())]
    NoMemTotal { path: PathBuf },
    #[error("{} holds no nodeN directories", path.display())]
    NoNodes { path: PathBuf },
}

/// One NUMA node: its CPUs and its memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    /// The N of `nodeN` (ids can have gaps).
    pub id: u32,
    /// Its CPUs, sorted; empty for a memory-only node (CXL memory, HBM, ...).
    pub cpus: Vec<usize>,
    /// Its `MemTotal`, in bytes.
    pub memory_bytes: u64,
}

impl NumaNode {
    /// True for a node without CPUs (memory only): no cpu-worker runs there.
    pub fn is_memory_only(&self) -> bool {
        self.cpus.is_empty()
    }
}

/// The machine's NUMA nodes, sorted by id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub nodes: Vec<NumaNode>,
}

impl Topology {
    /// Reads this machine's topology from [`SYSFS_NODE_DIR`]; without it (a kernel with no
    /// NUMA support), [`Topology::without_numa`].
    pub fn read() -> Result<Topology, TopologyError> {
        let root = Path::new(SYSFS_NODE_DIR);
        if !root.exists() {
            return Topology::without_numa();
        }
        Topology::read_from(root)
    }

    /// Reads the topology from `root`, a sysfs `node` directory: one node per `nodeN`
    /// subdirectory, its CPUs from `nodeN/cpulist` (empty for a memory-only node), its
    /// memory from the `Node N MemTotal: <n> kB` line of `nodeN/meminfo`.
    pub fn read_from(root: &Path) -> Result<Topology, TopologyError> {
        let unreadable = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TopologyError::Unreadable { path, source }
        };
        let mut ids = Vec::new();
        for entry in std::fs::read_dir(root).map_err(unreadable(root))? {
            let entry = entry.map_err(unreadable(root))?;
            let id = entry.file_name().to_str().and_then(|n| n.strip_prefix("node")).and_then(|n| n.parse::<u32>().ok());
            if let Some(id) = id.filter(|_| entry.path().is_dir()) {
                ids.push(id);
            }
        }
        if ids.is_empty() {
            return Err(TopologyError::NoNodes { path: root.to_path_buf() });
        }
        ids.sort_unstable();
        let nodes = ids
            .into_iter()
            .map(|id| {
                let dir = root.join(format!("node{id}"));
                let cpulist = dir.join("cpulist");
                let text = std::fs::read_to_string(&cpulist).map_err(unreadable(&cpulist))?;
                let cpus = match text.trim() {
                    "" => Vec::new(),
                    list => parse_cpu_list(list).map_err(|source| TopologyError::BadCpuList { path: cpulist, source })?,
                };
                let meminfo = dir.join("meminfo");
                let text = std::fs::read_to_string(&meminfo).map_err(unreadable(&meminfo))?;
                let memory_bytes = mem_total(&meminfo, &text, Some(id))?;
                Ok(NumaNode { id, cpus, memory_bytes })
            })
            .collect::<Result<Vec<_>, TopologyError>>()?;
        Ok(Topology { nodes })
    }

    /// One node 0 with the CPUs this process may run on (`sched_getaffinity`, else
    /// `0..available_parallelism`) and the machine's `MemTotal` from `/proc/meminfo`: the
    /// topology of a machine whose kernel exposes no NUMA nodes.
    pub fn without_numa() -> Result<Topology, TopologyError> {
        let cpus = allowed_cpus()
            .filter(|c| !c.is_empty())
            .unwrap_or_else(|| (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect());
        let path = Path::new(PROC_MEMINFO);
        let text = std::fs::read_to_string(path)
            .map_err(|source| TopologyError::Unreadable { path: path.to_path_buf(), source })?;
        let memory_bytes = mem_total(path, &text, None)?;
        Ok(Topology { nodes: vec![NumaNode { id: 0, cpus, memory_bytes }] })
    }

    /// The nodes that have CPUs (those a cpu-worker can run on), by id.
    pub fn nodes_with_cpus(&self) -> impl Iterator<Item = &NumaNode> + '_ {
        self.nodes.iter().filter(|n| !n.is_memory_only())
    }

    /// Node `id`, if the machine has it.
    pub fn node(&self, id: u32) -> Option<&NumaNode> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// Every node's memory together, in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.nodes.iter().map(|n| n.memory_bytes).sum()
    }

    /// Every node's CPUs together.
    pub fn cpu_count(&self) -> usize {
        self.nodes.iter().map(|n| n.cpus.len()).sum()
    }
}

impl fmt::Display for NumaNode {
    /// `node 1: CPUs 16-31,48-63, 125.8 GiB` (or `no CPUs` for a memory-only node).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = self.memory_bytes as f64 / (1u64 << 30) as f64;
        if self.cpus.is_empty() {
            write!(f, "node {}: no CPUs, {gib:.1} GiB", self.id)
        } else {
            write!(f, "node {}: CPUs {}, {gib:.1} GiB", self.id, format_cpu_list(&self.cpus))
        }
    }
}

impl fmt::Display for Topology {
    /// The nodes, `; `-separated.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, node) in self.nodes.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{node}")?;
        }
        Ok(())
    }
}

/// The `MemTotal` of a meminfo file in bytes: `Node N MemTotal: <n> kB` in a node's
/// (`node` = `Some(N)`, and N must match), `MemTotal: <n> kB` in `/proc/meminfo`.
fn mem_total(path: &Path, text: &str, node: Option<u32>) -> Result<u64, TopologyError> {
    for (i, line) in text.lines().enumerate() {
        let mut words = line.split_whitespace();
        if node.is_some() {
            // "Node" and its number come first.
            let (Some("Node"), Some(_)) = (words.next(), words.next()) else { continue };
        }
        if words.next() != Some("MemTotal:") {
            continue;
        }
        let bad = || TopologyError::BadMeminfoLine { path: path.to_path_buf(), line: i + 1, text: line.into() };
        if let Some(id) = node {
            let own = line.split_whitespace().nth(1).and_then(|n| n.parse::<u32>().ok());
            if own != Some(id) {
                return Err(bad());
            }
        }
        let kib: u64 = words.next().and_then(|n| n.parse().ok()).ok_or_else(bad)?;
        if words.next() != Some("kB") || words.next().is_some() {
            return Err(bad());
        }
        return kib.checked_mul(1024).ok_or_else(bad);
    }
    Err(TopologyError::NoMemTotal { path: path.to_path_buf() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("1"), Ok(vec![1]));
        assert_eq!(parse_cpu_list("0-3,8"), Ok(vec![0, 1, 2, 3, 8]));
        assert_eq!(parse_cpu_list(" 4-5, 0-1 ,5"), Ok(vec![0, 1, 4, 5]));
        for bad in ["", "1,", "a", "3-1", "1-", "-1", "0-99999"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad:?}");
        }
        assert!(matches!(parse_cpu_list("3-1"), Err(CpuListError::Reversed { .. })));
        assert!(matches!(parse_cpu_list("1,,2"), Err(CpuListError::EmptyEntry { .. })));
        assert!(matches!(parse_cpu_list("0-x"), Err(CpuListError::NotANumber { .. })));
        assert!(matches!(parse_cpu_list("0-99999"), Err(CpuListError::TooLarge { cpu: 99999, .. })));
    }

    #[test]
    fn cpu_lists_formatted() {
        assert_eq!(format_cpu_list(&[]), "");
        assert_eq!(format_cpu_list(&[5]), "5");
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8]), "0-3,8");
        assert_eq!(format_cpu_list(&[8, 3, 2, 1, 0, 3]), "0-3,8");
        assert_eq!(format_cpu_list(&[0, 2, 4]), "0,2,4");
        assert_eq!(format_cpu_list(&[1, 2]), "1-2");
        for list in ["0-15,32-47", "0", "0-3,8,10-11", "16-31,48-63"] {
            assert_eq!(format_cpu_list(&parse_cpu_list(list).unwrap()), list);
        }
    }

    #[test]
    fn meminfo_lines() {
        let p = Path::new("meminfo");
        assert_eq!(mem_total(p, "Node 2 MemFree: 1 kB\nNode 2 MemTotal:   4 kB\n", Some(2)).unwrap(), 4096);
        assert_eq!(mem_total(p, "MemTotal:       16318480 kB\nMemFree: 1 kB\n", None).unwrap(), 16318480 * 1024);
        for bad in ["Node 1 MemTotal: 4 kB", "Node 2 MemTotal: x kB", "Node 2 MemTotal: 4", "Node 2 MemTotal: 4 MB"] {
            assert!(matches!(mem_total(p, bad, Some(2)), Err(TopologyError::BadMeminfoLine { line: 1, .. })), "{bad:?}");
        }
        assert!(matches!(mem_total(p, "Node 2 MemFree: 1 kB\n", Some(2)), Err(TopologyError::NoMemTotal { .. })));
    }

    #[test]
    fn this_machine() {
        // Whatever the machine, it has a node with CPUs and some memory.
        let t = Topology::read().expect("reading this machine's topology");
        assert!(t.nodes_with_cpus().count() >= 1, "{t}");
        assert!(t.memory_bytes() > 0 && t.cpu_count() > 0, "{t}");
        let t = Topology::without_numa().unwrap();
        assert_eq!((t.nodes.len(), t.nodes[0].id), (1, 0));
        assert!(!t.nodes[0].cpus.is_empty());
    }
}
