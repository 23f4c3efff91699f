//! The single-process runner: loads a model, generates from a prompt (prefill, then one token
//! per step), and scores text for perplexity exactly as llama.cpp's llama-perplexity does.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use duet_common::kernels::ops::log_softmax;
use duet_common::model::chat::ChatTemplate;
use duet_common::model::gguf::GgufFile;
use duet_common::model::tokenizer::{StreamDecoder, Tokenizer};

use crate::device::cpu::{CpuModel, KvCache, Logits};
use crate::error::{Result, WorkerError};
use crate::sampler::{Sampler, SamplingParams};

/// Longest prompt slice run through one forward pass.
pub const PREFILL_CHUNK: usize = 512;

/// A loaded model with its tokenizer and (if the file has one) chat template.
pub struct Engine {
    pub model: CpuModel,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
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
    pub stop: StopReason,
    pub prefill_time: Duration,
    pub decode_time: Duration,
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

impl Engine {
    /// Loads a GGUF model; its tokenizer comes from a `tokenizer.json` beside the file when
    /// there is one, else from the GGUF's own metadata.
    pub fn load(path: &Path) -> Result<Self> {
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
        let model = CpuModel::load(file)?;
        if tokenizer.vocab_size() != model.config.n_vocab {
            return Err(WorkerError::InvalidRequest(format!(
                "tokenizer has {} tokens but the model's vocabulary is {}",
                tokenizer.vocab_size(),
                model.config.n_vocab
            )));
        }
        Ok(Engine { model, tokenizer, chat_template })
    }

    /// Generates up to `max_tokens` after the prompt; `on_text` receives text as it completes.
    pub fn generate(&self, req: &GenerateRequest, mut on_text: impl FnMut(&str)) -> Result<Generation> {
        let sampler = Sampler::new(req.sampling)?;
        if req.prompt_ids.is_empty() {
            return Err(WorkerError::InvalidRequest("the prompt is empty".into()));
        }
        if req.max_tokens == 0 {
            return Err(WorkerError::InvalidRequest("max_tokens must be at least 1".into()));
        }
        self.tokenizer.check_ids(&req.prompt_ids)?;
        let n_ctx = self.model.config.n_ctx_train;
        if req.prompt_ids.len() >= n_ctx {
            return Err(WorkerError::PromptTooLong { prompt: req.prompt_ids.len(), context: n_ctx });
        }
        let capacity = (req.prompt_ids.len() + req.max_tokens).min(n_ctx);
        let mut kv = KvCache::new(&self.model.config, capacity);
        self.generate_in(&mut kv, req, sampler, &mut on_text)
    }

    fn generate_in(&self, kv: &mut KvCache, req: &GenerateRequest, mut sampler: Sampler, on_text: &mut dyn FnMut(&str)) -> Result<Generation> {
        let start = Instant::now();
        let mut logits = Vec::new();
        for chunk in req.prompt_ids.chunks(PREFILL_CHUNK) {
            logits = self.model.forward(chunk, kv, Logits::Last)?;
        }
        let prefill_time = start.elapsed();
        let decode_start = Instant::now();
        let mut out = Generation {
            generated_ids: Vec::new(),
            text: String::new(),
            top: Vec::new(),
            stop: StopReason::MaxTokens,
            prefill_time,
            decode_time: Duration::ZERO,
        };
        let mut stream = StreamDecoder::default();
        let mut history = req.prompt_ids.clone();
        loop {
            if req.top_n > 0 {
                out.top.push(top_n(&logits, req.top_n));
            }
            let token = sampler.sample(&logits, &history);
            history.push(token);
            out.generated_ids.push(token);
            let piece = stream.push(self.tokenizer.token_bytes(token)?);
            on_text(&piece);
            out.text.push_str(&piece);
            if self.tokenizer.end_of_generation.contains(&token) {
                out.stop = StopReason::EndOfGeneration;
                break;
            }
            if out.generated_ids.len() >= req.max_tokens {
                break;
            }
            if kv.len() >= kv.capacity() {
                out.stop = StopReason::ContextFull;
                break;
            }
            logits = self.model.forward(&[token], kv, Logits::Last)?;
        }
        let tail = stream.finish();
        on_text(&tail);
        out.text.push_str(&tail);
        out.decode_time = decode_start.elapsed();
        Ok(out)
    }

    /// llama-perplexity's method: `floor(n / n_ctx)` chunks, each from an empty cache, scoring
    /// the second half (logits at `n_ctx/2 .. n_ctx-2` predict the next token); NLL in f64.
    pub fn perplexity(&self, tokens: &[u32], n_ctx: usize, mut progress: impl FnMut(usize, usize, f64)) -> Result<Perplexity> {
        if n_ctx < 4 || n_ctx > self.model.config.n_ctx_train {
            return Err(WorkerError::InvalidRequest(format!("ctx must be in 4..={}, got {n_ctx}", self.model.config.n_ctx_train)));
        }
        self.tokenizer.check_ids(tokens)?;
        let chunks = tokens.len() / n_ctx;
        if chunks == 0 {
            return Err(WorkerError::InvalidRequest(format!("{} tokens are fewer than one chunk of {n_ctx}", tokens.len())));
        }
        let first = n_ctx / 2;
        let mut kv = KvCache::new(&self.model.config, n_ctx);
        let (mut nll, mut scored) = (0f64, 0usize);
        for c in 0..chunks {
            let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
            if let (true, Some(bos)) = (self.tokenizer.add_bos, self.tokenizer.bos) {
                chunk[0] = bos;
            }
            kv.clear();
            let mut logits = Vec::new();
            for (i, part) in chunk.chunks(PREFILL_CHUNK).enumerate() {
                let start = i * PREFILL_CHUNK;
                let end = start + part.len();
                // Only rows from `first` on are scored: skip the LM head before them.
                let from = first.saturating_sub(start);
                let rows = self.model.forward(part, &mut kv, Logits::From(from.min(part.len() - 1)))?;
                if end > first {
                    logits.extend(rows);
                }
            }
            let n_vocab = self.model.config.n_vocab;
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
    let lp = log_softmax(logits);
    let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
    let n = n.min(idx.len());
    idx.select_nth_unstable_by(n.saturating_sub(1), |&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
    idx.truncate(n);
    idx.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
    idx.into_iter().map(|i| (i, lp[i as usize])).collect()
}
