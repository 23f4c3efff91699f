//! The runner and the executor reach the device only through the `Device` trait: a test
//! device wrapping the CPU device counts every call, and what the runner and the executor
//! compute through it — plain and overlapped steps, prefill and decode — is bit for bit what
//! the runner computes on the CPU device itself; greedy steps (the executor's, and the
//! runner's plain greedy generations) take the tokens a device finds itself (the CUDA
//! device's arg-max) without asking for logits.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use duet_model::config::LlamaConfig;
use duet_model::gguf::GgufFile;
use duet_proto::pb;
use duet_model::testutil::model_path;
use duet_gpu_worker::device::cpu::CpuDevice;
use duet_gpu_worker::device::{DecodeItem, Device, KvSink, KvSource, KvStore, KvUploadTime, Partial, PrefillItem, Qkv, RemoteExperts};
use duet_gpu_worker::error::Result;
use duet_gpu_worker::runner::{Runner, GenerateRequest};
use duet_gpu_worker::sampler::{argmax, SamplingParams};

mod support;

/// Calls of each device operation (attention counted per call and per item).
#[derive(Debug, Default)]
struct Calls {
    start_batch: AtomicUsize,
    qkv: AtomicUsize,
    store_kv: AtomicUsize,
    prefill_attention: AtomicUsize,
    prefill_items: AtomicUsize,
    decode_attention: AtomicUsize,
    decode_items: AtomicUsize,
    finish_layer: AtomicUsize,
    logits: AtomicUsize,
    /// Batches whose greedy tokens the device gave (not in the snapshot).
    greedy_tokens: AtomicUsize,
    /// Layers done wholly on the device (not in the snapshot).
    layers_on_device: AtomicUsize,
    /// Of those, the layers whose attention time `take_attention_ns` has not yet given.
    untimed_layers: AtomicUsize,
    /// The KV upload time the device reports, as the CUDA device's mirror would for rows it
    /// lacked: per layer done wholly on it, and per attention call the executor makes (ns).
    upload_per_whole_layer: AtomicUsize,
    upload_per_attention_call: AtomicUsize,
    /// What `take_kv_upload_time` has not yet given: in whole layers, in attention calls.
    uploaded_in_whole_layers: AtomicUsize,
    uploaded_in_attention_calls: AtomicUsize,
    /// A whole layer is running (its attention calls are not the executor's).
    in_whole_layer: std::sync::atomic::AtomicBool,
}

/// The attention time the test device reports per layer done wholly on it, as the CUDA
/// device's events would.
const ATTENTION_NS_PER_LAYER: u64 = 1_000;

impl Calls {
    fn snapshot(&self) -> [usize; 9] {
        [
            &self.start_batch,
            &self.qkv,
            &self.store_kv,
            &self.prefill_attention,
            &self.prefill_items,
            &self.decode_attention,
            &self.decode_items,
            &self.finish_layer,
            &self.logits,
        ]
        .map(|c| c.load(Ordering::Relaxed))
    }
}

fn bump(c: &AtomicUsize, by: usize) {
    c.fetch_add(by, Ordering::Relaxed);
}

/// The CPU device, counting its calls; with `greedy_on_device` it gives greedy tokens itself
/// (the arg-max of its logits), as the CUDA device does.
struct Counting {
    inner: CpuDevice,
    calls: Arc<Calls>,
    greedy_on_device: bool,
    /// Takes this many first layers whole ([`Device::layer_on_device`]; `usize::MAX`: all),
    /// as the CUDA device does (with `--gpu-layers`, the GPU's), by making the same calls
    /// itself.
    whole_layers: usize,
}

impl Device for Counting {
    type Batch = <CpuDevice as Device>::Batch;

