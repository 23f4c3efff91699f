//! A model split across two devices by layers (`--gpu-layers N`, llama.cpp's `-ngl`): the
//! head device (the GPU) embeds the tokens and computes layers `0..N`, then hands each
//! batch's hidden rows to the tail device (the CPU device), which computes layers `N..` and
//! the logits. For dense models larger than the GPU: the layers that do not fit run on the
//! host. Attention calls go to the device of their layer; K/V are stored, and attention runs,
//! wherever the caller says, as for one device.
//!
//! Each row is computed as on one device: a split over two CPU devices gives the same logits
//! bit for bit as one (`tests/split_layers.rs`).

use std::ops::Range;

use duet_model::config::LlamaConfig;
use duet_proto::pb;

use super::expert_usage::RoutedTokens;
use super::{DecodeItem, Device, HostMapping, KvSink, KvUploadTime, KvSource, KvStore, Partial, PrefillItem, Qkv, RemoteExperts};
use crate::error::{GpuWorkerError, Result};

/// Layers `0..N` on `head`, `N..` on `tail`.
#[derive(Debug)]
pub struct SplitDevice<H, T> {
    head: H,
    tail: T,
}

/// A batch of a split model: on the head device until its first layer of the tail's, then
/// on the tail.
pub struct SplitBatch<HB, TB> {
    on: Side<HB, TB>,
    positions: Vec<usize>,
    logit_rows: Vec<usize>,
}

enum Side<HB, TB> {
    Head(HB),
    Tail(TB),
}

impl<H: Device, T: Device> SplitDevice<H, T> {
    /// Checks that `head` holds layers `0..N` and `tail` the rest, of the same model.
    pub fn new(head: H, tail: T) -> Result<Self> {
        let (h, t) = (head.layers(), tail.layers());
        let n_layer = head.config().n_layer;
        if h.start != 0 || h.end != t.start || t.end != n_layer || h.is_empty() || t.is_empty() || tail.config().n_layer != n_layer {
            return Err(GpuWorkerError::InvalidRequest(format!("a split of layers {h:?} and {t:?} of a model of {n_layer}")));
        }
        Ok(SplitDevice { head, tail })
    }

    /// The first layer of the tail device.
    pub fn boundary(&self) -> usize {
        self.head.layers().end
    }

    fn on_head(&self, layer: usize) -> bool {
        layer < self.boundary()
    }

    /// The batch on the device of `layer`: handed from the head to the tail at the boundary.
    fn side<'b>(&self, layer: usize, b: &'b mut SplitBatch<H::Batch, T::Batch>) -> Result<&'b mut Side<H::Batch, T::Batch>> {
        match (&b.on, self.on_head(layer)) {
            (Side::Head(_), true) | (Side::Tail(_), false) => {}
            (Side::Head(hb), false) => {
                let hidden = self.head.hidden(hb)?;
                b.on = Side::Tail(self.tail.resume_batch(hidden, &b.positions, &b.logit_rows)?);
            }
            (Side::Tail(_), true) => return Err(GpuWorkerError::InvalidRequest(format!("layer {layer} of a batch already past it"))),
        }
        Ok(&mut b.on)
    }
}

impl<H: Device, T: Device> Device for SplitDevice<H, T> {
    type Batch = SplitBatch<H::Batch, T::Batch>;

    fn kind(&self) -> pb::DeviceKind {
        self.head.kind()
    }

    fn describe(&self) -> String {
        let n = self.boundary();
        format!("{} for layers 0..{n}, {} for layers {n}..{}", self.head.describe(), self.tail.describe(), self.config().n_layer)
    }

    fn config(&self) -> &LlamaConfig {
        self.head.config()
    }

    fn prefill_chunk(&self) -> usize {
        self.head.prefill_chunk().min(self.tail.prefill_chunk())
    }

    fn host_layers(&self) -> usize {
        self.head.host_layers() + self.tail.host_layers()
    }

    /// The head's mirror; the tail (the CPU device) attends on the host.
    fn gpu_kv_positions(&self) -> usize {
        self.head.gpu_kv_positions()
    }

    fn phase_times(&self) -> Vec<(&'static str, u64)> {
        self.head.phase_times()
    }

    fn take_attention_ns(&self) -> Result<Option<u64>> {
        self.head.take_attention_ns()
    }

    fn take_kv_upload_time(&self) -> Result<KvUploadTime> {
        self.head.take_kv_upload_time()
    }

    fn holds_all_experts(&self) -> bool {
        self.head.holds_all_experts() && self.tail.holds_all_experts()
    }

