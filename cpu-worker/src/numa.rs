//! Where the worker runs and where its memory lives: the CPUs and existence of a NUMA node
//! (from `/sys/devices/system/node`), pinning a thread (`sched_setaffinity`) and binding a
//! mapping to a node (`mbind`, `MPOL_BIND`). CPU lists (`0-3,8`) are parsed by
//! [`duet_topology::parse_cpu_list`].

use std::path::Path;

use duet_kv::shm::Segment;
use duet_topology::{parse_cpu_list, MAX_CPUS, SYSFS_NODE_DIR};
// The affinity query lives in duet-topology (the topology's no-NUMA fallback uses it too).
pub use duet_topology::allowed_cpus;

/// Restricts the calling thread to `cpus` (each below [`MAX_CPUS`], as
/// [`parse_cpu_list`] guarantees).
pub fn pin_current_thread(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: as in `allowed_cpus`; CPU_SET is given CPUs below CPU_SETSIZE (checked here),
    // and pid 0 names the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus.iter().filter(|&&c| c < MAX_CPUS) {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// What this machine says about NUMA node `node`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeInfo {
    /// The node exists; its CPUs (possibly none: a memory-only node).
    Present { cpus: Vec<usize> },
    /// The machine has NUMA nodes, but not this one.
    Absent { nodes: Vec<u32> },
    /// The kernel exposes no NUMA information (`/sys/devices/system/node` is missing).
    Unknown,
}

/// Looks node `node` up in `/sys/devices/system/node`.
pub fn node_info(node: u32) -> NodeInfo {
    node_info_in(Path::new(SYSFS_NODE_DIR), node)
}

fn node_info_in(dir: &Path, node: u32) -> NodeInfo {
    let Ok(entries) = std::fs::read_dir(dir) else { return NodeInfo::Unknown };
    let mut nodes: Vec<u32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("node")?.parse().ok())
        .collect();
    nodes.sort_unstable();
    if !nodes.contains(&node) {
        return NodeInfo::Absent { nodes };
    }
    let list = std::fs::read_to_string(dir.join(format!("node{node}/cpulist"))).unwrap_or_default();
    let cpus = if list.trim().is_empty() { Vec::new() } else { parse_cpu_list(list.trim()).unwrap_or_default() };
    NodeInfo::Present { cpus }
}

/// Binds the pages of this process's mapping of `seg` to NUMA node `node` with
/// `MPOL_BIND`: pages faulted in from now on come from that node (for a shared-memory file,
/// the policy is the file's, so it holds for every process's faults).
pub fn bind_to_node(seg: &Segment, node: u32) -> std::io::Result<()> {
    let (addr, len) = (seg.as_ptr(), seg.len());
    let bits = libc::c_ulong::BITS as usize;
    let node = node as usize;
    let mut mask = vec![0 as libc::c_ulong; node / bits + 1];
    mask[node / bits] |= 1 << (node % bits);
    // The kernel reads maxnode - 1 bits of the mask.
    let maxnode = (mask.len() * bits + 1) as libc::c_ulong;
    // SAFETY: mbind only changes the memory policy of the given range, the segment's live,
    // page-aligned mapping; it reads the mask, a live array of `maxnode - 1` bits.
    let rc = unsafe {
        libc::syscall(libc::SYS_mbind, addr, len as libc::c_ulong, libc::MPOL_BIND, mask.as_ptr(), maxnode, 0u32)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_from_a_sysfs_tree() {
        let dir = std::env::temp_dir().join(format!("duet-numa-test-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("node0")).unwrap();
        std::fs::create_dir_all(dir.join("node2")).unwrap();
        std::fs::write(dir.join("node0/cpulist"), "0-3,8\n").unwrap();
        std::fs::write(dir.join("node2/cpulist"), "\n").unwrap();
        assert_eq!(node_info_in(&dir, 0), NodeInfo::Present { cpus: vec![0, 1, 2, 3, 8] });
        assert_eq!(node_info_in(&dir, 2), NodeInfo::Present { cpus: vec![] });
        assert_eq!(node_info_in(&dir, 1), NodeInfo::Absent { nodes: vec![0, 2] });
        assert_eq!(node_info_in(&dir.join("missing"), 0), NodeInfo::Unknown);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn this_process_may_pin_to_a_cpu_it_is_allowed() {
        let allowed = allowed_cpus().expect("sched_getaffinity");
        assert!(!allowed.is_empty());
        std::thread::spawn(move || {
            pin_current_thread(&allowed[..1]).unwrap();
            assert_eq!(allowed_cpus().unwrap(), allowed[..1].to_vec());
        })
        .join()
        .unwrap();
    }
}
