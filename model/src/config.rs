//! Hyper-parameters of the Llama-shaped architectures (llama, mistral, qwen2, qwen3, phi3,
//! gemma2, gemma3) read from GGUF metadata, validated before any weight is used.

use super::gguf::{GgufError, GgufFile, Value};
use super::names::{ArchKey, GeneralKey, TensorName};
use crate::error::Error;
use duet_kv::KvShape;

/// How rotary frequencies are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (`freq_scale = 1 / factor`).
    Linear { factor: f32 },
    /// Llama 3: per-pair frequency divisors (from `rope_freqs.weight`, or computed).
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_context: f32 },
    /// Divisors stored in the file as `rope_freqs.weight`.
    FreqFactors,
    /// YaRN: angles interpolated by `factor` on the long wavelengths and extrapolated on the
    /// short ones (a ramp between the pairs making `beta_fast` and `beta_slow` rotations over
    /// `original_context` positions), magnitudes scaled (`log_mul`: `yarn_log_multiplier`).
    Yarn { factor: f32, original_context: usize, beta_fast: f32, beta_slow: f32, log_mul: f32 },
    /// LongRoPE (Phi-3.x): per-pair divisors, `rope_factors_long.weight` when the context
    /// served is longer than `original_context`, else `rope_factors_short.weight`.
    LongRope { original_context: usize },
}

/// A mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE): a router picks `n_used` of
/// `n_expert` experts per token (softmax, top-k), whose outputs are summed weighted by their
/// router probabilities, renormalised to sum to 1 where `norm_weights`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Experts {
    pub n_expert: usize,
    pub n_used: usize,
    /// Each expert's hidden width.
    pub n_ff: usize,
    pub norm_weights: bool,
}

/// Llama 4's attention temperature (Mistral 3): each query is multiplied by
/// `ln(floor(pos / floor) + 1) * scale + 1`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnTemperature {
    pub scale: f32,
    pub floor: usize,
}

impl AttnTemperature {
    /// The factor of the query at `pos`, as llama.cpp computes it (in f64, stored as f32).
    pub fn at(&self, pos: usize) -> f32 {
        let steps = (pos as f32 / self.floor as f32).floor();
        ((f64::from(steps) + 1.0).ln() * f64::from(self.scale) + 1.0) as f32
    }
}

/// The activation of the gated MLP: `act(gate) * up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnAct {
    /// SwiGLU (Llama and most others).
    Silu,
    /// GeGLU with the tanh approximation (Gemma).
    Gelu,
}

/// Sliding-window attention (Gemma 2 and 3): on the layers it marks, the token at position
/// `p` attends only positions `p - window + 1 ..= p` (llama.cpp's standard SWA mask), and
/// RoPE uses its own base.
#[derive(Debug, Clone, PartialEq)]
pub struct SlidingWindow {
    pub window: usize,
    /// Per layer: whether it is a sliding-window layer.
    pub layers: Vec<bool>,
    pub rope_freq_base: f32,
    /// Whether the model's RoPE scaling applies on these layers too (Gemma 2) or not (Gemma 3).
    pub rope_scaled: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub arch: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub rope_freq_base: f32,
    pub rope_scaling: RopeScaling,
    /// `rope.scaling.attn_factor`: cos and sin are multiplied by it (with YaRN's own factor).
    pub rope_attn_factor: f32,
    /// Mistral 3's position-dependent query scale.
    pub attn_temperature: Option<AttnTemperature>,
    pub rms_eps: f32,
    /// NeoX RoPE: rotates the pairs (x[i], x[i + n_rot/2]) instead of (x[2i], x[2i+1]).
    pub rope_neox: bool,
    /// The embedding rows are multiplied by this (Gemma: sqrt(n_embd)); 1 elsewhere.
    pub embedding_scale: f32,
    /// The queries are multiplied by this before attention, whose kernels scale scores by
    /// 1/sqrt(head_dim): 1 unless the model's attention scale differs (Gemma 3 27B).
    pub q_prescale: f32,
    pub ffn_act: FfnAct,
    /// RMSNorms on the attention output and on the MLP output before each residual add (Gemma).
    pub post_norms: bool,
    pub sliding_window: Option<SlidingWindow>,
    /// Attention scores become `cap * tanh(score / cap)` before the softmax (Gemma 2).
    pub attn_logit_softcap: Option<f32>,
    /// Logits become `cap * tanh(logits / cap)`.
    pub final_logit_softcap: Option<f32>,
    /// The MLP of every layer is a mixture of experts.
    pub experts: Option<Experts>,
}

