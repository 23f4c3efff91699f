//! The single-process runner: loads a model onto a device, generates from a prompt (prefill,
//! then one token per step), and scores text for perplexity exactly as llama.cpp's
//! llama-perplexity does. Its KV is a plain in-process cache ([`KvCache`]); its forward pass
//! is the layer loop every device runs (`crate::forward`).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_kernels::ops::log_softmax;
use duet_model::chat::ChatTemplate;
use duet_model::gguf::GgufFile;
use duet_model::tokenizer::{StreamDecoder, Tokenizer};

use duet_kernels::attention::{KvRows, KvRun};
use duet_kernels::dot::quantize_row;
use duet_kernels::GgmlType;
use duet_kv::KvDtype;
use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::device::cpu::CpuDevice;
use crate::device::{AnyDevice, DecodeItem, Device, KvAccessError, NoRemoteExperts, Placement, KvSink, KvSource, PrefillItem, Qkv};
use crate::error::{Result, GpuWorkerError};
use crate::forward::{run_layers, LayerAttention};
use crate::sampler::{Sampler, SamplingParams};

/// A model loaded onto a device, with its tokenizer and (if the file has one) chat template.
pub struct Runner<D: Device = CpuDevice> {
    pub device: D,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// The element type of the caches it generates and scores with (f16 unless set).
    pub kv_type: KvDtype,
}

/// What a generation's forward pass hands its sampling: the last row's logits, or the token
/// a device found itself.
enum Next {
    Logits(Vec<f32>),
    Token(u32),
}

/// Which positions of a forward pass need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token (generation).
    Last,
    /// Tokens `from..` of the batch (perplexity scoring).
    From(usize),
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GenerationEnd {
    EndOfGeneration,
    MaxTokens,
    ContextFull,
}

/// What a generation produced.
#[derive(Debug, Clone)]
pub struct Generation {
    pub generated_ids: Vec<u32>,
    pub text: String,
    /// For each generated position, the `top_n` most likely tokens with log-probabilities.
    pub top: Vec<Vec<(u32, f64)>>,
    pub stop: GenerationEnd,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    /// Where the device's time went in the prefill and in the decode, per phase of its calls
    /// (`Device::phase_times`, nanoseconds; empty for a device without them).
    pub device_phases: [Vec<(&'static str, u64)>; 2],
}

/// A generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// How many most-likely tokens to report per position (0: none).
    pub top_n: usize,
}

/// Perplexity over a token stream.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Perplexity {
    pub ppl: f64,
    pub tokens_scored: usize,
    pub chunks: usize,
}

impl Runner<CpuDevice> {
    /// Loads a GGUF model onto the CPU device (see [`Runner::load_with`]).
    pub fn load(path: &Path) -> Result<Self> {
        Runner::load_with(path, |file| CpuDevice::load(file, true))
    }
}

impl Runner<AnyDevice> {
    /// Loads a GGUF model where `placement` says (a device, or its first layers there and
    /// the rest on the CPU device).
    pub fn load_on(path: &Path, placement: impl Into<Placement>) -> Result<Self> {
        let placement = placement.into();
        Runner::load_with(path, |file| crate::device::open(placement, file, true))
    }
}

