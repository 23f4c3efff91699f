//! The tensors of a Llama-shaped GGUF model (llama, mistral, qwen2, qwen3), looked up once and checked against the
//! hyper-parameters, for every device: weight matrices by name, type and shape (each device
//! reads or uploads their bytes itself), norm vectors dequantised to f32, and the RoPE
//! frequencies. Also the checks every device makes on a batch before it starts.

use duet_kernels::ops::{llama3_freq_factors, Rope};
use duet_kernels::quant::{dequantize, GgmlType};
use duet_model::config::{FfnAct, LlamaConfig, RopeScaling};
use duet_model::experts::ExpertTensors;
use duet_model::gguf::{GgufError, GgufFile};
use duet_model::names::TensorName;

use crate::error::{Result, GpuWorkerError};

/// A weight matrix: the tensor's name in the file and its checked shape (`rows` outputs of
/// `cols` inputs each), starting at row `first_row` of the tensor (not 0 for a part of a fused
/// matrix: Phi-3's K is rows q_dim.. of `attn_qkv`).
#[derive(Debug, Clone)]
pub struct Weight {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub first_row: usize,
}

impl Weight {
    /// Its bytes in the tensor's data.
    pub fn bytes<'a>(&self, tensor_data: &'a [u8]) -> &'a [u8] {
        let rb = self.ty.row_bytes(self.cols);
        &tensor_data[self.first_row * rb..(self.first_row + self.rows) * rb]
    }

    /// A name unique among the model's matrices (the tensor's, with the first row of a part).
    pub fn key(&self) -> String {
        if self.first_row == 0 {
            self.name.clone()
        } else {
            format!("{}@{}", self.name, self.first_row)
        }
    }

    /// Rows `first..first + rows` of this matrix.
    fn part(&self, first: usize, rows: usize) -> Weight {
        Weight { name: self.name.clone(), ty: self.ty, rows, cols: self.cols, first_row: self.first_row + first }
    }
}

/// One transformer block's tensors.
#[derive(Debug)]
pub struct LayerTensors {
    pub attn_norm: Vec<f32>,
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
    /// Q/K/V biases, added after the projections (Qwen 2).
    pub qkv_bias: Option<[Vec<f32>; 3]>,
    /// Per-head RMSNorm weights of Q and K, applied before RoPE (Qwen 3).
    pub qk_norm: Option<[Vec<f32>; 2]>,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
    /// RMSNorm weights of the attention output and of the MLP output, applied before each
    /// residual add (Gemma).
    pub post_norms: Option<[Vec<f32>; 2]>,
}

/// A layer's MLP.
#[derive(Debug)]
pub enum Ffn {
    /// `down(act(gate(x)) * up(x))`.
    Dense { gate: Weight, up: Weight, down: Weight },
    /// A mixture of experts: the router (`n_expert` rows); the experts themselves are the
    /// model's [`ExpertTensors`].
    Moe { router: Weight },
}

impl Ffn {
    /// Every matrix of the MLP but the experts.
    pub fn weights(&self) -> Vec<&Weight> {
        match self {
            Ffn::Dense { gate, up, down } => vec![gate, up, down],
            Ffn::Moe { router } => vec![router],
        }
    }
}

/// Every tensor of the forward pass, checked.
#[derive(Debug)]
pub struct ModelTensors {
    pub config: LlamaConfig,
    pub token_embd: Weight,
    /// The LM head: `output.weight`, or the token embedding when the file ties them.
    pub output: Weight,
    pub output_norm: Vec<f32>,
    pub layers: Vec<LayerTensors>,
    /// The routed experts of a mixture-of-experts model.
    pub experts: Option<ExpertTensors>,
    pub rope: Rope,
    /// RoPE of the sliding-window layers (their own base; Gemma 3's unscaled).
    pub rope_swa: Option<Rope>,
}

fn shape_err(name: &str, expected: String, found: String) -> GpuWorkerError {
    GpuWorkerError::Model(duet_model::Error::TensorShape { name: name.to_string(), expected, found })
}

