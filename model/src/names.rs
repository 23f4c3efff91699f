//! GGUF metadata keys and tensor names, from enums and one formatter each: model code never
//! spells a key or tensor name as a string literal.

/// Architecture-scoped hyper-parameter keys (`{arch}.{suffix}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArchKey {
    ContextLength,
    EmbeddingLength,
    BlockCount,
    FeedForwardLength,
    HeadCount,
    HeadCountKv,
    KeyLength,
    RopeDimensionCount,
    RopeFreqBase,
    RmsEpsilon,
    RopeScalingType,
    RopeScalingFactor,
    RopeScalingOriginalContext,
    RopeScalingLowFreqFactor,
    RopeScalingHighFreqFactor,
    RopeScalingAttnFactor,
    RopeScalingYarnBetaFast,
    RopeScalingYarnBetaSlow,
    RopeScalingYarnLogMul,
    AttnTemperatureScale,
    ExpertCount,
    ExpertUsedCount,
    ExpertFeedForwardLength,
    VocabSize,
    SlidingWindow,
    SlidingWindowPattern,
    RopeFreqBaseSwa,
    FinalLogitSoftcapping,
    AttnLogitSoftcapping,
}

impl ArchKey {
    pub fn key(self, arch: &str) -> String {
        let suffix = match self {
            Self::ContextLength => "context_length",
            Self::EmbeddingLength => "embedding_length",
            Self::BlockCount => "block_count",
            Self::FeedForwardLength => "feed_forward_length",
            Self::HeadCount => "attention.head_count",
            Self::HeadCountKv => "attention.head_count_kv",
            Self::KeyLength => "attention.key_length",
            Self::RopeDimensionCount => "rope.dimension_count",
            Self::RopeFreqBase => "rope.freq_base",
            Self::RmsEpsilon => "attention.layer_norm_rms_epsilon",
            Self::RopeScalingType => "rope.scaling.type",
            Self::RopeScalingFactor => "rope.scaling.factor",
            Self::RopeScalingOriginalContext => "rope.scaling.original_context_length",
            Self::RopeScalingLowFreqFactor => "rope.scaling.low_freq_factor",
            Self::RopeScalingHighFreqFactor => "rope.scaling.high_freq_factor",
            Self::RopeScalingAttnFactor => "rope.scaling.attn_factor",
            Self::RopeScalingYarnBetaFast => "rope.scaling.yarn_beta_fast",
            Self::RopeScalingYarnBetaSlow => "rope.scaling.yarn_beta_slow",
            Self::RopeScalingYarnLogMul => "rope.scaling.yarn_log_multiplier",
            Self::AttnTemperatureScale => "attention.temperature_scale",
            Self::ExpertCount => "expert_count",
            Self::ExpertUsedCount => "expert_used_count",
            Self::ExpertFeedForwardLength => "expert_feed_forward_length",
            Self::VocabSize => "vocab_size",
            Self::SlidingWindow => "attention.sliding_window",
            Self::SlidingWindowPattern => "attention.sliding_window_pattern",
            Self::RopeFreqBaseSwa => "rope.freq_base_swa",
            Self::FinalLogitSoftcapping => "final_logit_softcapping",
            Self::AttnLogitSoftcapping => "attn_logit_softcapping",
        };
        format!("{arch}.{suffix}")
    }
}

/// Keys outside any architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GeneralKey {
    Architecture,
    Name,
    TokenizerModel,
    TokenizerPre,
    TokenizerTokens,
    TokenizerTokenType,
    TokenizerMerges,
    TokenizerScores,
    TokenizerAddSpacePrefix,
    TokenizerBos,
    TokenizerEos,
    TokenizerEot,
    TokenizerAddBos,
    TokenizerAddEos,
    ChatTemplate,
}

