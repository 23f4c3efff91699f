//! The CUDA device's KV mirror under pressure computes what it computes with room: a
//! sequence's logits are bit for bit the same when another sequence, interleaved with it,
//! keeps evicting it from a mirror that holds only one of them at a time (its prefix then
//! comes back from the host's cache before each step's new rows are stored from the GPU —
//! the whole-layer path keeps those rows on the GPU until the step's end, so nothing may
//! upload them from the host before they are there). The mirror is 7 pages of 16 positions
//! (`--gpu-kv-bytes`, a process-wide setting: hence a test binary of its own); each sequence
//! needs 5. On the random-weight Llama-3.2-1B-shaped model of `DUET_CUDA_TEST_MODEL`;
//! skipped without it or a GPU (`DUET_REQUIRE_CUDA=1` makes either a failure).

use duet_gpu_worker::device::{Device, DeviceChoice};
use duet_gpu_worker::runner::{KvCache, Logits, Runner};
use duet_model::config::LlamaConfig;
use duet_model::gguf::GgufFile;

fn skip(why: &str) {
    if std::env::var("DUET_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
        panic!("DUET_REQUIRE_CUDA=1: {why}");
    }
    eprintln!("skipped: {why}");
}

const PROMPT: usize = 64;
const STEPS: usize = 4;

/// A prompt of [`PROMPT`] ids spread over the vocabulary, varied by `salt`.
fn prompt(n_vocab: usize, salt: u64) -> Vec<u32> {
    (0..PROMPT as u64).map(|i| ((i * 2_654_435_761 + 12_345 + salt * 7_919) % n_vocab as u64) as u32).collect()
}

#[test]
fn a_sequence_evicted_between_its_steps_gets_the_logits_it_gets_with_room() {
    let Some(path) = std::env::var_os("DUET_CUDA_TEST_MODEL") else {
        skip("DUET_CUDA_TEST_MODEL names no model (scripts/gpu-check.sh makes one on the GPU machine)");
        return;
    };
    // The mirror's page: 16 positions of every layer's K and V (f16).
    let c = LlamaConfig::from_gguf(&GgufFile::open(std::path::Path::new(&path)).unwrap()).unwrap();
    let page = c.n_layer * 2 * c.n_kv_head * c.head_dim * 16 * 2;
    duet_gpu_worker::device::cuda::set_kv_budget(7 * page);
    let cuda = match Runner::load_on(std::path::Path::new(&path), DeviceChoice::Cuda) {
        Ok(r) => r,
        Err(e) => return skip(&format!("the CUDA device: {e}")),
    };
    assert_eq!(cuda.device.gpu_kv_positions(), 7 * 16, "the mirror's size");
    let (a, b) = (prompt(c.n_vocab, 1), prompt(c.n_vocab, 2));
    let steps: Vec<u32> = a[..STEPS].to_vec();
    let cap = PROMPT + STEPS + 1;
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();

    // With room: sequence A alone.
    let mut alone = Vec::new();
    let mut kv = KvCache::new(&c, cap);
    alone.push(bits(cuda.forward(&a, &mut kv, Logits::Last).unwrap()));
    for &t in &steps {
        alone.push(bits(cuda.forward(&[t], &mut kv, Logits::Last).unwrap()));
    }
    // Under pressure: the same tokens as a new sequence, B's steps between each of its own.
    let mut pressed = Vec::new();
    let (mut ka, mut kb) = (KvCache::new(&c, cap), KvCache::new(&c, cap));
    pressed.push(bits(cuda.forward(&a, &mut ka, Logits::Last).unwrap()));
    cuda.forward(&b, &mut kb, Logits::Last).unwrap();
    for &t in &steps {
        pressed.push(bits(cuda.forward(&[t], &mut ka, Logits::Last).unwrap()));
        cuda.forward(&[t], &mut kb, Logits::Last).unwrap();
    }
    for (i, (p, w)) in pressed.iter().zip(&alone).enumerate() {
        let differ = p.iter().zip(w).filter(|(x, y)| x != y).count();
        assert_eq!(differ, 0, "forward pass {i}: {differ} of {} logits differ under pressure", w.len());
    }
    println!("{} forward passes of a sequence evicted between them: the logits of the sequence alone, bit for bit", pressed.len());
}