/// Looks a matrix up and checks it is `cols` wide (ggml dim 0) and `rows` tall.
fn weight(file: &GgufFile, name: TensorName, cols: usize, rows: usize) -> Result<Weight> {
    let name = name.name();
    let info = file.tensor_info(&name).ok_or_else(|| GpuWorkerError::from(GgufError::MissingTensor(name.clone())))?;
    if info.dims != [cols as u64, rows as u64] {
        return Err(shape_err(&name, format!("[{cols}, {rows}]"), format!("{:?}", info.dims)));
    }
    Ok(Weight { name, ty: info.ty, rows, cols, first_row: 0 })
}

/// A 1-D tensor of `n` elements, dequantised to f32, when the file has it.
fn optional_vector(file: &GgufFile, name: TensorName, n: usize) -> Result<Option<Vec<f32>>> {
    if file.tensor_info(&name.name()).is_none() {
        return Ok(None);
    }
    vector(file, name, n).map(Some)
}

/// A group of optional tensors: all present, or none (a partial group is an error naming the
/// first one missing).
fn all_or_none<const N: usize>(file: &GgufFile, names: [(TensorName, usize); N]) -> Result<Option<[Vec<f32>; N]>> {
    let found: Vec<Option<Vec<f32>>> = names.iter().map(|&(name, n)| optional_vector(file, name, n)).collect::<Result<_>>()?;
    if found.iter().all(Option::is_none) {
        return Ok(None);
    }
    match found.iter().position(Option::is_none) {
        Some(i) => Err(GpuWorkerError::from(GgufError::MissingTensor(names[i].0.name()))),
        None => Ok(Some(std::array::from_fn(|i| found[i].clone().expect("all present")))),
    }
}

/// A 1-D tensor of `n` elements, dequantised to f32.
fn vector(file: &GgufFile, name: TensorName, n: usize) -> Result<Vec<f32>> {
    let name = name.name();
    let view = file.tensor(&name).map_err(|e| GpuWorkerError::Model(e.into()))?;
    if view.info.dims != [n as u64] {
        return Err(shape_err(&name, format!("[{n}]"), format!("{:?}", view.info.dims)));
    }
    let mut out = vec![0f32; n];
    dequantize(view.info.ty, view.data, &mut out).map_err(|e| shape_err(&name, "a dequantisable vector".into(), e.to_string()))?;
    Ok(out)
}