impl<D: Device> Runner<D> {
    /// Loads a GGUF model with `open` putting its weights on a device; the tokenizer comes
    /// from a `tokenizer.json` beside the file when there is one, else from the GGUF's own
    /// metadata.
    pub fn load_with(path: &Path, open: impl FnOnce(Arc<GgufFile>) -> Result<D>) -> Result<Self> {
        let file = Arc::new(GgufFile::open(path)?);
        let tokenizer = match path.parent().map(|dir| dir.join("tokenizer.json")).filter(|p| p.exists()) {
            Some(json) => {
                tracing::info!(path = %json.display(), "tokenizer from the model directory's tokenizer.json");
                Tokenizer::from_file(&json)?
            }
            None => Tokenizer::from_gguf(&file)?,
        };
        let chat_template = match ChatTemplate::from_gguf(&file) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!("no usable chat template: {e}");
                None
            }
        };
        let device = open(file)?;
        if tokenizer.vocab_size() != device.config().n_vocab {
            return Err(GpuWorkerError::InvalidRequest(format!(
                "tokenizer has {} tokens but the model's vocabulary is {}",
                tokenizer.vocab_size(),
                device.config().n_vocab
            )));
        }
        Ok(Runner { device, tokenizer, chat_template, kv_type: KvDtype::F16 })
    }

    /// Runs `tokens` at positions `kv.len()..` through the model, appending their K/V to the
    /// cache, and returns the logits asked for (`[row][vocab]`).
    pub fn forward(&self, tokens: &[u32], kv: &mut KvCache, logits: Logits) -> Result<Vec<f32>> {
        let batch = self.run_batch(tokens, kv, logits)?;
        self.device.logits(&batch)
    }

    /// [`Runner::forward`] of a generation's step with the last row's logits: with `greedy`
    /// (plain greedy, no log-probabilities wanted), the device's own arg-max where it finds
    /// one without handing the logits over (the CUDA device).
    fn forward_next(&self, tokens: &[u32], kv: &mut KvCache, greedy: bool) -> Result<Next> {
        let batch = self.run_batch(tokens, kv, Logits::Last)?;
        if greedy {
            if let Some(ids) = self.device.greedy_tokens(&batch)? {
                let id = ids.first().copied().ok_or_else(|| GpuWorkerError::InvalidRequest("the device gave no greedy token".into()))?;
                return Ok(Next::Token(id));
            }
        }
        Ok(Next::Logits(self.device.logits(&batch)?))
    }

    /// `tokens` through every layer, their K/V appended to `kv`: the batch, for its logits.
    fn run_batch(&self, tokens: &[u32], kv: &mut KvCache, logits: Logits) -> Result<D::Batch> {
        let n = tokens.len();
        let pos0 = kv.len;
        if n == 0 {
            return Err(GpuWorkerError::InvalidRequest("empty batch".into()));
        }
        if pos0 + n > kv.capacity {
            return Err(GpuWorkerError::ContextFull { needed: pos0 + n, capacity: kv.capacity });
        }
        let positions: Vec<usize> = (pos0..pos0 + n).collect();
        let rows: Vec<usize> = match logits {
            Logits::Last => vec![n - 1],
            Logits::From(i) => (i.min(n - 1)..n).collect(),
        };
        let mut batch = [self.device.start_batch(tokens, &positions, &rows)?];
        run_layers(&self.device, &mut batch, &mut CacheAttention { kv: &mut *kv, pos0, n })?;
        kv.len = pos0 + n;
        let [batch] = batch;
        Ok(batch)
    }

    /// Generates up to `max_tokens` after the prompt; `on_text` receives text as it completes.
    pub fn generate(&self, req: &GenerateRequest, mut on_text: impl FnMut(&str)) -> Result<Generation> {
        let sampler = Sampler::new(req.sampling)?;
        if req.prompt_ids.is_empty() {
            return Err(GpuWorkerError::InvalidRequest("the prompt is empty".into()));
        }
        if req.max_tokens == 0 {
            return Err(GpuWorkerError::InvalidRequest("max_tokens must be at least 1".into()));
        }
        self.tokenizer.check_ids(&req.prompt_ids)?;
        let n_ctx = self.device.config().n_ctx_train;
        if req.prompt_ids.len() >= n_ctx {
            return Err(GpuWorkerError::PromptTooLong { prompt: req.prompt_ids.len(), context: n_ctx });
        }
        let capacity = (req.prompt_ids.len() + req.max_tokens).min(n_ctx);
        let mut kv = KvCache::of_type(self.device.config(), capacity, self.kv_type)?;
        self.generate_in(&mut kv, req, sampler, &mut on_text)
    }

    fn generate_in(&self, kv: &mut KvCache, req: &GenerateRequest, sampler: Sampler, on_text: &mut dyn FnMut(&str)) -> Result<Generation> {
        let start = Instant::now();
        // Taking the phase times zeroes them: what earlier calls spent is left out.
        self.device.phase_times();
        // Plain greedy with no log-probabilities: the device may give the tokens itself.
        let greedy = sampler.is_plain_greedy() && req.top_n == 0;
        let mut next = Next::Logits(Vec::new());
        for chunk in req.prompt_ids.chunks(self.device.prefill_chunk()) {
            next = self.forward_next(chunk, kv, greedy)?;
        }
        let prefill_time = start.elapsed();
        let prefill_phases = self.device.phase_times();
        let decode_start = Instant::now();
        let mut out = Generation {
            generated_ids: Vec::new(),
            text: String::new(),
            top: Vec::new(),
            stop: GenerationEnd::MaxTokens,
            prefill_time,
            decode_time: Duration::ZERO,
            device_phases: [prefill_phases, Vec::new()],
        };
        let mut stream = StreamDecoder::default();
        let mut history = req.prompt_ids.clone();
        loop {
            let token = match &next {
                Next::Token(id) => *id,
                Next::Logits(logits) => {
                    if req.top_n > 0 {
                        out.top.push(top_n(logits, req.top_n));
                    }
                    sampler.sample(logits, &history)
                }
            };
            history.push(token);
            out.generated_ids.push(token);
            let piece = stream.push(self.tokenizer.token_bytes(token)?);
            on_text(&piece);
            out.text.push_str(&piece);
            if self.tokenizer.end_of_generation.contains(&token) {
                out.stop = GenerationEnd::EndOfGeneration;
                break;
            }
            if out.generated_ids.len() >= req.max_tokens {
                break;
            }
            if kv.len() >= kv.capacity() {
                out.stop = GenerationEnd::ContextFull;
                break;
            }
            next = self.forward_next(&[token], kv, greedy)?;
        }
        let tail = stream.finish();
        on_text(&tail);
        out.text.push_str(&tail);
        out.decode_time = decode_start.elapsed();
        out.device_phases[1] = self.device.phase_times();
        Ok(out)
    }

    /// The log-probability of each of `tokens` after the first under the tokens before it,
    /// prefilled in the chunks a generation's prompt is ([`Device::prefill_chunk`]): what the
    /// served system's `prompt_logprobs` report.
    pub fn prompt_logprobs(&self, tokens: &[u32]) -> Result<Vec<f64>> {
        self.tokenizer.check_ids(tokens)?;
        let mut kv = KvCache::of_type(self.device.config(), tokens.len(), self.kv_type)?;
        let n_vocab = self.device.config().n_vocab;
        let mut out = Vec::with_capacity(tokens.len().saturating_sub(1));
        for (c, part) in tokens.chunks(self.device.prefill_chunk()).enumerate() {
            let start = c * self.device.prefill_chunk();
            let rows = self.forward(part, &mut kv, Logits::From(0))?;
            for (i, row) in rows.chunks_exact(n_vocab).enumerate() {
                if let Some(&next) = tokens.get(start + i + 1) {
                    out.push(log_softmax(row)[next as usize]);
                }
            }
        }
        Ok(out)
    }

    /// llama-perplexity's method: `floor(n / n_ctx)` chunks, each from an empty cache, scoring
    /// the second half (logits at `n_ctx/2 .. n_ctx-2` predict the next token); NLL in f64.
    pub fn perplexity(&self, tokens: &[u32], n_ctx: usize, mut progress: impl FnMut(usize, usize, f64)) -> Result<Perplexity> {
        let n_ctx_train = self.device.config().n_ctx_train;
        if n_ctx < 4 || n_ctx > n_ctx_train {
            return Err(GpuWorkerError::InvalidRequest(format!("ctx must be in 4..={n_ctx_train}, got {n_ctx}")));
        }
        self.tokenizer.check_ids(tokens)?;
        let chunks = tokens.len() / n_ctx;
        if chunks == 0 {
            return Err(GpuWorkerError::InvalidRequest(format!("{} tokens are fewer than one chunk of {n_ctx}", tokens.len())));
        }
        let first = n_ctx / 2;
        let mut kv = KvCache::of_type(self.device.config(), n_ctx, self.kv_type)?;
        let prefill_chunk = self.device.prefill_chunk();
        let (mut nll, mut scored) = (0f64, 0usize);
        for c in 0..chunks {
            let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
            if let (true, Some(bos)) = (self.tokenizer.add_bos, self.tokenizer.bos) {
                chunk[0] = bos;
            }
            kv.clear();
            let mut logits = Vec::new();
            for (i, part) in chunk.chunks(prefill_chunk).enumerate() {
                let start = i * prefill_chunk;
                let end = start + part.len();
                // Only rows from `first` on are scored: skip the LM head before them.
                let from = first.saturating_sub(start);
                let rows = self.forward(part, &mut kv, Logits::From(from.min(part.len() - 1)))?;
                if end > first {
                    logits.extend(rows);
                }
            }
            let n_vocab = self.device.config().n_vocab;
            for (i, row) in logits.chunks_exact(n_vocab).enumerate() {
                let pos = first + i;
                if pos + 1 >= n_ctx {
                    break;
                }
                nll -= log_softmax(row)[chunk[pos + 1] as usize];
                scored += 1;
            }
            progress(c + 1, chunks, (nll / scored as f64).exp());
        }
        Ok(Perplexity { ppl: (nll / scored as f64).exp(), tokens_scored: scored, chunks })
    }
}

