//! The device `--device` picked, as one type: each [`Device`] call goes to the CPU or the
//! CUDA device, or to a model split between one of them and the CPU device (`--gpu-layers`)
//! (candle's `Storage` enum is the model), so the runner, the executor and the service are
//! built once, over [`AnyDevice`].

use duet_model::config::LlamaConfig;
use duet_proto::pb;

use super::cpu::{CpuBatch, CpuDevice};
use super::cuda::{CudaBatch, CudaDevice};
use super::split::{SplitBatch, SplitDevice};
use super::{DecodeItem, Device, HostMapping, KvSink, KvUploadTime, KvSource, KvStore, Partial, PrefillItem, Qkv, RemoteExperts};
use crate::error::{Result, GpuWorkerError};

/// The CPU or the CUDA device, or the first layers on either and the rest on the CPU.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per process: its size does not matter
pub enum AnyDevice {
    Cpu(CpuDevice),
    Cuda(CudaDevice),
    Split(Box<SplitDevice<AnyDevice, CpuDevice>>),
}

/// A batch of whichever device started it.
pub enum AnyBatch {
    Cpu(CpuBatch),
    Cuda(CudaBatch),
    Split(Box<SplitBatch<AnyBatch, CpuBatch>>),
}

fn foreign_batch() -> GpuWorkerError {
    GpuWorkerError::InvalidRequest("a batch started on another device".into())
}

/// Forwards a per-batch call to the device that owns the batch.
macro_rules! on_batch {
    ($self:ident, $batch:expr, $d:ident, $b:ident => $call:expr) => {
        match ($self, $batch) {
            (AnyDevice::Cpu($d), AnyBatch::Cpu($b)) => $call,
            (AnyDevice::Cuda($d), AnyBatch::Cuda($b)) => $call,
            (AnyDevice::Split($d), AnyBatch::Split($b)) => $call,
            _ => Err(foreign_batch()),
        }
    };
}

/// Forwards a call that involves no batch.
macro_rules! on_device {
    ($self:ident, $d:ident => $call:expr) => {
        match $self {
            AnyDevice::Cpu($d) => $call,
            AnyDevice::Cuda($d) => $call,
            AnyDevice::Split($d) => $call,
        }
    };
}

impl Device for AnyDevice {
    type Batch = AnyBatch;

    fn kind(&self) -> pb::DeviceKind {
        on_device!(self, d => d.kind())
    }

    fn describe(&self) -> String {
        on_device!(self, d => d.describe())
    }

    fn config(&self) -> &LlamaConfig {
        on_device!(self, d => d.config())
    }

    fn prefill_chunk(&self) -> usize {
        on_device!(self, d => d.prefill_chunk())
    }

    fn host_layers(&self) -> usize {
        on_device!(self, d => d.host_layers())
    }

    fn gpu_kv_positions(&self) -> usize {
        on_device!(self, d => d.gpu_kv_positions())
    }

    fn phase_times(&self) -> Vec<(&'static str, u64)> {
        on_device!(self, d => d.phase_times())
    }

    fn take_attention_ns(&self) -> Result<Option<u64>> {
        on_device!(self, d => d.take_attention_ns())
    }

    fn take_kv_upload_time(&self) -> Result<KvUploadTime> {
        on_device!(self, d => d.take_kv_upload_time())
    }

    fn holds_all_experts(&self) -> bool {
        on_device!(self, d => d.holds_all_experts())
    }

    fn take_expert_usage(&self) -> Vec<super::expert_usage::RoutedTokens> {
        on_device!(self, d => d.take_expert_usage())
    }

    fn place_experts(&mut self, held: &[Vec<usize>]) -> Result<usize> {
        match self {
            AnyDevice::Cpu(d) => d.place_experts(held),
            AnyDevice::Cuda(d) => d.place_experts(held),
            AnyDevice::Split(d) => d.place_experts(held),
        }
    }

    fn begin_step(&self, step: &[(u64, usize)]) {
        on_device!(self, d => d.begin_step(step))
    }

    fn release(&self, keys: &[u64]) {
        on_device!(self, d => d.release(keys))
    }

    fn start_batch(&self, tokens: &[u32], positions: &[usize], logit_rows: &[usize]) -> Result<AnyBatch> {
        match self {
            AnyDevice::Cpu(d) => d.start_batch(tokens, positions, logit_rows).map(AnyBatch::Cpu),
            AnyDevice::Cuda(d) => d.start_batch(tokens, positions, logit_rows).map(AnyBatch::Cuda),
            AnyDevice::Split(d) => d.start_batch(tokens, positions, logit_rows).map(|b| AnyBatch::Split(Box::new(b))),
        }
    }

    fn layers(&self) -> std::ops::Range<usize> {
        on_device!(self, d => d.layers())
    }

    fn hidden(&self, batch: &AnyBatch) -> Result<Vec<f32>> {
        on_batch!(self, batch, d, b => d.hidden(b))
    }

    fn resume_batch(&self, hidden: Vec<f32>, positions: &[usize], logit_rows: &[usize]) -> Result<AnyBatch> {
        match self {
            AnyDevice::Cpu(d) => d.resume_batch(hidden, positions, logit_rows).map(AnyBatch::Cpu),
            AnyDevice::Cuda(d) => d.resume_batch(hidden, positions, logit_rows).map(AnyBatch::Cuda),
            AnyDevice::Split(d) => d.resume_batch(hidden, positions, logit_rows).map(|b| AnyBatch::Split(Box::new(b))),
        }
    }

    fn qkv(&self, layer: usize, batch: &mut AnyBatch) -> Result<Qkv> {
        on_batch!(self, batch, d, b => d.qkv(layer, b))
    }

    fn store_kv(&self, layer: usize, qkv: &Qkv, kv: &mut dyn KvSink) -> Result<()> {
        on_device!(self, d => d.store_kv(layer, qkv, kv))
    }

    fn prefill_attention(&self, layer: usize, qkv: &Qkv, items: &[PrefillItem], kv: &dyn KvSource, out: &mut [f32]) -> Result<()> {
        on_device!(self, d => d.prefill_attention(layer, qkv, items, kv, out))
    }

    fn decode_attention(&self, layer: usize, qkv: &Qkv, items: &[DecodeItem], kv: &dyn KvSource) -> Result<Vec<Partial>> {
        on_device!(self, d => d.decode_attention(layer, qkv, items, kv))
    }

    fn finish_layer(&self, layer: usize, batch: &mut AnyBatch, attn: &[f32], remote: &mut dyn RemoteExperts) -> Result<()> {
        on_batch!(self, batch, d, b => d.finish_layer(layer, b, attn, remote))
    }

    unsafe fn map_host(&self, ptr: *mut u8, len: usize) -> Option<HostMapping> {
        // SAFETY: the caller's promise, passed on.
        on_device!(self, d => unsafe { d.map_host(ptr, len) })
    }

    fn layer_on_device(&self, layer: usize, batch: &mut AnyBatch, items: &[PrefillItem], kv: &mut dyn KvStore, remote: &mut dyn RemoteExperts) -> Result<bool> {
        on_batch!(self, batch, d, b => d.layer_on_device(layer, b, items, kv, remote))
    }

    fn logits(&self, batch: &AnyBatch) -> Result<Vec<f32>> {
        on_batch!(self, batch, d, b => d.logits(b))
    }

    fn greedy_tokens(&self, batch: &AnyBatch) -> Result<Option<Vec<u32>>> {
        on_batch!(self, batch, d, b => d.greedy_tokens(b))
    }
}