    fn take_expert_usage(&self) -> Vec<RoutedTokens> {
        let mut usage = self.head.take_expert_usage();
        usage.extend(self.tail.take_expert_usage());
        usage
    }

    fn place_experts(&mut self, held: &[Vec<usize>]) -> Result<usize> {
        let n = self.boundary();
        let part = |layers: Range<usize>| -> Vec<Vec<usize>> { held.iter().enumerate().map(|(l, e)| if layers.contains(&l) { e.clone() } else { Vec::new() }).collect() };
        let n_layer = self.config().n_layer;
        Ok(self.head.place_experts(&part(0..n))? + self.tail.place_experts(&part(n..n_layer))?)
    }

    fn begin_step(&self, step: &[(u64, usize)]) {
        self.head.begin_step(step);
        self.tail.begin_step(step);
    }

    fn release(&self, keys: &[u64]) {
        self.head.release(keys);
        self.tail.release(keys);
    }

    fn start_batch(&self, tokens: &[u32], positions: &[usize], logit_rows: &[usize]) -> Result<Self::Batch> {
        let hb = self.head.start_batch(tokens, positions, logit_rows)?;
        Ok(SplitBatch { on: Side::Head(hb), positions: positions.to_vec(), logit_rows: logit_rows.to_vec() })
    }

    fn hidden(&self, b: &Self::Batch) -> Result<Vec<f32>> {
        match &b.on {
            Side::Head(hb) => self.head.hidden(hb),
            Side::Tail(tb) => self.tail.hidden(tb),
        }
    }

    fn resume_batch(&self, hidden: Vec<f32>, positions: &[usize], logit_rows: &[usize]) -> Result<Self::Batch> {
        let hb = self.head.resume_batch(hidden, positions, logit_rows)?;
        Ok(SplitBatch { on: Side::Head(hb), positions: positions.to_vec(), logit_rows: logit_rows.to_vec() })
    }

    fn qkv(&self, layer: usize, b: &mut Self::Batch) -> Result<Qkv> {
        match self.side(layer, b)? {
            Side::Head(hb) => self.head.qkv(layer, hb),
            Side::Tail(tb) => self.tail.qkv(layer, tb),
        }
    }

    fn store_kv(&self, layer: usize, qkv: &Qkv, kv: &mut dyn KvSink) -> Result<()> {
        if self.on_head(layer) {
            self.head.store_kv(layer, qkv, kv)
        } else {
            self.tail.store_kv(layer, qkv, kv)
        }
    }

    fn prefill_attention(&self, layer: usize, qkv: &Qkv, items: &[PrefillItem], kv: &dyn KvSource, out: &mut [f32]) -> Result<()> {
        if self.on_head(layer) {
            self.head.prefill_attention(layer, qkv, items, kv, out)
        } else {
            self.tail.prefill_attention(layer, qkv, items, kv, out)
        }
    }

    fn decode_attention(&self, layer: usize, qkv: &Qkv, items: &[DecodeItem], kv: &dyn KvSource) -> Result<Vec<Partial>> {
        if self.on_head(layer) {
            self.head.decode_attention(layer, qkv, items, kv)
        } else {
            self.tail.decode_attention(layer, qkv, items, kv)
        }
    }

    fn finish_layer(&self, layer: usize, b: &mut Self::Batch, attn: &[f32], remote: &mut dyn RemoteExperts) -> Result<()> {
        match self.side(layer, b)? {
            Side::Head(hb) => self.head.finish_layer(layer, hb, attn, remote),
            Side::Tail(tb) => self.tail.finish_layer(layer, tb, attn, remote),
        }
    }

    /// The head's: the layers a device may run wholly (and so store K/V in place) are its.
    unsafe fn map_host(&self, ptr: *mut u8, len: usize) -> Option<HostMapping> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.head.map_host(ptr, len) }
    }

    fn layer_on_device(&self, layer: usize, b: &mut Self::Batch, items: &[PrefillItem], kv: &mut dyn KvStore, remote: &mut dyn RemoteExperts) -> Result<bool> {
        match self.side(layer, b)? {
            Side::Head(hb) => self.head.layer_on_device(layer, hb, items, kv, remote),
            Side::Tail(tb) => self.tail.layer_on_device(layer, tb, items, kv, remote),
        }
    }

    fn logits(&self, b: &Self::Batch) -> Result<Vec<f32>> {
        match &b.on {
            Side::Tail(tb) => self.tail.logits(tb),
            Side::Head(_) => Err(GpuWorkerError::InvalidRequest(format!("logits of a batch that has not reached layer {}", self.boundary()))),
        }
    }
}