/// The `n` most likely tokens with their log-probabilities (log-softmax over all logits).
pub fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f64)> {
    top_n_of(&log_softmax(logits), n)
}

/// [`top_n`] of log-probabilities `lp` already computed.
pub fn top_n_of(lp: &[f64], n: usize) -> Vec<(u32, f64)> {
    let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
    let n = n.min(idx.len());
    idx.select_nth_unstable_by(n.saturating_sub(1), |&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
    idx.truncate(n);
    idx.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
    idx.into_iter().map(|i| (i, lp[i as usize])).collect()
}

/// One sequence's KV cache in this process: per layer and KV head, `[position][head_dim]` in
/// f16 or Q8_0.
#[derive(Debug)]
pub struct KvCache {
    /// `k[layer][kv_head]`, `capacity` rows each.
    k: Vec<Vec<CacheRows>>,
    v: Vec<Vec<CacheRows>>,
    head_dim: usize,
    capacity: usize,
    len: usize,
    /// The identity of the sequence the cache holds (`KvSource::seq_key`), new whenever the
    /// cache is cleared.
    id: u64,
}

/// A new cache identity (see `KvCache::id`).
fn next_cache_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// One KV head's rows in the cache's type.
#[derive(Debug, Clone)]
enum CacheRows {
    F16(Vec<f16>),
    /// `head_dim / 32` Q8_0 blocks per row.
    Q8_0(Vec<u8>),
}

impl CacheRows {
    /// Stores row `p` (`head.len()` values).
    fn write(&mut self, p: usize, head: &[f32]) {
        match self {
            CacheRows::F16(x) => x[p * head.len()..(p + 1) * head.len()].convert_from_f32_slice(head),
            CacheRows::Q8_0(b) => {
                let row = GgmlType::Q8_0.row_bytes(head.len());
                quantize_row(GgmlType::Q8_0, head, &mut b[p * row..(p + 1) * row]);
            }
        }
    }

    /// Rows `range` of heads of `hd`.
    fn rows(&self, range: std::ops::Range<usize>, hd: usize) -> KvRows<'_> {
        match self {
            CacheRows::F16(x) => KvRows::F16(&x[range.start * hd..range.end * hd]),
            CacheRows::Q8_0(b) => {
                let row = GgmlType::Q8_0.row_bytes(hd);
                KvRows::Q8_0(&b[range.start * row..range.end * row])
            }
        }
    }
}

