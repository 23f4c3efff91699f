//! The CPU device with its Q4_K and Q6_K matrices repacked into interleaved rows computes, bit
//! for bit, what it computes on the file's own layout: a random Q4_K_M model in a tiny shape
//! (`testdata/tiny/random_q4_k_m.gguf`, `scripts/gen_random_model.py --shape tiny`: every
//! matrix whole groups of sixteen rows, a Q6_K LM head and one layer's Q6_K V and down
//! projections), through a whole prefill (batches of 40 rows: four activation rows per pass
//! and a rest), uneven chunks (batches of 13, 1 and 26 rows) and one token at a time (batch 1).

use std::path::PathBuf;

use duet_model::testutil::workspace_root;
use duet_gpu_worker::device::cpu::CpuDevice;
use duet_gpu_worker::device::Device;
use duet_gpu_worker::runner::{Runner, KvCache, Logits};

fn model() -> PathBuf {
    workspace_root().join("testdata/tiny/random_q4_k_m.gguf")
}

fn engine(repack: bool) -> Runner<CpuDevice> {
    Runner::load_with(&model(), |file| CpuDevice::load_with(file, repack, true)).expect("the tiny Q4_K_M model loads")
}

/// Logits of the whole prompt as one prefill, in chunks, and token by token.
fn runs(engine: &Runner<CpuDevice>, tokens: &[u32]) -> [Vec<f32>; 3] {
    let c = engine.device.config();
    let mut kv = KvCache::new(c, tokens.len());
    let batched = engine.forward(tokens, &mut kv, Logits::From(0)).unwrap();
    let mut kv = KvCache::new(c, tokens.len());
    let mut chunked = Vec::new();
    for range in [0..13, 13..14, 14..tokens.len()] {
        chunked.extend(engine.forward(&tokens[range], &mut kv, Logits::From(0)).unwrap());
    }
    let mut kv = KvCache::new(c, tokens.len());
    let mut decode = Vec::new();
    for &t in tokens {
        decode.extend(engine.forward(&[t], &mut kv, Logits::Last).unwrap());
    }
    [batched, chunked, decode]
}

#[test]
fn repacked_weights_give_the_same_logits_bit_for_bit() {
    let packed = engine(true);
    let plain = engine(false);
    assert_eq!(plain.device.repacked_matrices(), 0);
    if !duet_kernels::interleaved::available() {
        assert_eq!(packed.device.repacked_matrices(), 0, "no kernels, no repacking");
        return eprintln!("skipped: the interleaved kernels need AVX2 or AVX-512; nothing was repacked");
    }
    // 3 layers × 7 matrices + the LM head; the untied embedding is only looked up.
    assert_eq!(packed.device.repacked_matrices(), 22);
    let n_vocab = packed.device.config().n_vocab;
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % n_vocab as u32).collect();
    let (want, got) = (runs(&plain, &tokens), runs(&packed, &tokens));
    for (how, (w, g)) in ["batched", "chunked", "decode"].iter().zip(want.iter().zip(&got)) {
        assert_eq!(w.len(), tokens.len() * n_vocab, "{how}");
        assert!(w.iter().all(|v| v.is_finite()), "{how}: the model's logits are not finite");
        let first = w.iter().zip(g).position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(first.is_none(), "{how}: logit {} differs: {} (rows) vs {} (interleaved)", first.unwrap(), w[first.unwrap()], g[first.unwrap()]);
    }
}