    fn kind(&self) -> pb::DeviceKind {
        self.inner.kind()
    }
    fn describe(&self) -> String {
        format!("counting {}", self.inner.describe())
    }
    fn config(&self) -> &LlamaConfig {
        self.inner.config()
    }
    fn prefill_chunk(&self) -> usize {
        self.inner.prefill_chunk()
    }
    fn start_batch(&self, tokens: &[u32], positions: &[usize], logit_rows: &[usize]) -> Result<Self::Batch> {
        bump(&self.calls.start_batch, 1);
        self.calls.uploaded_in_whole_layers.store(0, Ordering::Relaxed);
        self.calls.uploaded_in_attention_calls.store(0, Ordering::Relaxed);
        self.inner.start_batch(tokens, positions, logit_rows)
    }
    fn hidden(&self, batch: &Self::Batch) -> Result<Vec<f32>> {
        self.inner.hidden(batch)
    }
    fn resume_batch(&self, hidden: Vec<f32>, positions: &[usize], logit_rows: &[usize]) -> Result<Self::Batch> {
        self.inner.resume_batch(hidden, positions, logit_rows)
    }
    fn qkv(&self, layer: usize, batch: &mut Self::Batch) -> Result<Qkv> {
        bump(&self.calls.qkv, 1);
        self.inner.qkv(layer, batch)
    }
    fn store_kv(&self, layer: usize, qkv: &Qkv, kv: &mut dyn KvSink) -> Result<()> {
        bump(&self.calls.store_kv, 1);
        self.inner.store_kv(layer, qkv, kv)
    }
    fn prefill_attention(&self, layer: usize, qkv: &Qkv, items: &[PrefillItem], kv: &dyn KvSource, out: &mut [f32]) -> Result<()> {
        bump(&self.calls.prefill_attention, 1);
        bump(&self.calls.prefill_items, items.len());
        self.inner.prefill_attention(layer, qkv, items, kv, out)
    }
    fn decode_attention(&self, layer: usize, qkv: &Qkv, items: &[DecodeItem], kv: &dyn KvSource) -> Result<Vec<Partial>> {
        bump(&self.calls.decode_attention, 1);
        bump(&self.calls.decode_items, items.len());
        if !self.calls.in_whole_layer.load(Ordering::Relaxed) {
            bump(&self.calls.uploaded_in_attention_calls, self.calls.upload_per_attention_call.load(Ordering::Relaxed));
        }
        self.inner.decode_attention(layer, qkv, items, kv)
    }
    fn finish_layer(&self, layer: usize, batch: &mut Self::Batch, attn: &[f32], remote: &mut dyn RemoteExperts) -> Result<()> {
        bump(&self.calls.finish_layer, 1);
        self.inner.finish_layer(layer, batch, attn, remote)
    }
    fn logits(&self, batch: &Self::Batch) -> Result<Vec<f32>> {
        bump(&self.calls.logits, 1);
        self.inner.logits(batch)
    }
    fn layer_on_device(&self, layer: usize, batch: &mut Self::Batch, items: &[PrefillItem], kv: &mut dyn KvStore, remote: &mut dyn RemoteExperts) -> Result<bool> {
        if layer >= self.whole_layers {
            return Ok(false);
        }
        bump(&self.calls.layers_on_device, 1);
        bump(&self.calls.untimed_layers, 1);
        bump(&self.calls.uploaded_in_whole_layers, self.calls.upload_per_whole_layer.load(Ordering::Relaxed));
        self.calls.in_whole_layer.store(true, Ordering::Relaxed);
        let done = self.whole_layer(layer, batch, items, kv, remote);
        self.calls.in_whole_layer.store(false, Ordering::Relaxed);
        done
    }
    fn take_attention_ns(&self) -> Result<Option<u64>> {
        let layers = self.calls.untimed_layers.swap(0, Ordering::Relaxed) as u64;
        Ok((layers > 0).then_some(layers * ATTENTION_NS_PER_LAYER))
    }
    fn take_kv_upload_time(&self) -> Result<KvUploadTime> {
        let in_calls = self.calls.uploaded_in_attention_calls.swap(0, Ordering::Relaxed) as u64;
        let whole = self.calls.uploaded_in_whole_layers.swap(0, Ordering::Relaxed) as u64;
        Ok(KvUploadTime { total_ns: whole + in_calls, in_attention_calls_ns: in_calls })
    }
    fn greedy_tokens(&self, batch: &Self::Batch) -> Result<Option<Vec<u32>>> {
        if !self.greedy_on_device {
            return Ok(None);
        }
        bump(&self.calls.greedy_tokens, 1);
        let n_vocab = self.inner.config().n_vocab;
        Ok(Some(self.inner.logits(batch)?.chunks_exact(n_vocab).map(argmax).collect()))
    }
}