impl GeneralKey {
    pub fn key(self) -> &'static str {
        match self {
            Self::Architecture => "general.architecture",
            Self::Name => "general.name",
            Self::TokenizerModel => "tokenizer.ggml.model",
            Self::TokenizerPre => "tokenizer.ggml.pre",
            Self::TokenizerTokens => "tokenizer.ggml.tokens",
            Self::TokenizerTokenType => "tokenizer.ggml.token_type",
            Self::TokenizerMerges => "tokenizer.ggml.merges",
            Self::TokenizerScores => "tokenizer.ggml.scores",
            Self::TokenizerAddSpacePrefix => "tokenizer.ggml.add_space_prefix",
            Self::TokenizerBos => "tokenizer.ggml.bos_token_id",
            Self::TokenizerEos => "tokenizer.ggml.eos_token_id",
            Self::TokenizerEot => "tokenizer.ggml.eot_token_id",
            Self::TokenizerAddBos => "tokenizer.ggml.add_bos_token",
            Self::TokenizerAddEos => "tokenizer.ggml.add_eos_token",
            Self::ChatTemplate => "tokenizer.chat_template",
        }
    }
}

/// Tensor names of a Llama-family model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorName {
    TokenEmbd,
    OutputNorm,
    Output,
    RopeFreqs,
    AttnNorm(usize),
    AttnQ(usize),
    AttnK(usize),
    AttnV(usize),
    AttnOutput(usize),
    /// Q, K and V in one matrix (Phi-3).
    AttnQkv(usize),
    /// Phi-3.x's LongRoPE frequency divisors.
    RopeFactorsLong,
    RopeFactorsShort,
    /// Q/K/V biases (Qwen 2).
    AttnQBias(usize),
    AttnKBias(usize),
    AttnVBias(usize),
    /// Per-head Q/K RMSNorm weights (Qwen 3).
    AttnQNorm(usize),
    AttnKNorm(usize),
    FfnNorm(usize),
    FfnGate(usize),
    FfnUp(usize),
    FfnDown(usize),
    AttnPostNorm(usize),
    FfnPostNorm(usize),
    FfnGateInp(usize),
    FfnGateExps(usize),
    FfnUpExps(usize),
    FfnDownExps(usize),
}

impl TensorName {
    pub fn name(self) -> String {
        let layer = |l: usize, s: &str| format!("blk.{l}.{s}.weight");
        match self {
            Self::TokenEmbd => "token_embd.weight".into(),
            Self::OutputNorm => "output_norm.weight".into(),
            Self::Output => "output.weight".into(),
            Self::RopeFreqs => "rope_freqs.weight".into(),
            Self::AttnNorm(l) => layer(l, "attn_norm"),
            Self::AttnQ(l) => layer(l, "attn_q"),
            Self::AttnK(l) => layer(l, "attn_k"),
            Self::AttnV(l) => layer(l, "attn_v"),
            Self::AttnOutput(l) => layer(l, "attn_output"),
            Self::AttnQkv(l) => layer(l, "attn_qkv"),
            Self::RopeFactorsLong => "rope_factors_long.weight".into(),
            Self::RopeFactorsShort => "rope_factors_short.weight".into(),
            Self::AttnQBias(l) => format!("blk.{l}.attn_q.bias"),
            Self::AttnKBias(l) => format!("blk.{l}.attn_k.bias"),
            Self::AttnVBias(l) => format!("blk.{l}.attn_v.bias"),
            Self::AttnQNorm(l) => layer(l, "attn_q_norm"),
            Self::AttnKNorm(l) => layer(l, "attn_k_norm"),
            Self::FfnNorm(l) => layer(l, "ffn_norm"),
            Self::FfnGate(l) => layer(l, "ffn_gate"),
            Self::FfnUp(l) => layer(l, "ffn_up"),
            Self::FfnDown(l) => layer(l, "ffn_down"),
            Self::AttnPostNorm(l) => layer(l, "post_attention_norm"),
            Self::FfnPostNorm(l) => layer(l, "post_ffw_norm"),
            Self::FfnGateInp(l) => layer(l, "ffn_gate_inp"),
            Self::FfnGateExps(l) => layer(l, "ffn_gate_exps"),
            Self::FfnUpExps(l) => layer(l, "ffn_up_exps"),
            Self::FfnDownExps(l) => layer(l, "ffn_down_exps"),
        }
    }
}