/// Architectures with Llama's block (RMSNorm, attention, SwiGLU): llama and mistral as they
/// are, qwen2 with Q/K/V biases and NeoX RoPE, qwen3 with per-head Q/K RMSNorm and NeoX RoPE
/// phi3 with fused Q/K/V and gate/up matrices and NeoX RoPE (and the 128k models' LongRoPE),
/// and mistral3 (Mistral Small 3.x, Ministral) as llama with Llama 4's attention temperature
/// (the optional tensors are found by the loader). Any of them may scale RoPE (linear,
/// llama3, yarn, longrope). gemma2 adds to Llama's block an embedding scale, GeGLU, RMSNorms after attention and
/// after the MLP, sliding-window attention on every other layer, and soft-capped attention
/// scores and logits; gemma3 has the same without the attention soft-cap, with qwen3's Q/K
/// norms and the window on 5 layers of 6.
/// llama (Mixtral) and qwen3moe and olmoe may have mixture-of-experts MLPs.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "mistral", "mistral3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3moe", "olmoe"];
/// Those of them whose RoPE is NeoX's.
const NEOX_ROPE: &[&str] = &["qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3moe", "olmoe"];

fn get<'a>(g: &'a GgufFile, key: &str) -> Result<&'a Value, GgufError> {
    g.get(key).ok_or_else(|| GgufError::MissingKey { key: key.to_string() })
}

fn get_usize(g: &GgufFile, key: &str) -> Result<usize, GgufError> {
    let v = get(g, key)?;
    v.as_u64()
        .and_then(|v| usize::try_from(v).ok())
        .ok_or(GgufError::WrongType { key: key.to_string(), expected: "unsigned integer", found: v.type_name() })
}

fn get_f32(g: &GgufFile, key: &str) -> Result<f32, GgufError> {
    let v = get(g, key)?;
    v.as_f64().map(|v| v as f32).ok_or(GgufError::WrongType { key: key.to_string(), expected: "number", found: v.type_name() })
}

/// A Gemma sliding window as llama.cpp reads it: the window `attention.sliding_window`
/// (default `window`), the layers from `attention.sliding_window_pattern` (an array of
/// booleans, or n: every layer but each n-th; default `pattern`), the RoPE base
/// `rope.freq_base_swa` (default `rope.0`) and whether RoPE scaling applies there (`rope.1`).
fn sliding_window(g: &GgufFile, arch: &str, n_layer: usize, window: usize, pattern: u64, rope: (f32, bool)) -> Result<Option<SlidingWindow>, Error> {
    let k = |key: ArchKey| key.key(arch);
    let window = opt(get_usize(g, &k(ArchKey::SlidingWindow)))?.unwrap_or(window);
    if window == 0 {
        return Ok(None);
    }
    let pattern_key = k(ArchKey::SlidingWindowPattern);
    let layers = match g.get(&pattern_key) {
        Some(Value::Array(items)) => {
            let flags: Option<Vec<bool>> = items.iter().map(Value::as_bool).collect();
            match flags {
                Some(f) if f.len() == n_layer => f,
                _ => return Err(Error::UnsupportedModel(format!("{pattern_key}: expected {n_layer} booleans"))),
            }
        }
        Some(v) => {
            let n = v.as_u64().ok_or(GgufError::WrongType { key: pattern_key.clone(), expected: "unsigned integer or array", found: v.type_name() })?;
            every_nth_global(n_layer, n)
        }
        None => every_nth_global(n_layer, pattern),
    };
    let rope_freq_base = opt(get_f32(g, &k(ArchKey::RopeFreqBaseSwa)))?.unwrap_or(rope.0);
    Ok(Some(SlidingWindow { window, layers, rope_freq_base, rope_scaled: rope.1 }))
}

/// llama.cpp's `set_swa_pattern`: every layer is a sliding-window one but each `n`-th (the
/// last of each group of `n`); `n = 0`: all of them.
fn every_nth_global(n_layer: usize, n: u64) -> Vec<bool> {
    (0..n_layer as u64).map(|l| n == 0 || l % n < n - 1).collect()
}