impl Counting {
    /// A layer wholly on the device: the layer calls in turn.
    fn whole_layer(&self, layer: usize, batch: &mut <CpuDevice as Device>::Batch, items: &[PrefillItem], kv: &mut dyn KvStore, remote: &mut dyn RemoteExperts) -> Result<bool> {
        let qkv = self.qkv(layer, batch)?;
        self.store_kv(layer, &qkv, &mut *kv)?;
        let mut out = vec![0f32; qkv.q.len()];
        let q_dim = out.len() / items.iter().map(|it| it.n).sum::<usize>();
        let (decode, prefill): (Vec<&PrefillItem>, Vec<&PrefillItem>) = items.iter().partition(|it| it.n == 1);
        if !prefill.is_empty() {
            let prefill: Vec<PrefillItem> = prefill.into_iter().cloned().collect();
            self.prefill_attention(layer, &qkv, &prefill, &*kv, &mut out)?;
        }
        if !decode.is_empty() {
            let decode: Vec<DecodeItem> = decode.iter().map(|it| DecodeItem { seq: it.seq, row: it.row0, range: 0..it.start + 1, n_ctx: it.start + 1 }).collect();
            for (it, (o, _)) in decode.iter().zip(self.decode_attention(layer, &qkv, &decode, &*kv)?) {
                out[it.row * q_dim..(it.row + 1) * q_dim].copy_from_slice(&o);
            }
        }
        self.finish_layer(layer, batch, &out, remote)?;
        Ok(true)
    }
}

fn counting(calls: &Arc<Calls>) -> impl FnOnce(Arc<GgufFile>) -> Result<Counting> + '_ {
    move |file| Ok(Counting { inner: CpuDevice::load(file, true)?, calls: calls.clone(), greedy_on_device: false, whole_layers: 0 })
}

const PROMPT: [u32; 5] = [504, 3575, 282, 4649, 314];
const GENERATED: usize = 5;

/// The runner's greedy generation on the plain CPU device: ids and their log-probabilities.
fn reference() -> Vec<(u32, f64)> {
    let engine = Runner::load(&model_path()).unwrap();
    generate(&engine)
}

fn generate<D: Device>(engine: &Runner<D>) -> Vec<(u32, f64)> {
    let req = GenerateRequest { prompt_ids: PROMPT.to_vec(), max_tokens: GENERATED, sampling: SamplingParams::default(), top_n: 1 };
    let g = engine.generate(&req, |_| {}).unwrap();
    g.generated_ids.iter().zip(&g.top).map(|(&id, top)| (id, top.iter().find(|t| t.0 == id).unwrap().1)).collect()
}

/// The expected [`Calls::snapshot`] — `[start_batch, qkv, store_kv, prefill_attention,
/// prefill items, decode_attention, decode items, finish_layer, logits]` — after `batches`
/// batches went through every layer, with `prefill_calls` / `decode_calls` attention calls
/// of `prefill_items` / `decode_items` items in all, per layer.
fn expected(n_layer: usize, batches: usize, prefill_calls: usize, prefill_items: usize, decode_calls: usize, decode_items: usize) -> [usize; 9] {
    let l = n_layer;
    [batches, batches * l, batches * l, prefill_calls * l, prefill_items * l, decode_calls * l, decode_items * l, batches * l, batches]
}

#[test]
fn the_runner_reaches_the_device_only_through_the_trait() {
    let want = reference();
    let calls = Arc::new(Calls::default());
    let engine = Runner::load_with(&model_path(), counting(&calls)).unwrap();
    let n_layer = engine.device.config().n_layer;
    assert_eq!(calls.snapshot(), [0; 9], "loading computes nothing");
    let got = generate(&engine);
    assert_eq!(got.iter().map(|g| (g.0, g.1.to_bits())).collect::<Vec<_>>(), want.iter().map(|g| (g.0, g.1.to_bits())).collect::<Vec<_>>());
    // One prefill chunk, then one decode batch per generated token but the last.
    let decodes = GENERATED - 1;
    assert_eq!(calls.snapshot(), expected(n_layer, 1 + decodes, 1, 1, decodes, decodes));
}

