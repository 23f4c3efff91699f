//! Expert jobs end to end in one process, with rings small enough to strain them: the
//! gpu-worker's executor with its experts remote, a cpu-worker's job loop serving them from a
//! thread over an exchange ring of 4 slots of 2 KiB (a layer's prefill items cut into dozens of
//! jobs, each slot reused many times per layer), against an executor holding the experts
//! itself: the same sampled tokens and log-probabilities, bit for bit; and with hot experts
//! moving onto the device as the plan changes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use duet_cpu_worker::experts::{answer, ExpertShare, ServedExperts};
use duet_gpu_worker::device::cpu::CpuDevice;
use duet_gpu_worker::device::Device;
use duet_gpu_worker::worker::executor::Executor;
use duet_kv::shm::{Ring, Segment};
use duet_kv::{ArenaLayout, KvDtype};
use duet_model::gguf::GgufFile;
use duet_model::testutil::workspace_root;
use duet_proto::pb;

const SLOTS: u32 = 4;
const SLOT_BYTES: usize = 2048;

/// An executor over `device` with one arena and a ring of [`SLOTS`] × [`SLOT_BYTES`], and the
/// ring's consumer side (segments named after this process and `tag`).
fn executor(device: CpuDevice, tag: &str) -> (Executor, Segment, duet_kv::shm::Consumer) {
    let c = device.config();
    let layout = ArenaLayout { n_layer: c.n_layer as u32, n_kv_head: c.n_kv_head as u32, head_dim: c.head_dim as u32, block_size: 16, dtype: KvDtype::F16, n_blocks: 16 };
    let (arena_name, ring_name) = (format!("duet-xj-{tag}-{}-arena", std::process::id()), format!("duet-xj-{tag}-{}-ring", std::process::id()));
    let arena = Segment::create(&arena_name, layout.total_bytes().unwrap()).unwrap();
    let header = layout.encode_header().unwrap();
    // SAFETY: the segment was just created here; nothing else maps it yet.
    unsafe { arena.slice_mut::<u8>(0, header.len()) }.copy_from_slice(&header);
    let ring = Ring::create(Segment::create(&ring_name, Ring::bytes_needed(SLOTS, SLOT_BYTES).unwrap()).unwrap(), SLOTS, SLOT_BYTES).unwrap();
    let mut ex = Executor::new(device, Duration::from_secs(10)).unwrap();
    ex.attach(0, &arena_name, &ring_name, None).unwrap();
    (ex, arena, ring.consumer())
}

fn part(seq_id: u64, start: u32, tokens: &[u32], new_blocks: &[u32]) -> pb::SequenceStep {
    let greedy = pb::SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0, seed: 0, top_logprobs: 1, constraint: None, ..Default::default() };
    pb::SequenceStep {
        seq_id,
        start_pos: start,
        tokens: tokens.to_vec(),
        new_blocks: new_blocks.iter().map(|&block| pb::KvBlockRef { worker: 0, block }).collect(),
        sampler: (start == 0).then_some(greedy),
        sample: true,
        attention: Vec::new(),
        sub_batch: 0,
        feed_sampled: tokens.is_empty(),
        held_tokens: Vec::new(),
        ..Default::default()
    }
}

/// Every sampled (token, log-probability bits) of a run, and each step's routed-token counts.
type Run = (Vec<(u32, u32)>, Vec<Vec<pb::ExpertRouted>>);

/// A 24-token prompt, then 8 decode steps.
fn run(ex: &mut Executor) -> Run {
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 256).collect();
    let (mut out, mut routed) = (Vec::new(), Vec::new());
    for s in 0..9u64 {
        let seq = if s == 0 { part(1, 0, &prompt, &[0, 1]) } else { part(1, prompt.len() as u32 + s as u32 - 1, &[], &[]) };
        let resp = ex.step(&pb::StepRequest { step: s + 1, sequences: vec![seq], released: Vec::new(), after_step: s }).unwrap();
        let t = resp.sampled[0].token.as_ref().unwrap();
        out.push((t.id, t.logprob.to_bits()));
        routed.push(resp.timings.unwrap().expert_routed);
    }
    (out, routed)
}

