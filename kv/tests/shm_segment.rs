//! Tests of shared-memory segments beyond the unit tests: name and size checks, refusal of
//! symlinks and loose modes, bounds-checked views, a real mlock refusal under a small
//! RLIMIT_MEMLOCK (in a child process, which may lower its limit and drop root freely), and
//! huge pages where `/dev/shm`'s mount grants them.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use duet_kv::shm::{Segment, ShmError, SHM_DIR};

/// Set in a re-executed copy of this test binary: run the memlock refusal as the child.
const CHILD_ENV: &str = "DUET_SHM_MEMLOCK_CHILD";

fn unique(tag: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("duet-test-{}-{tag}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

#[test]
fn bad_names_and_sizes_are_refused() {
    let long = "x".repeat(256);
    for name in ["", "a/b", "..", ".hidden", "sp ace", "nul\0", "é", long.as_str()] {
        assert!(matches!(Segment::create(name, 64), Err(ShmError::BadName { .. })), "{name:?}");
        assert!(matches!(Segment::open(name), Err(ShmError::BadName { .. })), "{name:?}");
    }
    assert!(Segment::create(&"y".repeat(255), 64).is_ok(), "255 bytes is allowed");
    assert!(matches!(Segment::create(&unique("zero"), 0), Err(ShmError::TooSmall { .. })));
    // Larger than /dev/shm's free space: refused up front instead of a SIGBUS on first touch.
    let huge = Segment::create(&unique("huge"), usize::MAX / 2);
    assert!(matches!(&huge, Err(ShmError::TooSmall { what, .. }) if what.contains("free space")), "{huge:?}");
}

#[test]
fn open_refuses_symlinks_and_loose_modes() {
    let target = Segment::create(&unique("target"), 64).unwrap();
    let link = unique("link");
    let link_path = Path::new(SHM_DIR).join(&link);
    std::os::unix::fs::symlink(target.path(), &link_path).unwrap();
    let r = Segment::open(&link);
    std::fs::remove_file(&link_path).unwrap();
    assert!(matches!(&r, Err(ShmError::Permission { reason, .. }) if reason.contains("symbolic link")), "{r:?}");

    std::fs::set_permissions(target.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
    let r = Segment::open(target.name());
    assert!(matches!(&r, Err(ShmError::Permission { reason, .. }) if reason.contains("0600")), "{r:?}");
}

#[test]
#[should_panic(expected = "outside")]
fn views_are_bounds_checked() {
    let s = Segment::create(&unique("bounds"), 64).unwrap();
    s.atomic_u64(64);
}

#[test]
#[should_panic(expected = "not aligned")]
fn views_are_alignment_checked() {
    let s = Segment::create(&unique("align"), 64).unwrap();
    s.atomic_u32(2);
}

#[test]
fn small_segment_locks() {
    // 64 KiB fits under any default memlock limit (8 MiB on most distributions).
    let s = Segment::create(&unique("lock"), 64 << 10).unwrap();
    assert!(s.lock().is_ok());
}

/// The child half of `mlock_refusal_warns_and_keeps_going`; returns at once without the env.
#[test]
fn memlock_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let rl = libc::rlimit { rlim_cur: 64 << 10, rlim_max: 64 << 10 };
    // SAFETY: rl is a valid rlimit; lowering a limit needs no privilege.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl) }, 0);
    // SAFETY: geteuid/setresuid have no memory preconditions. Root has CAP_IPC_LOCK, which
    // ignores the limit: become `nobody` (dropping every capability) to see the refusal.
    if unsafe { libc::geteuid() } == 0 && unsafe { libc::setresuid(65534, 65534, 65534) } != 0 {
        println!("SKIPPED: could not drop root");
        return;
    }
    let seg = Segment::create(&unique("memlock"), 1 << 20).unwrap();
    let w = seg.lock().expect_err("a 1 MiB lock under a 64 KiB limit must be refused");
    assert_eq!((w.needed_bytes, w.soft_limit_bytes), (1 << 20, Some(64 << 10)));
    let text = w.to_string();
    assert!(text.contains("RLIMIT_MEMLOCK is 65536 bytes") && text.contains("1048576 bytes"), "{text}");
    // Still usable, unlocked.
    seg.atomic_u64(1 << 19).store(42, Ordering::Relaxed);
    assert_eq!(seg.atomic_u64(1 << 19).load(Ordering::Relaxed), 42);
    println!("WARNING TEXT: {text}");
}

#[test]
fn mlock_refusal_warns_and_keeps_going() {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["memlock_child", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("WARNING TEXT") || stdout.contains("SKIPPED"), "{stdout}");
    // libtest may print "test memlock_child ... " on the same line as the child's output.
    for line in stdout.lines() {
        if let Some(at) = line.find("WARNING TEXT").or_else(|| line.find("SKIPPED")) {
            println!("child: {}", &line[at..]);
        }
    }
}

/// `/dev/shm`'s tmpfs `huge=` mount option, if any.
fn shm_huge_option() -> Option<String> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    let line = mounts.lines().rfind(|l| l.split_whitespace().nth(1) == Some(SHM_DIR))?;
    let options = line.split_whitespace().nth(3)?;
    options.split(',').find_map(|o| o.strip_prefix("huge=")).map(str::to_string)
}

#[test]
fn segments_may_take_huge_pages_where_the_shm_mount_allows_them() {
    let Some(huge) = shm_huge_option().filter(|h| h != "never" && h != "deny") else {
        eprintln!("skipped: {SHM_DIR} is not mounted with huge=advise, always or within_size");
        return;
    };
    let seg = Segment::create(&unique("thp"), 8 << 20).unwrap();
    // SAFETY: this test's own fresh segment; nothing else maps it.
    let bytes = unsafe { std::slice::from_raw_parts_mut(seg.as_ptr(), 8 << 20) };
    bytes.iter_mut().step_by(4096).for_each(|b| *b = 1);
    // The mapping's huge pages, from this process's smaps.
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    // The segment's entry: its address range's line, then its `Key: value` lines.
    let start = format!("{:x}-", seg.as_ptr() as usize);
    let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&start));
    let head = lines.next().unwrap_or_default();
    let entry: String = std::iter::once(head).chain(lines.take_while(|l| l.contains(": ") || l.ends_with(':'))).collect::<Vec<_>>().join("\n");
    // Eligible for huge pages: what the advice decides. Whether the kernel found free 2 MiB
    // pages depends on the machine's fragmentation, so that is only printed.
    let field = |key: &str| entry.lines().find_map(|l| l.strip_prefix(key)).map(|v| v.trim().trim_end_matches("kB").trim().to_string());
    let Some(eligible) = field("THPeligible:") else {
        eprintln!("skipped: this kernel's smaps has no THPeligible field");
        return;
    };
    assert_eq!(eligible, "1", "{SHM_DIR} mounted huge={huge}, yet the segment may not take huge pages:\n{entry}");
    let pmd_kb: u64 = field("ShmemPmdMapped:").and_then(|v| v.parse().ok()).unwrap_or(0);
    eprintln!("{pmd_kb} kB of the segment in huge pages");
}