/// A sequence's part of a step: `tokens` at `start` (none: fed its last sample), in
/// sub-batch `sub`, all its attention on the gpu-worker.
fn part(seq_id: u64, start: usize, tokens: &[u32], new_blocks: Range<u32>, sub: u32) -> pb::SequenceStep {
    greedy_part(seq_id, start, tokens, new_blocks, sub, 1)
}

/// [`part`] asking for `top_logprobs` alternatives.
fn greedy_part(seq_id: u64, start: usize, tokens: &[u32], new_blocks: Range<u32>, sub: u32, top_logprobs: u32) -> pb::SequenceStep {
    let greedy = pb::SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, repetition_penalty: 1.0, seed: 0, top_logprobs, constraint: None, ..Default::default() };
    pb::SequenceStep {
        seq_id,
        start_pos: start as u32,
        tokens: tokens.to_vec(),
        new_blocks: new_blocks.map(|block| pb::KvBlockRef { worker: 0, block }).collect(),
        sampler: (start == 0).then_some(greedy),
        sample: true,
        attention: Vec::new(),
        sub_batch: sub,
        feed_sampled: tokens.is_empty(),
        held_tokens: Vec::new(),
        ..Default::default()
    }
}

#[test]
fn the_executor_reaches_the_device_only_through_the_trait() {
    let want = reference();
    let calls = Arc::new(Calls::default());
    let device = counting(&calls)(Arc::new(GgufFile::open(model_path()).unwrap())).unwrap();
    let n_layer = device.config().n_layer;
    let (mut ex, _segments) = support::executor_with_arena(device, "seam");
    let mut sampled: Vec<Vec<(u32, f32)>> = vec![Vec::new(), Vec::new()];
    let mut run = |step: u64, sequences: Vec<pb::SequenceStep>| {
        let resp = ex.step(&pb::StepRequest { step, sequences, released: Vec::new(), after_step: step - 1 }).unwrap();
        for s in resp.sampled {
            let t = s.token.unwrap();
            sampled[s.seq_id as usize - 1].push((t.id, t.logprob));
        }
    };
    // Overlapped steps: sequence 1 in sub-batch 0, sequence 2 in sub-batch 1 — a prefill
    // step, then decode steps feeding each its own last sample.
    run(1, vec![part(1, 0, &PROMPT, 0..1, 0), part(2, 0, &PROMPT, 1..2, 1)]);
    for i in 0..GENERATED - 2 {
        let at = PROMPT.len() + i;
        run(2 + i as u64, vec![part(1, at, &[], 0..0, 0), part(2, at, &[], 0..0, 1)]);
    }
    let overlapped = GENERATED - 1;
    assert_eq!(calls.snapshot(), expected(n_layer, 2 * overlapped, 2, 2, 2 * (overlapped - 1), 2 * (overlapped - 1)), "overlapped steps");
    // A plain step: sequence 1 alone, its decode attention split into two shares on the
    // device (one call of two items per layer), merged by log-sum-exp.
    let at = PROMPT.len() + GENERATED - 2;
    let shares = [0..3, 3..at + 1].map(|r| pb::AttentionShare { cpu_worker: None, start: r.start as u32, end: r.end as u32 });
    run(GENERATED as u64, vec![pb::SequenceStep { attention: shares.to_vec(), ..part(1, at, &[], 0..0, 0) }]);
    let decode_calls = 2 * (overlapped - 1) + 1;
    assert_eq!(calls.snapshot(), expected(n_layer, 2 * overlapped + 1, 2, 2, decode_calls, decode_calls + 1), "then a plain step");
    // Both sequences sampled what the runner samples on the CPU device: bit for bit where the
    // attention ran whole. Split, each share rounds its own softmax weights to f16 and the
    // parts merge in f64; the 8-bit activation quantisation downstream can turn that last-bit
    // difference into a few hundredths of a log-probability (measured 0.028 here).
    let want_bits: Vec<(u32, u32)> = want.iter().map(|&(id, lp)| (id, (lp as f32).to_bits())).collect();
    let bits = |s: &[(u32, f32)]| s.iter().map(|&(id, lp)| (id, lp.to_bits())).collect::<Vec<_>>();
    assert_eq!(bits(&sampled[0][..GENERATED - 1]), want_bits[..GENERATED - 1]);
    assert_eq!(bits(&sampled[1]), want_bits[..GENERATED - 1]);
    let (split, whole) = (sampled[0][GENERATED - 1], want[GENERATED - 1]);
    assert!(split.0 == whole.0 && (split.1 as f64 - whole.1).abs() < 0.1, "split decode: {split:?}, whole: {whole:?}");
}

