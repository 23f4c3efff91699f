//! `Topology::read_from` on copies of real sysfs `node` directories (tests/fixtures/sysfs):
//! a one-node desktop, a two-socket server with hyperthread siblings, and a two-socket
//! Xeon Max in flat mode whose HBM shows up as two memory-only nodes; then broken trees,
//! each refused with the error naming the file at fault.

use std::path::{Path, PathBuf};

use duet_topology::{format_cpu_list, parse_cpu_list, CpuListError, NumaNode, Topology, TopologyError};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sysfs").join(name)
}

const KIB: u64 = 1024;

fn read_fixture(name: &str) -> Topology {
    Topology::read_from(&fixture(name)).unwrap_or_else(|e| panic!("reading fixture {name}: {e}"))
}

/// The node ids the fixture's `has_cpu` file lists (what the kernel says independently of
/// the per-node files).
fn has_cpu(name: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(fixture(name).join("has_cpu")).unwrap();
    parse_cpu_list(text.trim()).unwrap().into_iter().map(|n| n as u32).collect()
}

#[test]
fn one_node() {
    let t = read_fixture("one-node");
    assert_eq!(t.nodes, vec![NumaNode { id: 0, cpus: (0..16).collect(), memory_bytes: 65799096 * KIB }]);
    assert_eq!(t.nodes_with_cpus().count(), 1);
    assert!(!t.nodes[0].is_memory_only());
    assert_eq!((t.cpu_count(), t.memory_bytes()), (16, 65799096 * KIB));
    assert_eq!(t.to_string(), "node 0: CPUs 0-15, 62.8 GiB");
}

#[test]
fn two_nodes_with_hyperthread_siblings() {
    let t = read_fixture("two-node");
    assert_eq!(t.nodes.len(), 2);
    let (n0, n1) = (&t.nodes[0], &t.nodes[1]);
    assert_eq!(n0.id, 0);
    assert_eq!(n0.cpus, (0..16).chain(32..48).collect::<Vec<_>>());
    assert_eq!(n0.memory_bytes, 196453436 * KIB);
    assert_eq!(n1.id, 1);
    assert_eq!(n1.cpus, (16..32).chain(48..64).collect::<Vec<_>>());
    assert_eq!(n1.memory_bytes, 198175372 * KIB);
    assert_eq!(format_cpu_list(&n0.cpus), "0-15,32-47");
    assert_eq!(format_cpu_list(&n1.cpus), "16-31,48-63");
    assert_eq!(t.nodes_with_cpus().map(|n| n.id).collect::<Vec<_>>(), has_cpu("two-node"));
    assert_eq!(t.cpu_count(), 64);
    assert_eq!(t.node(1), Some(n1));
    assert_eq!(t.node(2), None);
}

#[test]
fn four_nodes_two_of_them_memory_only() {
    let t = read_fixture("four-node");
    assert_eq!(t.nodes.iter().map(|n| n.id).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert_eq!(t.nodes[0].cpus, (0..56).chain(112..168).collect::<Vec<_>>());
    assert_eq!(t.nodes[1].cpus, (56..112).chain(168..224).collect::<Vec<_>>());
    assert_eq!(t.nodes[0].memory_bytes, 527733676 * KIB);
    assert_eq!(t.nodes[1].memory_bytes, 528417880 * KIB);
    // The HBM nodes: memory (64 GiB less the kernel's share), no CPUs.
    for hbm in &t.nodes[2..] {
        assert!(hbm.is_memory_only() && hbm.cpus.is_empty(), "{hbm:?}");
        assert_eq!(hbm.memory_bytes, 66060288 * KIB);
    }
    // Local mode runs a cpu-worker on each node with CPUs only.
    assert_eq!(t.nodes_with_cpus().map(|n| n.id).collect::<Vec<_>>(), [0, 1]);
    assert_eq!(t.nodes_with_cpus().map(|n| n.id).collect::<Vec<_>>(), has_cpu("four-node"));
    assert_eq!(t.cpu_count(), 224);
    assert_eq!(t.memory_bytes(), (527733676 + 528417880 + 2 * 66060288) * KIB);
    assert_eq!(t.nodes[2].to_string(), "node 2: no CPUs, 63.0 GiB");
}

/// A scratch copy of fixture `name`, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn copy_of(name: &str, tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("duet-topology-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        copy_dir(&fixture(name), &dir);
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

#[test]
fn the_copies_read_like_the_fixture() {
    let s = Scratch::copy_of("two-node", "copy");
    assert_eq!(Topology::read_from(&s.0).unwrap(), read_fixture("two-node"));
}

#[test]
fn a_garbled_cpulist_is_refused_naming_the_file() {
    let s = Scratch::copy_of("two-node", "garbled");
    let path = s.0.join("node1/cpulist");
    std::fs::write(&path, "16-31,48-6x\n").unwrap();
    match Topology::read_from(&s.0) {
        Err(TopologyError::BadCpuList { path: p, source: CpuListError::NotANumber { entry, .. } }) => {
            assert_eq!((p, entry.as_str()), (path.clone(), "6x"));
        }
        other => panic!("expected a bad CPU list, got {other:?}"),
    }
    std::fs::write(&path, "31-16\n").unwrap();
    let e = Topology::read_from(&s.0).unwrap_err();
    assert!(matches!(&e, TopologyError::BadCpuList { source: CpuListError::Reversed { .. }, .. }), "{e:?}");
    assert!(e.to_string().contains("node1/cpulist"), "{e}");
}

#[test]
fn a_missing_meminfo_is_refused_naming_the_file() {
    let s = Scratch::copy_of("four-node", "no-meminfo");
    let path = s.0.join("node3/meminfo");
    std::fs::remove_file(&path).unwrap();
    match Topology::read_from(&s.0) {
        Err(TopologyError::Unreadable { path: p, source }) => {
            assert_eq!(p, path);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected an unreadable meminfo, got {other:?}"),
    }
}

#[test]
fn a_bad_meminfo_line_is_refused_naming_file_and_line() {
    let s = Scratch::copy_of("one-node", "bad-meminfo");
    let path = s.0.join("node0/meminfo");
    let text = std::fs::read_to_string(&path).unwrap().replacen("65799096 kB", "lots kB", 1);
    std::fs::write(&path, text).unwrap();
    match Topology::read_from(&s.0) {
        Err(TopologyError::BadMeminfoLine { path: p, line, text }) => {
            assert_eq!((p, line), (path.clone(), 1));
            assert!(text.contains("MemTotal:") && text.contains("lots"), "{text:?}");
        }
        other => panic!("expected a bad meminfo line, got {other:?}"),
    }
    // A meminfo without its MemTotal line.
    std::fs::write(&path, "Node 0 MemFree:  1 kB\n").unwrap();
    assert!(matches!(Topology::read_from(&s.0), Err(TopologyError::NoMemTotal { path: p }) if p == path));
}

#[test]
fn a_directory_without_nodes_is_refused() {
    let s = Scratch::copy_of("one-node", "no-nodes");
    std::fs::remove_dir_all(s.0.join("node0")).unwrap();
    assert!(matches!(Topology::read_from(&s.0), Err(TopologyError::NoNodes { path }) if path == s.0));
    let missing = s.0.join("absent");
    assert!(matches!(Topology::read_from(&missing), Err(TopologyError::Unreadable { path, .. }) if path == missing));
}