impl KvCache {
    /// An f16 cache of `capacity` positions.
    pub fn new(config: &duet_model::config::LlamaConfig, capacity: usize) -> Self {
        Self::of_type(config, capacity, KvDtype::F16).expect("f16 takes every head size")
    }

    /// A cache of `capacity` positions in `dtype` (f16 or q8_0; q8_0 needs heads of whole
    /// blocks of 32).
    pub fn of_type(config: &duet_model::config::LlamaConfig, capacity: usize, dtype: KvDtype) -> Result<Self> {
        let hd = config.head_dim;
        let rows = match dtype {
            KvDtype::F16 => CacheRows::F16(vec![f16::ZERO; capacity * hd]),
            KvDtype::Q8_0 if hd.is_multiple_of(32) => CacheRows::Q8_0(vec![0; capacity * GgmlType::Q8_0.row_bytes(hd)]),
            _ => return Err(GpuWorkerError::InvalidRequest(format!("a {dtype} KV cache for heads of {hd} (f16, or q8_0 for heads of a multiple of 32)"))),
        };
        let make = || vec![vec![rows.clone(); config.n_kv_head]; config.n_layer];
        Ok(KvCache { k: make(), v: make(), head_dim: hd, capacity, len: 0, id: next_cache_id() })
    }

    /// Positions already cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position (the memory is reused).
    pub fn clear(&mut self) {
        self.len = 0;
        self.id = next_cache_id();
    }
}

