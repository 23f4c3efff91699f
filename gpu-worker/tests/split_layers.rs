//! A model split across two devices by layers (`--gpu-layers N`: layers `0..N` on the
//! device, the rest on the CPU device): with both parts CPU devices, every row computes what
//! it computes on one device, so the logits are bit for bit the same — on SmolLM2 (Q4_1) and
//! on a random Q4_K_M model whose matrices each part repacks, through a prefill in chunks and
//! one token at a time, split after the first layer, in the middle and before the last. A
//! part refuses the layers it does not hold, and `open` builds the split `--gpu-layers` asks
//! for.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use duet_gpu_worker::device::cpu::CpuDevice;
use duet_gpu_worker::device::split::SplitDevice;
use duet_gpu_worker::device::model::ModelTensors;
use duet_gpu_worker::device::{open, AnyDevice, Device, DeviceChoice, GpuLayers, NoRemoteExperts, Placement};
use duet_gpu_worker::runner::{KvCache, Logits, Runner};
use duet_model::gguf::GgufFile;
use duet_model::testutil::{model_path, workspace_root};

fn q4_k_m() -> PathBuf {
    workspace_root().join("testdata/tiny/random_q4_k_m.gguf")
}

fn n_layer(path: &Path) -> usize {
    Runner::load(path).unwrap().device.config().n_layer
}

fn split(path: &Path, n: usize) -> Runner<SplitDevice<CpuDevice, CpuDevice>> {
    let all = n_layer(path);
    Runner::load_with(path, |file| {
        let head = CpuDevice::load_layers(file.clone(), true, true, 0..n)?;
        SplitDevice::new(head, CpuDevice::load_layers(file, true, true, n..all)?)
    })
    .expect("the split model loads")
}

/// Logits of a prompt prefilled in uneven chunks, then of each token fed one at a time.
fn logits<D: Device>(engine: &Runner<D>, tokens: &[u32]) -> Vec<f32> {
    let c = engine.device.config();
    let mut kv = KvCache::new(c, 2 * tokens.len());
    let mut out = Vec::new();
    for range in [0..13, 13..14, 14..tokens.len()] {
        out.extend(engine.forward(&tokens[range], &mut kv, Logits::From(0)).unwrap());
    }
    for &t in tokens {
        out.extend(engine.forward(&[t], &mut kv, Logits::Last).unwrap());
    }
    out
}

#[test]
fn a_model_split_across_two_cpu_devices_computes_what_one_does() {
    for path in [model_path(), q4_k_m()] {
        let one = Runner::load(&path).unwrap();
        let n_vocab = one.device.config().n_vocab as u32;
        let tokens: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 11) % n_vocab).collect();
        let want = logits(&one, &tokens);
        let all = one.device.config().n_layer;
        let mut splits = vec![1, all / 2, all - 1];
        splits.dedup();
        for n in splits {
            let engine = split(&path, n);
            assert_eq!(engine.device.layers(), 0..all);
            let got = logits(&engine, &tokens);
            let differ = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(differ, 0, "{}: split at layer {n} of {all}: {differ} of {} logits differ", path.display(), want.len());
            println!("{}: split at layer {n} of {all}: {} logits identical", path.display(), want.len());
        }
    }
}

#[test]
fn a_part_refuses_the_layers_it_does_not_hold() {
    let path = model_path();
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let all = n_layer(&path);
    let head = CpuDevice::load_layers(file.clone(), true, true, 0..4).unwrap();
    let tail = CpuDevice::load_layers(file.clone(), true, true, 4..all).unwrap();
    assert_eq!((head.layers(), tail.layers()), (0..4, 4..all));
    let mut b = head.start_batch(&[1, 2], &[0, 1], &[1]).unwrap();
    let e = head.qkv(4, &mut b).expect_err("layer 4 is not the head's");
    assert!(e.to_string().contains("layer 4 is not on this device"), "{e}");
    let attn = vec![0f32; 2 * head.config().q_dim()];
    assert!(head.finish_layer(5, &mut b, &attn, &mut NoRemoteExperts).is_err());
    assert!(head.logits(&b).is_err(), "the head has no LM head");
    assert!(tail.start_batch(&[1, 2], &[0, 1], &[1]).is_err(), "the tail has no embedding");
    let hidden = head.hidden(&b).unwrap();
    let e = tail.resume_batch(hidden[1..].to_vec(), &[0, 1], &[1]).err().expect("a short hidden batch");
    assert!(e.to_string().contains("hidden values"), "{e}");
    assert!(tail.resume_batch(hidden, &[0, 1], &[2]).is_err(), "logits of a row past the batch");
    assert!(CpuDevice::load_layers(file.clone(), true, true, 3..3).is_err());
    assert!(CpuDevice::load_layers(file.clone(), true, true, 0..all + 1).is_err());

    // The parts must meet and cover the model.
    let gap = CpuDevice::load_layers(file.clone(), true, true, 5..all).unwrap();
    assert!(SplitDevice::new(head, gap).is_err());
    let split = SplitDevice::new(CpuDevice::load_layers(file.clone(), true, true, 0..4).unwrap(), tail).unwrap();
    let mut b = split.start_batch(&[1, 2], &[0, 1], &[1]).unwrap();
    assert!(split.logits(&b).is_err(), "logits before the tail's layers");
    split.qkv(4, &mut b).expect("handed to the tail at layer 4");
    assert!(split.qkv(3, &mut b).is_err(), "back to a layer the batch is past");
}

