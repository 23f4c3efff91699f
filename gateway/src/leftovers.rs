//! The start-up sweep of shared memory that dead local gateways left. A local gateway names
//! its instance after its pid ([`default_instance`]), so no later gateway reuses the name and
//! removes its segments the way a worker's `--replace` does. When a gateway dies alone, its
//! workers stop by themselves and remove their own (`duet_proto::lifeline`); when it dies
//! together with them (SIGKILL to the whole group, the OOM killer, a power-cut container),
//! their KV arenas and rings, a gigabyte or more of RAM each, would stay in `/dev/shm` until
//! the next reboot. So a local gateway removes, before it starts its workers, the segments
//! of every `duet-<pid>` instance whose gateway process is gone and whose arenas no running
//! cpu-worker holds (their owner lock, `duet_kv::shm::owner`).

use std::collections::BTreeMap;
use std::path::Path;

use duet_kv::shm::owner::{parse_segment_name, probe, Holder, SegmentKind};
use duet_kv::shm::{Segment, SHM_DIR};

/// The instance name of the local gateway whose pid is `pid`, unless `--instance` names it.
pub fn default_instance(pid: u32) -> String {
    format!("duet-{pid}")
}

/// The gateway pid in a [`default_instance`] name.
fn gateway_pid(instance: &str) -> Option<u32> {
    let pid = instance.strip_prefix("duet-")?;
    pid.bytes().all(|b| b.is_ascii_digit()).then(|| pid.parse().ok()).flatten()
}

/// Removes the segments of every dead local gateway's instance (see the module), saying so
/// for each; returns the bytes freed. Never fails: what it cannot read or remove it leaves.
pub fn sweep_dead_instances() -> u64 {
    sweep(|_| true)
}

/// At a local gateway's stop, once its workers are: removes the segments of its own
/// `instance` that no worker holds (a worker that stops removes its own; one killed for not
/// stopping in time leaves them). Returns the bytes freed.
pub fn sweep_own_instance(instance: &str) -> u64 {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else { return 0 };
    let mut freed = 0;
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if parse_segment_name(&name).is_none_or(|(i, _, _)| i != instance) {
            continue;
        }
        if !matches!(probe(&entry.path()), Ok(Holder::Nobody)) {
            continue;
        }
        freed += remove(&name, "a worker killed at the stop left");
    }
    freed
}

/// Removes segment `name`, which `left` says who left, saying so; its bytes, if removed.
fn remove(name: &str, left: &str) -> u64 {
    let bytes = std::fs::symlink_metadata(Path::new(SHM_DIR).join(name)).map_or(0, |m| m.len());
    match Segment::remove(name) {
        Ok(true) => {
            tracing::warn!(segment = %name, bytes, "removed a segment {left}");
            bytes
        }
        Ok(false) => 0,
        Err(e) => {
            tracing::warn!(segment = %name, "cannot remove a segment {left}: {e}");
            0
        }
    }
}

/// [`sweep_dead_instances`] of the instances `only` accepts.
fn sweep(only: impl Fn(&str) -> bool) -> u64 {
    let own = std::process::id();
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else { return 0 };
    let mut by_gateway: BTreeMap<u32, Vec<(String, SegmentKind)>> = BTreeMap::new();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((instance, _, kind)) = parse_segment_name(&name) else { continue };
        match gateway_pid(instance) {
            Some(pid) if pid != own && only(instance) => by_gateway.entry(pid).or_default().push((name, kind)),
            _ => {}
        }
    }
    let mut freed = 0;
    for (pid, segments) in by_gateway {
        let held = |name: &str| !matches!(probe(&Path::new(SHM_DIR).join(name)), Ok(Holder::Nobody | Holder::Nothing));
        if process_exists(pid) || segments.iter().any(|(name, kind)| *kind == SegmentKind::Arena && held(name)) {
            continue;
        }
        for (name, _) in segments {
            freed += remove(&name, &format!("left by gateway {pid}, which died together with its workers"));
        }
    }
    freed
}