/// The runner's attention: a batch of `n` rows continuing the cache at `pos0` — one decode
/// token over the whole context, or a prefill chunk — all on the device.
struct CacheAttention<'a> {
    kv: &'a mut KvCache,
    pos0: usize,
    n: usize,
}

/// The batch's rows go to positions `pos0..` of the cache.
impl KvSink for CacheAttention<'_> {
    fn write(&mut self, layer: usize, row: usize, k: &[f32], v: &[f32]) -> Result<(), KvAccessError> {
        let (hd, p) = (self.kv.head_dim, self.pos0 + row);
        if p >= self.kv.capacity {
            return Err(KvAccessError::NoBlock { position: p });
        }
        for (src, dst) in [(k, &mut self.kv.k[layer]), (v, &mut self.kv.v[layer])] {
            for (h, head) in src.chunks_exact(hd).enumerate() {
                dst[h].write(p, head);
            }
        }
        Ok(())
    }

    fn position_of(&self, row: usize) -> Option<(u64, usize)> {
        Some((self.kv.id, self.pos0 + row))
    }
}

/// The cache holds one sequence (index 0), each KV head contiguous: one run.
impl KvSource for KvCache {
    fn runs(&self, _seq: usize, layer: usize, kv_head: usize, range: std::ops::Range<usize>) -> Result<Vec<KvRun<'_>>, KvAccessError> {
        let hd = self.head_dim;
        if range.end > self.capacity {
            return Err(KvAccessError::NoBlock { position: range.end - 1 });
        }
        let (k, v) = (&self.k[layer][kv_head], &self.v[layer][kv_head]);
        Ok(vec![KvRun { k: k.rows(range.clone(), hd), v: v.rows(range, hd) }])
    }

    fn seq_key(&self, _seq: usize) -> Option<u64> {
        Some(self.id)
    }
}

/// What the device attends: the cache's positions.
impl KvSource for CacheAttention<'_> {
    fn runs(&self, seq: usize, layer: usize, kv_head: usize, range: std::ops::Range<usize>) -> Result<Vec<KvRun<'_>>, KvAccessError> {
        self.kv.runs(seq, layer, kv_head, range)
    }

    fn seq_key(&self, seq: usize) -> Option<u64> {
        self.kv.seq_key(seq)
    }
}

impl<D: Device> LayerAttention<D> for CacheAttention<'_> {
    type Begun = ();
    type Error = GpuWorkerError;

    fn on_device(&mut self, device: &D, _sub: usize, layer: usize, batch: &mut D::Batch) -> Result<bool> {
        let item = [PrefillItem { seq: 0, row0: 0, n: self.n, start: self.pos0 }];
        device.layer_on_device(layer, batch, &item, self, &mut NoRemoteExperts)
    }

    fn begin(&mut self, device: &D, _sub: usize, layer: usize, qkv: &Qkv) -> Result<()> {
        device.store_kv(layer, qkv, self)
    }

    fn finish(&mut self, device: &D, _sub: usize, layer: usize, _: (), qkv: &Qkv, out: &mut [f32]) -> Result<()> {
        let n_ctx = self.pos0 + self.n;
        if self.n == 1 {
            let item = DecodeItem { seq: 0, row: 0, range: 0..n_ctx, n_ctx };
            let mut parts = device.decode_attention(layer, qkv, &[item], &*self.kv)?;
            out.copy_from_slice(&parts.remove(0).0);
            return Ok(());
        }
        let item = PrefillItem { seq: 0, row0: 0, n: self.n, start: self.pos0 };
        device.prefill_attention(layer, qkv, &[item], &*self.kv, out)
    }
}