impl ModelTensors {
    /// Reads the hyper-parameters and checks every tensor the forward pass needs.
    pub fn load(f: &GgufFile) -> Result<Self> {
        let config = LlamaConfig::from_gguf(f)?;
        let c = &config;
        let token_embd = weight(f, TensorName::TokenEmbd, c.n_embd, c.n_vocab)?;
        let output = if f.tensor_info(&TensorName::Output.name()).is_some() {
            weight(f, TensorName::Output, c.n_embd, c.n_vocab)?
        } else {
            token_embd.clone()
        };
        let layers = (0..c.n_layer)
            .map(|l| {
                // Phi-3 fuses Q/K/V into one matrix and gate/up into another (gate first).
                let [wq, wk, wv] = if f.tensor_info(&TensorName::AttnQkv(l).name()).is_some() {
                    let qkv = weight(f, TensorName::AttnQkv(l), c.n_embd, c.q_dim() + 2 * c.kv_dim())?;
                    [qkv.part(0, c.q_dim()), qkv.part(c.q_dim(), c.kv_dim()), qkv.part(c.q_dim() + c.kv_dim(), c.kv_dim())]
                } else {
                    [
                        weight(f, TensorName::AttnQ(l), c.n_embd, c.q_dim())?,
                        weight(f, TensorName::AttnK(l), c.n_embd, c.kv_dim())?,
                        weight(f, TensorName::AttnV(l), c.n_embd, c.kv_dim())?,
                    ]
                };
                let ffn = match c.experts {
                    Some(e) => Ffn::Moe { router: weight(f, TensorName::FfnGateInp(l), c.n_embd, e.n_expert)? },
                    None if c.arch == "phi3" => {
                        let gate_up = weight(f, TensorName::FfnUp(l), c.n_embd, 2 * c.n_ff)?;
                        Ffn::Dense { gate: gate_up.part(0, c.n_ff), up: gate_up.part(c.n_ff, c.n_ff), down: weight(f, TensorName::FfnDown(l), c.n_ff, c.n_embd)? }
                    }
                    None => Ffn::Dense {
                        gate: weight(f, TensorName::FfnGate(l), c.n_embd, c.n_ff)?,
                        up: weight(f, TensorName::FfnUp(l), c.n_embd, c.n_ff)?,
                        down: weight(f, TensorName::FfnDown(l), c.n_ff, c.n_embd)?,
                    },
                };
                // Q/K norms per head (Qwen 3, Gemma 3) or over the whole row (OLMoE).
                let qk_norm_width = if c.arch == "olmoe" { [c.q_dim(), c.kv_dim()] } else { [c.head_dim, c.head_dim] };
                Ok(LayerTensors {
                    attn_norm: vector(f, TensorName::AttnNorm(l), c.n_embd)?,
                    wq,
                    wk,
                    wv,
                    wo: weight(f, TensorName::AttnOutput(l), c.q_dim(), c.n_embd)?,
                    qkv_bias: all_or_none(f, [(TensorName::AttnQBias(l), c.q_dim()), (TensorName::AttnKBias(l), c.kv_dim()), (TensorName::AttnVBias(l), c.kv_dim())])?,
                    qk_norm: all_or_none(f, [(TensorName::AttnQNorm(l), qk_norm_width[0]), (TensorName::AttnKNorm(l), qk_norm_width[1])])?,
                    ffn_norm: vector(f, TensorName::FfnNorm(l), c.n_embd)?,
                    ffn,
                    post_norms: all_or_none(f, [(TensorName::AttnPostNorm(l), c.n_embd), (TensorName::FfnPostNorm(l), c.n_embd)])?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // Biases the forward pass does not add would give wrong logits silently: refuse them.
        for bias in ["attn_output.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias", "attn_qkv.bias"] {
            let name = format!("blk.0.{bias}");
            if f.tensor_info(&name).is_some() {
                return Err(GpuWorkerError::Model(duet_model::Error::UnsupportedModel(format!("tensor {name}: this bias is not supported yet"))));
            }
        }
        // LongRoPE's divisors unused would be wrong angles: they come with its scaling type.
        if !matches!(c.rope_scaling, RopeScaling::LongRope { .. }) {
            if let Some(t) = [TensorName::RopeFactorsLong, TensorName::RopeFactorsShort].into_iter().find(|t| f.tensor_info(&t.name()).is_some()) {
                return Err(GpuWorkerError::Model(duet_model::Error::UnsupportedModel(format!(
                    "{}: LongRoPE divisors without rope.scaling.type = longrope",
                    t.name()
                ))));
            }
        }
        if matches!(c.arch.as_str(), "qwen3" | "gemma3" | "qwen3moe" | "olmoe") && layers.iter().any(|l| l.qk_norm.is_none()) {
            return Err(GpuWorkerError::from(GgufError::MissingTensor(TensorName::AttnQNorm(0).name())));
        }
        // The norms the architecture applies, and no others (unapplied ones would be wrong logits).
        if let Some(l) = layers.iter().position(|l| l.post_norms.is_some() != c.post_norms) {
            let name = TensorName::AttnPostNorm(l).name();
            return Err(GpuWorkerError::Model(match c.post_norms {
                true => GgufError::MissingTensor(name).into(),
                false => duet_model::Error::UnsupportedModel(format!("tensor {name}: post-attention norms are not part of {}", c.arch)),
            }));
        }
        let (freq_scale, factors) = match c.rope_scaling {
            RopeScaling::None => (1.0, None),
            RopeScaling::Linear { factor } => (1.0 / factor, None),
            RopeScaling::FreqFactors => (1.0, Some(vector(f, TensorName::RopeFreqs, c.n_rot / 2)?)),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_context } => (
                1.0,
                Some(llama3_freq_factors(c.n_rot, c.rope_freq_base, factor, low_freq_factor, high_freq_factor, original_context)),
            ),
            RopeScaling::Yarn { factor, .. } => (1.0 / factor, None),
            // Duet serves the whole trained context: the long divisors when it exceeds the
            // original one (llama.cpp's choice for a context that long).
            RopeScaling::LongRope { original_context } => {
                let which = if c.n_ctx_train > original_context { TensorName::RopeFactorsLong } else { TensorName::RopeFactorsShort };
                (1.0, Some(vector(f, which, c.n_rot / 2)?))
            }
        };
        let rope_magnitude = rope_magnitude(c);
        let rope_swa = c.sliding_window.as_ref().map(|s| match s.rope_scaled {
            true => Rope::new(c.n_rot, s.rope_freq_base, freq_scale, factors.clone()),
            false => Rope::new(c.n_rot, s.rope_freq_base, 1.0, None),
        });
        let mut rope = Rope::new(c.n_rot, c.rope_freq_base, freq_scale, factors).with_mscale(rope_magnitude);
        if let RopeScaling::Yarn { original_context, beta_fast, beta_slow, .. } = c.rope_scaling {
            rope = rope.with_yarn(1.0, original_context, c.rope_freq_base, beta_fast, beta_slow);
        }
        let output_norm = vector(f, TensorName::OutputNorm, c.n_embd)?;
        let experts = ExpertTensors::find(f, &config)?;
        Ok(ModelTensors { config, token_embd, output, output_norm, layers, experts, rope, rope_swa })
    }

    /// The RoPE of `layer`.
    pub fn rope_of(&self, layer: usize) -> &Rope {
        match &self.rope_swa {
            Some(r) if self.config.window(layer).is_some() => r,
            _ => &self.rope,
        }
    }

    /// What the plain Llama block lacks that this model uses (Q/K/V biases, Q/K norms, NeoX
    /// RoPE, Gemma's parts), for a device that does not implement them yet to refuse the
    /// model by name.
    pub fn extensions(&self) -> Vec<&'static str> {
        let c = &self.config;
        let mut out = Vec::new();
        if c.embedding_scale != 1.0 {
            out.push("embedding scale");
        }
        if c.q_prescale != 1.0 {
            out.push("attention scale");
        }
        if c.ffn_act != FfnAct::Silu {
            out.push("GeGLU");
        }
        if c.post_norms {
            out.push("post-attention and post-MLP norms");
        }
        if c.sliding_window.is_some() {
            out.push("sliding-window attention");
        }
        if c.attn_logit_softcap.is_some() {
            out.push("attention soft-capping");
        }
        if c.attn_temperature.is_some() {
            out.push("attention temperature");
        }
        if c.experts.is_some() {
            out.push("mixture-of-experts MLPs");
        }
        if c.final_logit_softcap.is_some() {
            out.push("logit soft-capping");
        }
        if self.layers.iter().any(|l| l.qkv_bias.is_some()) {
            out.push("Q/K/V biases");
        }
        if self.layers.iter().any(|l| l.qk_norm.is_some()) {
            out.push("Q/K RMSNorm");
        }
        if self.config.rope_neox {
            out.push("NeoX RoPE");
        }
        if self.weights().any(|w| w.first_row != 0) {
            out.push("fused Q/K/V and gate/up matrices");
        }
        out
    }

    /// Whether a device holding `layers` (of a model split across devices) reads tensor
    /// `name`: a layer's tensors where it holds the layer, the embedding where it holds the
    /// first (or the last, when the LM head is tied to it), the LM head and the output norm
    /// where it holds the last, and every tensor of no layer.
    pub fn tensor_in(&self, name: &str, layers: &std::ops::Range<usize>) -> bool {
        let last = layers.end == self.config.n_layer;
        if let Some(l) = name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|l| l.parse::<usize>().ok()) {
            return layers.contains(&l);
        }
        if name == self.token_embd.name {
            return layers.start == 0 || (last && name == self.output.name);
        }
        if name == self.output.name || name.starts_with("output_norm.") {
            return last;
        }
        true
    }

    /// Bytes of the weight matrices a device holding `layers` reads (see [`Self::tensor_in`]).
    pub fn weight_bytes(&self, file: &GgufFile, layers: &std::ops::Range<usize>) -> usize {
        let bytes = |w: &Weight| file.tensor(&w.name).map_or(0, |t| w.bytes(t.data).len());
        self.weights().filter(|w| self.tensor_in(&w.name, layers)).map(bytes).sum()
    }

    /// The most first layers whose weights fit in `budget` bytes beside `fixed` bytes of
    /// workspace and `room(n)` bytes the first `n` layers keep for more (the hot experts'
    /// slots) (the embedding counted; the LM head too when every layer fits): `n_layer`
    /// when the whole model fits, 0 when not even one layer does.
    pub fn first_layers_within(&self, file: &GgufFile, budget: usize, fixed: usize, room: impl Fn(usize) -> usize) -> usize {
        (1..=self.config.n_layer).rev().find(|&n| self.weight_bytes(file, &(0..n)) + fixed + room(n) <= budget).unwrap_or(0)
    }

    /// Every weight matrix, each once (a tied LM head is the embedding; the parts of a fused
    /// matrix each).
    pub fn weights(&self) -> impl Iterator<Item = &Weight> {
        let tied = self.output.name == self.token_embd.name;
        std::iter::once(&self.token_embd)
            .chain((!tied).then_some(&self.output))
            .chain(self.layers.iter().flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo].into_iter().chain(l.ffn.weights())))
    }
}

