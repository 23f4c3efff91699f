//! Built-in machine and model presets of the simulator: GPUs (memory, bandwidth, FLOP/s,
//! host link), CPU sockets, model shapes and weight formats, with the public spec values
//! they come from.

use clap::ValueEnum;
use serde::Serialize;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
const GB: f64 = 1e9;

/// A GPU the simulator knows (`--gpu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuPreset {
    /// NVIDIA T4: 16 GB GDDR6, 320 GB/s, 65 TFLOP/s fp16 (tensor), PCIe 3.0 x16.
    T4,
    /// NVIDIA A10: 24 GB GDDR6, 600 GB/s, 125 TFLOP/s fp16 (tensor), PCIe 4.0 x16.
    A10,
    /// NVIDIA H100 PCIe: 80 GB HBM2e, 2.0 TB/s, 756 TFLOP/s dense fp16, PCIe 5.0 x16.
    H100,
    /// NVIDIA H100 SXM: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense fp16, PCIe 5.0 x16 host link.
    H100Sxm,
}

/// What the simulator needs to know about a GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuSpec {
    pub name: String,
    /// Memory the driver reports (nvidia-smi's total), bytes.
    pub mem_bytes: f64,
    /// Peak memory bandwidth, bytes/s.
    pub bandwidth: f64,
    /// Peak dense fp16 tensor FLOP/s.
    pub flops: f64,
    /// Effective host-link bandwidth (pinned memory, one direction), bytes/s.
    pub pcie: f64,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Compute capability 8.0 or later: decode batches of a few dozen rows multiply the
    /// quantised weights on the integer tensor cores (the CUDA device's `mmq_*` kernels)
    /// instead of dequantising them for cuBLAS.
    pub int8_mma: bool,
}

impl GpuPreset {
    /// The preset's spec. Sources: NVIDIA's data sheets (T4, A10, H100; multiprocessors: 40,
    /// 72, 114 and 132); memory is what
    /// nvidia-smi reports (T4 15360 MiB, A10 23028 MiB, H100 81559 MiB); host-link values
    /// are measured-typical pinned copies, about 75–80% of the PCIe line rate
    /// (3.0 x16 15.8 GB/s, 4.0 x16 31.5 GB/s, 5.0 x16 63 GB/s). Compute capabilities: T4 7.5,
    /// A10 8.6, H100 9.0.
    pub fn spec(self) -> GpuSpec {
        let (name, mib, gbs, tflops, pcie_gbs, sms, int8_mma) = match self {
            GpuPreset::T4 => ("T4", 15360.0, 320.0, 65.0, 12.0, 40, false),
            GpuPreset::A10 => ("A10", 23028.0, 600.0, 125.0, 25.0, 72, true),
            GpuPreset::H100 => ("H100 PCIe", 81559.0, 2000.0, 756.0, 50.0, 114, true),
            GpuPreset::H100Sxm => ("H100 SXM", 81559.0, 3350.0, 989.0, 50.0, 132, true),
        };
        GpuSpec {
            name: name.to_string(),
            mem_bytes: mib * 1024.0 * 1024.0,
            bandwidth: gbs * GB,
            flops: tflops * 1e12,
            pcie: pcie_gbs * GB,
            sms,
            int8_mma,
        }
    }
}

/// The host: one cpu-worker per socket (NUMA node), each reading the KV in its own node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CpuSpec {
    pub sockets: u32,
    /// Peak memory bandwidth of one socket, bytes/s (e.g. 8 channels of DDR4-3200: 205 GB/s;
    /// 6 channels of DDR4-2933: 141 GB/s; 12 channels of DDR5-4800: 461 GB/s).
    pub socket_bandwidth: f64,
    /// Cores of one socket that run attention.
    pub cores: u32,
    /// Effective attention FLOP/s of one core (f16 KV widened to f32, FMA).
    pub core_flops: f64,
    /// KV arena bytes of one socket (the host memory Duet may pin for KV).
    pub kv_bytes: f64,
}

impl CpuSpec {
    pub fn new(sockets: u32, socket_bandwidth_gbs: f64, cores: u32, core_gflops: f64, kv_gib: f64) -> CpuSpec {
        CpuSpec {
            sockets,
            socket_bandwidth: socket_bandwidth_gbs * GB,
            cores,
            core_flops: core_gflops * 1e9,
            kv_bytes: kv_gib * GIB,
        }
    }
}

/// A model the simulator knows (`--model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelPreset {
    /// Llama-3.1-8B: 32 layers, 32 heads, 8 KV heads (GQA), untied 128256-token vocabulary.
    #[value(name = "llama-3.1-8b")]
    Llama31_8b,
    /// Llama-2-7B: 32 layers, 32 heads, 32 KV heads (no GQA), 32000-token vocabulary.
    #[value(name = "llama-2-7b")]
    Llama2_7b,
    /// Llama-3.2-1B (the model of seed 000's experiments): 16 layers, 8 KV heads, tied.
    #[value(name = "llama-3.2-1b")]
    Llama32_1b,
    /// SmolLM2-135M (Duet's default test model): 30 layers, 9 heads, 3 KV heads, tied.
    #[value(name = "smollm2-135m")]
    Smollm2_135m,
}

/// The shape of a decoder-only transformer (Llama family), from its `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelShape {
    pub name: String,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub vocab: usize,
    /// The output projection is the embedding matrix.
    pub tied_embeddings: bool,
    /// The context the model was trained for (`max_position_embeddings`).
    pub max_context: usize,
}