/// `run` on `remote` while a thread answers its expert jobs from `consumer` with `served`:
/// what `run` returns, and how many jobs were answered.
fn run_served(remote: &mut Executor, consumer: &mut duet_kv::shm::Consumer, served: &ServedExperts) -> (Run, u64) {
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let mut jobs = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let Ok((seq, slot)) = consumer.next_job_timeout(Duration::from_millis(20)) else { continue };
                answer(slot, Some(served)).unwrap();
                consumer.complete(seq);
                jobs += 1;
            }
            jobs
        });
        // Stops the job loop however this thread leaves (a failed step panics).
        struct Stop<'a>(&'a AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let stopping = Stop(&stop);
        let got = run(remote);
        drop(stopping);
        (got, worker.join().unwrap())
    })
}

fn olmoe() -> std::path::PathBuf {
    workspace_root().join("testdata/tiny/arch/olmoe_q8_0.gguf")
}

fn load(local_experts: bool) -> CpuDevice {
    CpuDevice::load(Arc::new(GgufFile::open(olmoe()).unwrap()), local_experts).unwrap()
}

#[test]
fn experts_served_through_a_tight_ring_give_the_local_experts_bits() {
    let (mut local, _arena_l, _consumer_l) = executor(load(true), "local");
    let (want, want_routed) = run(&mut local);
    // Every step reports each row's choices in every layer: its tokens × experts used × layers.
    let c = local.device().config().clone();
    let used = c.experts.unwrap().n_used as u32;
    for (s, routed) in want_routed.iter().enumerate() {
        let rows = if s == 0 { 24 } else { 1 };
        assert_eq!(routed.iter().map(|r| r.tokens).sum::<u32>(), rows * used * c.n_layer as u32, "step {s}'s routed tokens");
        assert!(routed.iter().all(|r| r.tokens > 0 && (r.layer as usize) < c.n_layer), "step {s}: only non-zero counts of real layers");
    }

    let (mut remote, _arena_r, mut consumer) = executor(load(false), "remote");
    assert!(!remote_holds_all(&remote));
    let served = ServedExperts::load(&olmoe(), ExpertShare { index: 0, of: 1 }).unwrap();
    let ((got, got_routed), jobs) = run_served(&mut remote, &mut consumer, &served);
    assert_eq!(got, want, "tokens and log-probabilities with the experts remote");
    assert_eq!(got_routed, want_routed, "the router's counts do not depend on where the experts run");
    // 2 layers × (a prefill cut into many jobs + 8 decode steps): far more jobs than slots.
    assert!(jobs > 4 * SLOTS as u64, "only {jobs} expert jobs");
}

/// Hot experts (`--device-experts`): with the experts on the cpu-worker and the device
/// re-planning every two steps which 2 experts of each layer it computes itself, the plan
/// changes mid-run and the tokens and log-probabilities stay those of the local experts,
/// bit for bit; the cpu-worker still serves the rest.
#[test]
fn hot_experts_placed_on_the_device_mid_run_keep_the_bits() {
    let (mut local, _arena_l, _consumer_l) = executor(load(true), "hot-local");
    let (want, _) = run(&mut local);
    let (remote, _arena_r, mut consumer) = executor(load(false), "hot-remote");
    let mut remote = remote.with_hot_experts(2, 2).unwrap();
    let served = ServedExperts::load(&olmoe(), ExpertShare { index: 0, of: 1 }).unwrap();
    let ((got, _), jobs) = run_served(&mut remote, &mut consumer, &served);
    assert_eq!(got, want, "tokens and log-probabilities with hot experts on the device");
    let c = remote.device().config().clone();
    assert_eq!(remote.device().held_experts(), 2 * c.n_layer, "2 experts of each layer held on the device");
    assert!(!remote_holds_all(&remote) && jobs > 0, "the cpu-worker still serves the others ({jobs} jobs)");
    // A device holding all of its experts has nothing to place.
    let (local, _a, _c) = executor(load(true), "hot-all");
    assert!(local.with_hot_experts(2, 2).is_err(), "--device-experts without the experts on the cpu-workers");
}

fn remote_holds_all(ex: &Executor) -> bool {
    ex.device().holds_all_experts()
}