fn opt<T>(r: Result<T, GgufError>) -> Result<Option<T>, GgufError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(GgufError::MissingKey { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

impl LlamaConfig {
    pub fn from_gguf(g: &GgufFile) -> Result<Self, Error> {
        let arch_key = GeneralKey::Architecture.key();
        let arch = get(g, arch_key)?
            .as_str()
            .ok_or(GgufError::WrongType { key: arch_key.into(), expected: "string", found: "other" })?
            .to_string();
        if !SUPPORTED_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(Error::UnsupportedModel(format!("architecture {arch:?} (supported: {})", SUPPORTED_ARCHITECTURES.join(", "))));
        }
        let k = |key: ArchKey| key.key(&arch);
        let n_embd = get_usize(g, &k(ArchKey::EmbeddingLength))?;
        let n_head = get_usize(g, &k(ArchKey::HeadCount))?;
        let n_kv_head = opt(get_usize(g, &k(ArchKey::HeadCountKv)))?.unwrap_or(n_head);
        if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 || n_embd % n_head != 0 {
            return Err(Error::UnsupportedModel(format!(
                "{n_head} heads / {n_kv_head} KV heads / embedding {n_embd} do not divide evenly"
            )));
        }
        let head_dim = opt(get_usize(g, &k(ArchKey::KeyLength)))?.unwrap_or(n_embd / n_head);
        let n_rot = opt(get_usize(g, &k(ArchKey::RopeDimensionCount)))?.unwrap_or(head_dim);
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(Error::UnsupportedModel(format!("rope dimension {n_rot} with head dimension {head_dim}")));
        }
        let n_vocab = match opt(get_usize(g, &k(ArchKey::VocabSize)))? {
            Some(v) => v,
            None => get(g, GeneralKey::TokenizerTokens.key())?.as_array().map_or(0, <[Value]>::len),
        };
        let freq_base = opt(get_f32(g, &k(ArchKey::RopeFreqBase)))?.unwrap_or(10000.0);
        let scaling_type = g.get(&k(ArchKey::RopeScalingType)).and_then(Value::as_str).unwrap_or("none");
        let factor = opt(get_f32(g, &k(ArchKey::RopeScalingFactor)))?.unwrap_or(1.0);
        let n_ctx_train = get_usize(g, &k(ArchKey::ContextLength))?;
        // llama.cpp's n_ctx_orig_yarn: the original context, else the training one.
        let original_context = opt(get_usize(g, &k(ArchKey::RopeScalingOriginalContext)))?.unwrap_or(n_ctx_train);
        let rope_scaling = if g.tensor_info(&TensorName::RopeFreqs.name()).is_some() {
            RopeScaling::FreqFactors
        } else {
            match scaling_type {
                "none" => RopeScaling::None,
                "linear" => RopeScaling::Linear { factor },
                "llama3" => RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: opt(get_f32(g, &k(ArchKey::RopeScalingLowFreqFactor)))?.unwrap_or(1.0),
                    high_freq_factor: opt(get_f32(g, &k(ArchKey::RopeScalingHighFreqFactor)))?.unwrap_or(4.0),
                    original_context: opt(get_f32(g, &k(ArchKey::RopeScalingOriginalContext)))?.unwrap_or(8192.0),
                },
                "yarn" => RopeScaling::Yarn {
                    factor,
                    original_context,
                    beta_fast: opt(get_f32(g, &k(ArchKey::RopeScalingYarnBetaFast)))?.unwrap_or(32.0),
                    beta_slow: opt(get_f32(g, &k(ArchKey::RopeScalingYarnBetaSlow)))?.unwrap_or(1.0),
                    log_mul: opt(get_f32(g, &k(ArchKey::RopeScalingYarnLogMul)))?.unwrap_or(0.0),
                },
                "longrope" => RopeScaling::LongRope { original_context },
                other => return Err(Error::UnsupportedModel(format!("rope scaling type {other:?}"))),
            }
        };
        let n_layer = get_usize(g, &k(ArchKey::BlockCount))?;
        let (gemma2, gemma) = (arch == "gemma2", arch.starts_with("gemma"));
        // llama.cpp's defaults: Gemma 2 caps attention scores at 50 and logits at 30.
        let attn_logit_softcap = opt(get_f32(g, &k(ArchKey::AttnLogitSoftcapping)))?.or(gemma2.then_some(50.0)).filter(|&c| c != 0.0);
        if attn_logit_softcap.is_some() && !gemma2 {
            return Err(Error::UnsupportedModel(format!("{arch}.attn_logit_softcapping: attention soft-capping is Gemma 2's, not {arch}'s")));
        }
        let final_logit_softcap = opt(get_f32(g, &k(ArchKey::FinalLogitSoftcapping)))?.or(gemma2.then_some(30.0)).filter(|&c| c != 0.0);
        for cap in [attn_logit_softcap, final_logit_softcap].into_iter().flatten() {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(Error::UnsupportedModel(format!("soft-cap {cap} (must be a finite number > 0)")));
            }
        }
        let sliding_window = match arch.as_str() {
            "gemma2" => sliding_window(g, &arch, n_layer, 4096, 2, (freq_base, true))?,
            // Gemma 3 without the key has no window (llama.cpp's default 0).
            "gemma3" => sliding_window(g, &arch, n_layer, 0, 6, (10000.0, false))?,
            _ => None,
        };
        // llama.cpp (after gemma_pytorch): 1/sqrt(n_embd / n_head) for the 27B models (46
        // layers of Gemma 2, 62 of Gemma 3), 1/sqrt(head_dim) for the others, which is the
        // kernels' own scale.
        let big = (gemma2 && n_layer == 46) || (arch == "gemma3" && n_layer == 62);
        let q_prescale = if big { ((head_dim as f32) / (n_embd / n_head) as f32).sqrt() } else { 1.0 };
        if matches!(rope_scaling, RopeScaling::Yarn { factor, .. } | RopeScaling::Linear { factor } if !(factor.is_finite() && factor > 0.0)) {
            return Err(Error::UnsupportedModel(format!("rope scaling factor {factor}")));
        }
        // Read by llama.cpp for mistral3 only (and Llama 4, which Duet does not load).
        let attn_temperature = match opt(get_f32(g, &k(ArchKey::AttnTemperatureScale)))? {
            Some(scale) if scale != 0.0 && arch == "mistral3" => {
                if original_context == 0 {
                    return Err(Error::UnsupportedModel("attention temperature with an original context of 0".into()));
                }
                Some(AttnTemperature { scale, floor: original_context })
            }
            _ => None,
        };
        let experts = match opt(get_usize(g, &k(ArchKey::ExpertCount)))?.filter(|&n| n > 0) {
            None if matches!(arch.as_str(), "qwen3moe" | "olmoe") => return Err(GgufError::MissingKey { key: k(ArchKey::ExpertCount) }.into()),
            None => None,
            Some(n_expert) => {
                let n_used = get_usize(g, &k(ArchKey::ExpertUsedCount))?;
                if n_used == 0 || n_used > n_expert {
                    return Err(Error::UnsupportedModel(format!("{n_used} experts used of {n_expert}")));
                }
                let n_ff = opt(get_usize(g, &k(ArchKey::ExpertFeedForwardLength)))?.map_or_else(|| get_usize(g, &k(ArchKey::FeedForwardLength)), Ok)?;
                // llama.cpp renormalises the chosen experts' weights for Mixtral and Qwen3-MoE, not OLMoE.
                Some(Experts { n_expert, n_used, n_ff, norm_weights: arch != "olmoe" })
            }
        };
        if experts.is_some() && !matches!(arch.as_str(), "llama" | "qwen3moe" | "olmoe") {
            return Err(Error::UnsupportedModel(format!("{arch} with mixture-of-experts layers")));
        }
        Ok(LlamaConfig {
            experts,
            n_layer,
            n_ff: get_usize(g, &k(ArchKey::FeedForwardLength))?,
            n_ctx_train,
            rope_attn_factor: opt(get_f32(g, &k(ArchKey::RopeScalingAttnFactor)))?.unwrap_or(1.0),
            attn_temperature,
            rms_eps: opt(get_f32(g, &k(ArchKey::RmsEpsilon)))?.unwrap_or(1e-5),
            rope_freq_base: freq_base,
            rope_neox: NEOX_ROPE.contains(&arch.as_str()),
            embedding_scale: if gemma { (n_embd as f32).sqrt() } else { 1.0 },
            q_prescale,
            ffn_act: if gemma { FfnAct::Gelu } else { FfnAct::Silu },
            post_norms: gemma,
            sliding_window,
            attn_logit_softcap,
            final_logit_softcap,
            arch,
            n_embd,
            n_head,
            n_kv_head,
            head_dim,
            n_rot,
            n_vocab,
            rope_scaling,
        })
    }

    /// The sliding window of `layer`, if it is a sliding-window layer.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.as_ref().filter(|s| s.layers.get(layer).copied().unwrap_or(false)).map(|s| s.window)
    }

    /// Width of the K (and V) projection output.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    /// Width of the Q projection output.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// The model's KV shape, in the arena layout's 32-bit fields.
    pub fn kv_shape(&self) -> Result<KvShape, Error> {
        let field = |name: &str, v: usize| u32::try_from(v).map_err(|_| Error::UnsupportedModel(format!("{name} {v} does not fit 32 bits")));
        Ok(KvShape { n_layer: field("n_layer", self.n_layer)?, n_kv_head: field("n_kv_head", self.n_kv_head)?, head_dim: field("head_dim", self.head_dim)? })
    }
}
