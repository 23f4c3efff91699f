//! Fuzz target: arbitrary bytes as an exchange-ring slot that another process wrote, decoded by
//! the cpu-worker's `decode_job` against a small arena layout chosen by the first bytes; a job
//! that decodes must encode back into the same bytes' meaning (re-encoded and decoded again, it
//! is the same job), and the result reader must refuse or read any slot. Any panic is a bug.

#![no_main]

use duet_kv::layout::{ArenaLayout, KvDtype};
use duet_kv::shm::job::{decode_job, encode_job, read_results};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&[layers, heads, dim, blocks], slot)) = data.split_first_chunk::<4>() else { return };
    let layout = ArenaLayout {
        n_layer: u32::from(layers % 4) + 1,
        n_kv_head: u32::from(heads % 4) + 1,
        head_dim: u32::from(dim % 8) * 8 + 8,
        block_size: 16,
        dtype: KvDtype::F16,
        n_blocks: u32::from(blocks) + 1,
    };
    let _ = read_results(slot);
    let Ok(job) = decode_job(slot, &layout) else { return };
    let mut again = vec![0u8; slot.len()];
    encode_job(&job, &mut again).expect("a decoded job fits the slot it came from");
    let back = decode_job(&again, &layout).expect("a re-encoded job decodes");
    assert_eq!(format!("{back:?}"), format!("{job:?}"));
});