/// Whether a process with this pid runs (owned by anyone): a zombie, dead but not yet reaped
/// by its parent, does not.
fn process_exists(pid: u32) -> bool {
    let Ok(id) = libc::pid_t::try_from(pid) else { return false };
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let exists = unsafe { libc::kill(id, 0) == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM) };
    // /proc/<pid>/stat: "pid (comm) S ...", the state after the last ')'.
    let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')));
    exists && !zombie
}

#[cfg(test)]
mod tests {
    use super::*;
    use duet_kv::shm::owner::{arena_name, lock_owner, ring_name};

    /// A pid no process has: a child's after it was reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().expect("spawning true");
        let pid = child.id();
        child.wait().expect("waiting for true");
        pid
    }

    fn leave(name: &str) -> Segment {
        let mut seg = Segment::create(name, 4096).unwrap();
        seg.persist();
        seg
    }

    fn exists(name: &str) -> bool {
        Path::new(SHM_DIR).join(name).exists()
    }

    #[test]
    fn a_zombie_is_not_a_running_process() {
        let mut child = std::process::Command::new("true").spawn().expect("spawning true");
        let pid = child.id();
        // Exited but not reaped: a zombie until `wait`.
        let start = std::time::Instant::now();
        while process_exists(pid) {
            assert!(start.elapsed() < std::time::Duration::from_secs(10), "`true` still runs after 10 s");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(Path::new(&format!("/proc/{pid}")).exists(), "a zombie keeps its /proc entry");
        child.wait().unwrap();
        // SAFETY: getppid has no preconditions.
        assert!(process_exists(unsafe { libc::getppid() } as u32));
    }

    #[test]
    fn default_instances_name_their_gateway() {
        assert_eq!(gateway_pid(&default_instance(4321)), Some(4321));
        for other in ["duet", "duet-", "duet-12a", "duet-+12", "t12-0", "duet-99999999999"] {
            assert_eq!(gateway_pid(other), None, "{other}");
        }
    }

    #[test]
    fn a_stopping_gateway_sweeps_its_own_unheld_segments_only() {
        let own = format!("own-sweep-{}", std::process::id());
        let (arena, ring) = (arena_name(&own, 0), ring_name(&own, 0));
        drop((leave(&arena), leave(&ring)));
        // Its other worker still holds its arena: left.
        let held = arena_name(&own, 1);
        let held_seg = leave(&held);
        let lock = lock_owner(held_seg.path()).unwrap().expect("not held yet");
        // Another instance's: left.
        let other = arena_name(&format!("other-sweep-{}", std::process::id()), 0);
        drop(leave(&other));
        assert!(sweep_own_instance(&own) >= 8192);
        assert!(!exists(&arena) && !exists(&ring));
        assert!(exists(&held) && exists(&other));
        drop(lock);
        for name in [held, other] {
            Segment::remove(&name).unwrap();
        }
    }

    #[test]
    fn only_dead_gateways_unheld_segments_are_swept() {
        // A dead gateway whose workers died too: both segments go.
        let dead = default_instance(dead_pid());
        let (arena, ring) = (arena_name(&dead, 0), ring_name(&dead, 0));
        drop((leave(&arena), leave(&ring)));
        // A dead gateway whose cpu-worker still runs (holds its arena): left alone.
        let held = default_instance(dead_pid());
        let (held_arena, held_ring) = (arena_name(&held, 1), ring_name(&held, 1));
        let held_seg = leave(&held_arena);
        let lock = lock_owner(held_seg.path()).unwrap().expect("not held yet");
        drop(leave(&held_ring));
        // A live gateway (our parent) whose worker is restarting: left alone.
        // SAFETY: getppid has no preconditions.
        let live = default_instance(unsafe { libc::getppid() } as u32);
        let live_arena = arena_name(&live, 0);
        drop(leave(&live_arena));

        // Only this test's instances: others' on this machine are not the test's to remove.
        assert_eq!(sweep(|i| [&dead, &held, &live].contains(&&i.to_string())), 2 * 4096);
        assert!(!exists(&arena) && !exists(&ring), "the dead instance's segments were removed");
        for name in [&held_arena, &held_ring, &live_arena] {
            assert!(exists(name), "{name} was removed");
        }
        drop((lock, held_seg));
        for name in [&held_arena, &held_ring, &live_arena] {
            Segment::remove(name).unwrap();
        }
    }
}
