//! A cpu-worker killed with SIGKILL leaves its KV arena behind; restarted with `--reattach`
//! and the same model it keeps that arena, K/V and all, counting one more generation in the
//! header, and rebuilds only the exchange ring; with another model (or another layout) it
//! rebuilds the arena, K/V gone, and says why.

mod support;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use duet_kv::layout::{HEADER_BYTES, OFF_GENERATION, OFF_MODEL_ID};
use duet_model::testutil::workspace_root;
use support::{attach, Worker, WAIT};

fn model(name: &str) -> String {
    workspace_root().join("testdata/tiny/arch").join(name).display().to_string()
}

/// Starts worker 0 of `instance` with `kv_blocks` and `flags` and waits for its ready line
/// (a dead predecessor's ring may still be there before: attaching sooner could find that);
/// returns the worker and its log up to then.
fn start_logged(instance: &str, kv_blocks: u32, flags: &[&str]) -> (Worker, String) {
    let mut cmd = Worker::command(instance, 0, kv_blocks, flags);
    cmd.stderr(Stdio::piped());
    let mut w = Worker::spawn(cmd, instance, 0);
    let mut log = String::new();
    let mut lines = BufReader::new(w.child.stderr.take().unwrap()).lines();
    while !log.contains("cpu-worker ready") {
        match lines.next() {
            Some(Ok(line)) => log.push_str(&(line + "\n")),
            _ => panic!("the worker exited before it was ready; its log:\n{log}"),
        }
    }
    std::thread::spawn(move || lines.for_each(drop));
    (w, log)
}

/// Starts worker 0 of `instance` with `flags`, attaches, and returns it with the arena's
/// generation, its model identity, the first 4 KiB of block 0 and its log.
fn start(instance: &str, flags: &[&str]) -> (Worker, u64, u64, Vec<u8>, String) {
    let (mut w, log) = start_logged(instance, 8, flags);
    let (arena, _, _producer) = attach(&mut w);
    let generation = arena.atomic_u64(OFF_GENERATION).load(std::sync::atomic::Ordering::Acquire);
    let model_id = arena.atomic_u64(OFF_MODEL_ID).load(std::sync::atomic::Ordering::Acquire);
    // SAFETY: no job is posted: nobody else touches block 0.
    let block = unsafe { arena.slice::<u8>(HEADER_BYTES, 4096) }.to_vec();
    (w, generation, model_id, block, log)
}

fn kill(w: &mut Worker) {
    w.signal(libc::SIGKILL);
    w.wait_exit(WAIT);
}

#[test]
fn a_restarted_worker_keeps_its_arena_only_for_the_same_model_and_layout() {
    let instance = format!("reattach{}", std::process::id());
    let (a, b) = (model("qwen3_q8_0.gguf"), model("phi3_q8_0.gguf"));
    let (mut w, generation, id_a, block, _) = start(&instance, &["--model", &a, "--replace"]);
    assert_eq!(generation, 1, "a created arena is generation 1");
    assert_ne!(id_a, 0, "the model's identity is in the header");
    assert!(block.iter().all(|&b| b == 0));
    // K/V written as the gpu-worker writes it, straight into the arena.
    let arena = duet_kv::shm::Segment::open(&duet_cpu_worker::arena_name(&instance, 0)).unwrap();
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    // SAFETY: no job is posted while the test writes block 0.
    unsafe { arena.slice_mut::<u8>(HEADER_BYTES, 4096) }.copy_from_slice(&pattern);
    drop(arena);
    kill(&mut w);
    std::mem::forget(w); // its segments stay: the next worker of this name is the test

    // Same model and layout: the arena and its K/V are kept.
    let (mut w, generation, id, block, log) = start(&instance, &["--model", &a, "--reattach"]);
    assert_eq!((generation, id), (2, id_a), "re-attached: one more generation, same model; log:\n{log}");
    assert!(log.contains("re-attached to the KV arena"), "{log}");
    assert_eq!(block, pattern, "the K/V a crashed worker held is still there");
    kill(&mut w);
    std::mem::forget(w);

    // Another model: rebuilt, K/V gone.
    let (mut w, generation, id, block, log) = start(&instance, &["--model", &b, "--reattach"]);
    assert_eq!(generation, 1, "another model's arena is rebuilt");
    assert!(log.contains("not re-attaching") && log.contains("holds the K/V of model"), "the reason is logged:\n{log}");
    assert_ne!(id, id_a);
    assert!(block.iter().all(|&b| b == 0), "a rebuilt arena starts empty");
    kill(&mut w);
    std::mem::forget(w);

    // Another layout (more blocks), same model: rebuilt too.
    let (mut w, log) = start_logged(&instance, 16, &["--model", &b, "--reattach"]);
    assert!(log.contains("not re-attaching") && log.contains("this worker's layout"), "the reason is logged:\n{log}");
    let (arena, layout, _producer) = attach(&mut w);
    assert_eq!(layout.n_blocks, 16);
    assert_eq!(arena.atomic_u64(OFF_GENERATION).load(std::sync::atomic::Ordering::Acquire), 1);
    drop(arena);
    // A clean stop removes the arena: nothing is left to re-attach to.
    w.signal(libc::SIGTERM);
    assert!(w.wait_exit(Duration::from_secs(20)).success());
    assert!(w.segment_paths().iter().all(|p| !p.exists()), "segments left after a clean stop");
}