#[test]
fn greedy_steps_take_the_tokens_the_device_finds() {
    let want: Vec<u32> = reference().iter().map(|r| r.0).collect();
    let calls = Arc::new(Calls::default());
    let file = Arc::new(GgufFile::open(model_path()).unwrap());
    let device = Counting { inner: CpuDevice::load(file, true).unwrap(), calls: calls.clone(), greedy_on_device: true, whole_layers: 0 };
    let (mut ex, _segments) = support::executor_with_arena(device, "seam-greedy");
    let mut run = |step: u64, sequences: Vec<pb::SequenceStep>| ex.step(&pb::StepRequest { step, sequences, released: Vec::new(), after_step: step - 1 }).unwrap().sampled;
    // Two greedy sequences asking for no log-probabilities: their tokens come from the device
    // and no logits are handed over.
    let mut got: Vec<Vec<u32>> = vec![Vec::new(), Vec::new()];
    let mut keep = |sampled: Vec<pb::Sampled>| sampled.into_iter().for_each(|s| got[s.seq_id as usize - 1].push(s.token.unwrap().id));
    keep(run(1, vec![greedy_part(1, 0, &PROMPT, 0..1, 0, 0), greedy_part(2, 0, &PROMPT, 1..2, 0, 0)]));
    for i in 0..GENERATED - 1 {
        let at = PROMPT.len() + i;
        keep(run(2 + i as u64, vec![greedy_part(1, at, &[], 0..0, 0, 0), greedy_part(2, at, &[], 0..0, 0, 0)]));
    }
    assert_eq!(got, [want.clone(), want.clone()]);
    assert_eq!((calls.greedy_tokens.load(Ordering::Relaxed), calls.logits.load(Ordering::Relaxed)), (GENERATED, 0));
    // A sequence asking for log-probabilities needs the logits: the step samples from them.
    let at = PROMPT.len() + GENERATED - 1;
    let sampled = run(GENERATED as u64 + 1, vec![greedy_part(1, at, &[], 0..0, 0, 0), greedy_part(3, 0, &PROMPT, 2..3, 0, 2)]);
    assert_eq!(sampled.len(), 2);
    assert_eq!(sampled[1].top.len(), 2);
    assert_eq!(sampled[1].token.as_ref().unwrap().id, want[0]);
    assert_eq!(calls.logits.load(Ordering::Relaxed), 1);
}

#[test]
fn the_runners_plain_greedy_generation_takes_the_tokens_the_device_finds() {
    let want: Vec<u32> = reference().iter().map(|r| r.0).collect();
    let calls = Arc::new(Calls::default());
    let greedy = |file| Ok(Counting { inner: CpuDevice::load(file, true)?, calls: calls.clone(), greedy_on_device: true, whole_layers: 0 });
    let engine = Runner::load_with(&model_path(), greedy).unwrap();
    // No log-probabilities asked for: every token from the device, no logits handed over.
    let req = GenerateRequest { prompt_ids: PROMPT.to_vec(), max_tokens: GENERATED, sampling: SamplingParams::default(), top_n: 0 };
    let g = engine.generate(&req, |_| {}).unwrap();
    assert_eq!(g.generated_ids, want);
    assert_eq!((calls.greedy_tokens.load(Ordering::Relaxed), calls.logits.load(Ordering::Relaxed)), (GENERATED, 0));
    // Log-probabilities, or a sampled generation, need the logits.
    assert_eq!(generate(&engine).iter().map(|r| r.0).collect::<Vec<_>>(), want);
    let sampled = GenerateRequest { sampling: SamplingParams { temperature: 0.8, ..SamplingParams::default() }, ..req };
    // (A forward pass per generated token: the prompt's, then one per token but the last.)
    let drawn = engine.generate(&sampled, |_| {}).unwrap().generated_ids.len();
    assert_eq!((calls.greedy_tokens.load(Ordering::Relaxed), calls.logits.load(Ordering::Relaxed)), (GENERATED, GENERATED + drawn));
}

