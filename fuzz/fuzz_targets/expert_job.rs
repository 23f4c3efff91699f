//! Fuzz target: arbitrary bytes as an exchange-ring slot holding an expert job, decoded by the
//! cpu-worker's `decode_expert_job` against small model limits chosen by the first bytes; a job
//! that decodes must re-encode into a job that decodes the same, and the result reader must
//! refuse or read any slot. Any panic is a bug.

#![no_main]

use duet_kv::shm::expert_job::{decode_expert_job, encode_expert_job, read_expert_results, ExpertLimits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&[layers, embd, experts], slot)) = data.split_first_chunk::<3>() else { return };
    let limits = ExpertLimits { n_layer: u32::from(layers % 4) + 1, n_embd: u32::from(embd % 8) + 1, n_expert: u32::from(experts % 16) + 1 };
    let _ = read_expert_results(slot);
    let Ok(job) = decode_expert_job(slot, &limits) else { return };
    let mut again = vec![0u8; slot.len()];
    encode_expert_job(&job, &mut again).expect("a decoded job fits the slot it came from");
    let back = decode_expert_job(&again, &limits).expect("a re-encoded job decodes");
    assert_eq!(format!("{back:?}"), format!("{job:?}"));
});