impl ModelPreset {
    pub fn shape(self) -> ModelShape {
        #[allow(clippy::type_complexity)]
        let (name, n_layer, n_head, n_kv_head, head_dim, hidden, ffn, vocab, tied, max_context): (&str, usize, usize, usize, usize, usize, usize, usize, bool, usize) =
            match self {
                ModelPreset::Llama31_8b => ("Llama-3.1-8B", 32, 32, 8, 128, 4096, 14336, 128256, false, 131072),
                ModelPreset::Llama2_7b => ("Llama-2-7B", 32, 32, 32, 128, 4096, 11008, 32000, false, 4096),
                ModelPreset::Llama32_1b => ("Llama-3.2-1B", 16, 32, 8, 64, 2048, 8192, 128256, true, 131072),
                ModelPreset::Smollm2_135m => ("SmolLM2-135M", 30, 9, 3, 64, 576, 1536, 49152, true, 8192),
            };
        ModelShape { name: name.to_string(), n_layer, n_head, n_kv_head, head_dim, hidden, ffn, vocab, tied_embeddings: tied, max_context }
    }
}

impl ModelShape {
    /// Parameters of one layer's projections (q, k, v, o) and MLP (gate, up, down).
    pub fn layer_params(&self) -> f64 {
        let q_o = 2 * self.hidden * self.n_head * self.head_dim;
        let k_v = 2 * self.hidden * self.n_kv_head * self.head_dim;
        let mlp = 3 * self.hidden * self.ffn;
        (q_o + k_v + mlp) as f64
    }

    /// Parameters every decode step multiplies by: all layers plus the output projection
    /// (the embedding lookup reads only the batch's rows).
    pub fn linear_params(&self) -> f64 {
        self.n_layer as f64 * self.layer_params() + (self.vocab * self.hidden) as f64
    }

    /// All parameters held in GPU memory (norm weights are negligible and left out).
    pub fn total_params(&self) -> f64 {
        let embed = (self.vocab * self.hidden) as f64;
        self.n_layer as f64 * self.layer_params() + if self.tied_embeddings { embed } else { 2.0 * embed }
    }

    /// KV bytes of one position, all layers: 2 (K and V) · layers · KV heads · head dim · dtype.
    pub fn kv_bytes_per_pos(&self, kv_dtype_bytes: f64) -> f64 {
        2.0 * (self.n_layer * self.n_kv_head * self.head_dim) as f64 * kv_dtype_bytes
    }

    /// Decode attention FLOPs of one KV position, all layers: q·k and p·v for every query head.
    pub fn attn_flops_per_pos(&self) -> f64 {
        4.0 * (self.n_layer * self.n_head * self.head_dim) as f64
    }

    /// Bytes that cross the host link per decode token whose attention (some of it) runs on
    /// the cpu-workers, all layers: q (f16) and the new K and V rows (f16) to the host, the
    /// partial output (f32) and its log-sum-exp per head (f32) back.
    pub fn host_link_bytes_per_token(&self) -> f64 {
        let per_layer = 2 * self.n_head * self.head_dim + 2 * 2 * self.n_kv_head * self.head_dim + 4 * self.n_head * self.head_dim + 4 * self.n_head;
        (self.n_layer * per_layer) as f64
    }
}

/// How the weights are stored on the GPU (`--weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WeightDtype {
    /// 16-bit floats: 2 bytes per parameter.
    Fp16,
    /// 8-bit with an f16 scale per 32 weights (like Q8_0): 8.5 bits per parameter.
    Int8,
    /// 4-bit with an f16 scale per 32 weights (like Q4_0): 4.5 bits per parameter.
    Int4,
}

impl WeightDtype {
    pub fn bytes_per_param(self) -> f64 {
        match self {
            WeightDtype::Fp16 => 2.0,
            WeightDtype::Int8 => 8.5 / 8.0,
            WeightDtype::Int4 => 4.5 / 8.0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::Fp16 => "fp16",
            WeightDtype::Int8 => "int8",
            WeightDtype::Int4 => "int4",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_the_published_sizes() {
        let l3 = ModelPreset::Llama31_8b.shape();
        assert!((l3.total_params() / 1e9 - 8.03).abs() < 0.01, "{}", l3.total_params());
        let l2 = ModelPreset::Llama2_7b.shape();
        assert!((l2.total_params() / 1e9 - 6.74).abs() < 0.01, "{}", l2.total_params());
        let l1 = ModelPreset::Llama32_1b.shape();
        assert!((l1.total_params() / 1e9 - 1.24).abs() < 0.01, "{}", l1.total_params());
        let smol = ModelPreset::Smollm2_135m.shape();
        assert!((smol.total_params() / 1e6 - 134.5).abs() < 0.5, "{}", smol.total_params());
    }

    #[test]
    fn kv_bytes_per_position() {
        assert_eq!(ModelPreset::Llama31_8b.shape().kv_bytes_per_pos(2.0), 131072.0);
        assert_eq!(ModelPreset::Llama2_7b.shape().kv_bytes_per_pos(2.0), 524288.0);
        assert_eq!(ModelPreset::Smollm2_135m.shape().kv_bytes_per_pos(2.0), 23040.0);
        assert_eq!(ModelPreset::Llama32_1b.shape().kv_bytes_per_pos(2.0), 32768.0);
    }
}