/// The factor RoPE's cos and sin are multiplied by: llama.cpp's `yarn_attn_factor` (YaRN's
/// magnitude correction, divided by the `1 + 0.1 ln(factor)` its kernel multiplies back in)
/// times `rope.scaling.attn_factor`, with llama.cpp's f32 operations.
fn rope_magnitude(c: &LlamaConfig) -> f32 {
    let mut m = 1.0f32;
    if let RopeScaling::Yarn { factor: key, log_mul, .. } = c.rope_scaling {
        let factor = 1.0 / (1.0 / key);
        let mscale = |scale: f32, m: f32| if scale <= 1.0 { 1.0 } else { (0.1 * m).mul_add(scale.ln(), 1.0) };
        m = if log_mul != 0.0 { mscale(factor, 1.0) / mscale(factor, log_mul) } else { mscale(factor, 1.0) };
        m *= 1.0 / 0.1f32.mul_add(factor.ln(), 1.0);
    }
    m * c.rope_attn_factor
}

/// Checks a batch — `tokens[i]` at position `positions[i]`, logits of `logit_rows` — as
/// every device must before starting it.
pub fn check_batch(config: &LlamaConfig, tokens: &[u32], positions: &[usize], logit_rows: &[usize]) -> Result<()> {
    let n = tokens.len();
    if n == 0 || positions.len() != n {
        return Err(GpuWorkerError::InvalidRequest(format!("a batch of {n} tokens with {} positions", positions.len())));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= config.n_vocab) {
        return Err(GpuWorkerError::Model(duet_model::Error::TokenOutOfRange { id: bad, n_vocab: config.n_vocab }));
    }
    check_logit_rows(logit_rows, n)
}

/// Checks a batch of hidden rows (`[row][n_embd]`) at `positions` that a device goes on
/// with from another's layers (a model split across devices).
pub fn check_hidden(config: &LlamaConfig, hidden: &[f32], positions: &[usize], logit_rows: &[usize]) -> Result<()> {
    let n = positions.len();
    if n == 0 || hidden.len() != n * config.n_embd {
        return Err(GpuWorkerError::InvalidRequest(format!("{} hidden values for {n} rows of {}", hidden.len(), config.n_embd)));
    }
    check_logit_rows(logit_rows, n)
}

fn check_logit_rows(logit_rows: &[usize], n: usize) -> Result<()> {
    match logit_rows.iter().find(|&&r| r >= n) {
        Some(&bad) => Err(GpuWorkerError::InvalidRequest(format!("logits of row {bad} of a batch of {n}"))),
        None => Ok(()),
    }
}
