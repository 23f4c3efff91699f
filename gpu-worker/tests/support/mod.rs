//! Shared by the executor tests: an executor with a KV arena and an exchange ring made here.

use std::time::Duration;

use duet_kv::{ArenaLayout, KvDtype};
use duet_kv::shm::{Ring, Segment};
use duet_gpu_worker::device::Device;
use duet_gpu_worker::worker::executor::Executor;

/// An executor on `device` with one attached arena of 64 blocks of 16 positions (segments
/// named after this process and `tag`, removed when the returned guards drop).
#[allow(dead_code)] // not every test binary that includes this module calls each function
pub fn executor_with_arena<D: Device>(device: D, tag: &str) -> (Executor<D>, (Segment, Ring)) {
    executor_with_arena_of(device, tag, KvDtype::F16)
}

/// [`executor_with_arena`] with an arena of `dtype`; its layout is [`arena_layout`]'s.
pub fn executor_with_arena_of<D: Device>(device: D, tag: &str, dtype: KvDtype) -> (Executor<D>, (Segment, Ring)) {
    let layout = arena_layout(device.config(), dtype);
    let (arena_name, ring_name) = (format!("duet-{tag}-test-{}-arena", std::process::id()), format!("duet-{tag}-test-{}-ring", std::process::id()));
    let arena = Segment::create(&arena_name, layout.total_bytes().unwrap()).unwrap();
    let header = layout.encode_header().unwrap();
    // SAFETY: the segment was just created here; nothing else maps it yet.
    unsafe { arena.slice_mut::<u8>(0, header.len()) }.copy_from_slice(&header);
    let ring = Ring::create(Segment::create(&ring_name, Ring::bytes_needed(4, 4096).unwrap()).unwrap(), 4, 4096).unwrap();
    let mut ex = Executor::new(device, Duration::from_secs(5)).unwrap();
    ex.attach(0, &arena_name, &ring_name, None).unwrap();
    (ex, (arena, ring))
}

/// The layout of the arenas made here: 64 blocks of 16 positions of `dtype`.
pub fn arena_layout(c: &duet_model::config::LlamaConfig, dtype: KvDtype) -> ArenaLayout {
    ArenaLayout { n_layer: c.n_layer as u32, n_kv_head: c.n_kv_head as u32, head_dim: c.head_dim as u32, block_size: 16, dtype, n_blocks: 64 }
}