#[test]
fn open_splits_where_gpu_layers_says() {
    let path = model_path();
    let all = n_layer(&path);
    let file = || Arc::new(GgufFile::open(&path).unwrap());
    let cpu = |n: Option<usize>| open(Placement { choice: DeviceChoice::Cpu, gpu_layers: n.map(GpuLayers::Count) }, file(), true).unwrap();
    match cpu(Some(10)) {
        AnyDevice::Split(d) => {
            assert_eq!(d.boundary(), 10);
            assert!(d.describe().contains("for layers 0..10") && d.describe().contains(&format!("for layers 10..{all}")), "{}", d.describe());
        }
        d => panic!("--gpu-layers 10 gave {}", d.describe()),
    }
    // All layers, or none, on the device: one device.
    for n in [None, Some(0), Some(all), Some(all + 5)] {
        assert!(matches!(cpu(n), AnyDevice::Cpu(_)), "--gpu-layers {n:?}");
    }
    // `auto` without a GPU: the whole model on one CPU device.
    if duet_gpu_worker::device::cuda::probe(0).is_err() {
        for n in [GpuLayers::Count(10), GpuLayers::Fit] {
            let d = open(Placement { choice: DeviceChoice::Auto, gpu_layers: Some(n) }, file(), true).unwrap();
            assert!(matches!(d, AnyDevice::Cpu(_)), "{}", d.describe());
        }
    }
    assert_eq!("auto".parse(), Ok(GpuLayers::Fit));
    assert_eq!("12".parse(), Ok(GpuLayers::Count(12)));
    assert!("-1".parse::<GpuLayers>().unwrap_err().contains("a layer count or auto"));
}

/// `--gpu-layers auto` puts on the GPU the most first layers whose weights fit its budget.
#[test]
fn the_layers_that_fit_a_budget() {
    let path = model_path();
    let file = GgufFile::open(&path).unwrap();
    let m = ModelTensors::load(&file).unwrap();
    let all = m.config.n_layer;
    let whole = m.weight_bytes(&file, &(0..all));
    let (embd, first) = (m.weight_bytes(&file, &(0..0)), m.weight_bytes(&file, &(0..1)));
    assert!(embd > 0 && first > embd && whole > m.weight_bytes(&file, &(0..all - 1)), "the LM head counts with the last layer");
    let fixed = 1000;
    assert_eq!(m.first_layers_within(&file, whole + fixed, fixed, |_| 0), all);
    assert_eq!(m.first_layers_within(&file, whole + fixed - 1, fixed, |_| 0), all - 1);
    assert_eq!(m.first_layers_within(&file, first + fixed, fixed, |_| 0), 1);
    assert_eq!(m.first_layers_within(&file, first + fixed - 1, fixed, |_| 0), 0);
    let half = m.weight_bytes(&file, &(0..all / 2));
    assert_eq!(m.first_layers_within(&file, half + fixed, fixed, |_| 0), all / 2);
    // The parts' bytes add up to the whole model's (a tied embedding on both: the head looks
    // rows up in it, the tail's LM head reads it whole).
    let tied = m.output.name == m.token_embd.name;
    assert_eq!(half + m.weight_bytes(&file, &(all / 2..all)), whole + if tied { embd } else { 0 });
}

/// `--gpu-layers auto` with `--device-experts K` keeps room for K experts in each layer on the
/// GPU: K times each layer's expert (its slice of the stacked gate, up and down tensors).
#[test]
fn the_hot_experts_room_grows_with_the_layers() {
    let path = workspace_root().join("testdata/tiny/arch/mixtral_q8_0.gguf");
    let file = GgufFile::open(&path).unwrap();
    let m = ModelTensors::load(&file).unwrap();
    let experts = m.experts.as_ref().expect("mixtral has routed experts");
    let one_expert = |l: usize| -> usize {
        ["gate", "up", "down"].iter().map(|p| file.tensor(&format!("blk.{l}.ffn_{p}_exps.weight")).unwrap().data.len() / experts.n_expert).sum()
    };
    assert!(duet_gpu_worker::device::cuda::set_expert_slots(2));
    let room = |local, n| duet_gpu_worker::device::cuda::expert_room(Some(experts), local, n);
    let all = m.config.n_layer;
    assert_eq!(room(false, 0), 0);
    assert_eq!(room(false, 1), 2 * one_expert(0));
    assert_eq!(room(false, all), 2 * (0..all).map(one_expert).sum::<usize>());
    assert_eq!(room(false, all + 3), room(false, all), "no room for layers the model has not");
    assert_eq!(room(true, all), 0, "experts the host holds keep no room on the GPU");
    assert_eq!(duet_gpu_worker::device::cuda::expert_room(None, false, all), 0);
    // The budget that fits every layer with their room fits one layer fewer without it.
    let (fixed, whole) = (1000, m.weight_bytes(&file, &(0..all)));
    assert_eq!(m.first_layers_within(&file, whole + fixed + room(false, all), fixed, |n| room(false, n)), all);
    assert!(m.first_layers_within(&file, whole + fixed, fixed, |n| room(false, n)) < all);
}