#[test]
fn whole_layers_on_the_device_compute_what_the_layer_calls_do() {
    let want = reference();
    let bits = |s: &[(u32, f64)]| s.iter().map(|&(id, lp)| (id, (lp as f32).to_bits())).collect::<Vec<_>>();
    // The runner: every layer of the prefill and of each decode token wholly on the device.
    let calls = Arc::new(Calls::default());
    let whole = |file| Ok(Counting { inner: CpuDevice::load(file, true)?, calls: calls.clone(), greedy_on_device: false, whole_layers: usize::MAX });
    let engine = Runner::load_with(&model_path(), whole).unwrap();
    let n_layer = engine.device.config().n_layer;
    assert_eq!(bits(&generate(&engine)), bits(&want));
    assert_eq!(calls.layers_on_device.load(Ordering::Relaxed), n_layer * GENERATED);
    // The executor: a plain step with no cpu-worker share takes whole layers; a step with
    // shares (split attention on the device) does not, and neither does an overlapped one.
    let calls = Arc::new(Calls::default());
    let file = Arc::new(GgufFile::open(model_path()).unwrap());
    let device = Counting { inner: CpuDevice::load(file, true).unwrap(), calls: calls.clone(), greedy_on_device: false, whole_layers: usize::MAX };
    let (mut ex, _segments) = support::executor_with_arena(device, "seam-whole");
    let mut got: Vec<(u32, f32)> = Vec::new();
    let mut run = |step: u64, sequences: Vec<pb::SequenceStep>| {
        let resp = ex.step(&pb::StepRequest { step, sequences, released: Vec::new(), after_step: step - 1 }).unwrap();
        for s in resp.sampled {
            let t = s.token.unwrap();
            got.push((t.id, t.logprob));
        }
        resp.timings.unwrap()
    };
    run(1, vec![part(1, 0, &PROMPT, 0..1, 0)]);
    for i in 0..GENERATED - 2 {
        // The device's attention time (its GPU events) is the step's GPU attention, for the
        // balancer's fit, and not part of the linear layers' time.
        let t = run(2 + i as u64, vec![part(1, PROMPT.len() + i, &[], 0..0, 0)]);
        assert_eq!((t.attention_gpu_ns, t.gpu_attention_positions), (n_layer as u64 * ATTENTION_NS_PER_LAYER, (PROMPT.len() + i + 1) as u64));
        assert_eq!(t.linear_ns, t.total_ns - t.kv_write_ns - t.attention_gpu_ns - t.attention_wait_ns - t.merge_ns - t.sample_ns);
    }
    assert_eq!(calls.layers_on_device.load(Ordering::Relaxed), n_layer * (GENERATED - 1));
    let at = PROMPT.len() + GENERATED - 2;
    let shares = [0..3, 3..at + 1].map(|r| pb::AttentionShare { cpu_worker: None, start: r.start as u32, end: r.end as u32 });
    run(GENERATED as u64, vec![pb::SequenceStep { attention: shares.to_vec(), ..part(1, at, &[], 0..0, 0) }]);
    assert_eq!(calls.layers_on_device.load(Ordering::Relaxed), n_layer * (GENERATED - 1), "a split step goes the usual way");
    let got_bits: Vec<(u32, u32)> = got.iter().map(|&(id, lp)| (id, lp.to_bits())).collect();
    assert_eq!(got_bits[..GENERATED - 1], bits(&want)[..GENERATED - 1]);
    assert_eq!(got[GENERATED - 1].0, want[GENERATED - 1].0);
}

#[test]
fn the_kv_mirrors_upload_time_comes_out_of_where_it_was_timed() {
    let n_steps = 4;
    // steps(WHOLE, PER_WHOLE_LAYER, PER_CALL): a prompt, then decode steps of one sequence on a
    // device that takes its first WHOLE layers whole and reports those upload times (ns).
    let steps = |whole: usize, per_whole_layer: usize, per_call: usize, shares: bool| {
        let calls = Arc::new(Calls::default());
        calls.upload_per_whole_layer.store(per_whole_layer, Ordering::Relaxed);
        calls.upload_per_attention_call.store(per_call, Ordering::Relaxed);
        let file = Arc::new(GgufFile::open(model_path()).unwrap());
        let device = Counting { inner: CpuDevice::load(file, true).unwrap(), calls, greedy_on_device: false, whole_layers: whole };
        let n_layer = device.config().n_layer;
        let (mut ex, _segments) = support::executor_with_arena(device, &format!("seam-up-{whole}-{per_call}"));
        let mut run = |step: u64, sequences: Vec<pb::SequenceStep>| ex.step(&pb::StepRequest { step, sequences, released: Vec::new(), after_step: step - 1 }).unwrap().timings.unwrap();
        run(1, vec![part(1, 0, &PROMPT, 0..1, 0)]);
        let timings: Vec<pb::StepTimings> = (0..n_steps)
            .map(|i| {
                let at = PROMPT.len() + i;
                let attention = if shares { [0..2, 2..at + 1].map(|r| pb::AttentionShare { cpu_worker: None, start: r.start as u32, end: r.end as u32 }).to_vec() } else { Vec::new() };
                run(2 + i as u64, vec![pb::SequenceStep { attention, ..part(1, at, &[], 0..0, 0) }])
            })
            .collect();
        (n_layer, timings)
    };
    let untimed = |t: &pb::StepTimings| t.total_ns - t.kv_write_ns - t.attention_gpu_ns - t.attention_wait_ns - t.merge_ns - t.sample_ns - t.gpu_kv_upload_ns;

    // Layers wholly on the device: their uploads come out of the linear layers' remainder,
    // never out of the attention its events timed.
    let (n_layer, ts) = steps(usize::MAX, 1_000, 0, false);
    for t in &ts {
        assert_eq!((t.attention_gpu_ns, t.gpu_kv_upload_ns), (n_layer as u64 * ATTENTION_NS_PER_LAYER, n_layer as u64 * 1_000));
        assert_eq!(t.linear_ns, untimed(t));
    }
    // The first half of the layers whole (the GPU's, `--gpu-layers`), the rest through the
    // executor's attention calls: the whole layers' uploads (here longer than any step) must
    // not come out of the host-timed attention of the others, which stays above the events'.
    let (n_layer, ts) = steps(n_layer / 2, 1_000_000_000, 0, false);
    for t in &ts {
        assert!(t.attention_gpu_ns > (n_layer / 2) as u64 * ATTENTION_NS_PER_LAYER, "{t:?}");
        assert_eq!(t.gpu_kv_upload_ns, (n_layer / 2) as u64 * 1_000_000_000);
    }
    // A split step: every layer through the executor's attention calls, which it times on
    // the host, uploads included: they come out of it, and never take it below zero.
    let (n_layer, ts) = steps(usize::MAX, 0, 1_000_000_000, true);
    for t in &ts {
        assert_eq!((t.attention_gpu_ns, t.gpu_kv_upload_ns), (0, n_layer as u64 * 1_000_000_000), "{t:?}");
    }
    let (_, ts) = steps(usize::MAX, 0, 1, true);
    for t in &ts {
        assert!(t.attention_gpu_ns > 0 && t.gpu_kv_upload_ns == n_layer as u64, "{t:?}");
        assert_eq!(t.linear_ns, untimed(t));
    }
}
