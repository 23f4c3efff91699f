//! The one layer loop over any [`Device`]: one batch layer by layer (the runner, a plain
//! step), or several sub-batches whose layers interleave so that the device runs one
//! sub-batch's linear layers while the cpu-workers attend another's (an overlapped step).
//! Where attention happens — K/V stored, jobs posted, the device's own share, the merge — is
//! the caller's [`LayerAttention`].

use std::collections::VecDeque;

use crate::device::{Device, NoRemoteExperts, Qkv};
use crate::error::GpuWorkerError;

/// A layer's attention for one (sub-)batch, in two halves so that sub-batches interleave:
/// [`LayerAttention::begin`] stores the new K/V rows and starts whatever others compute,
/// [`LayerAttention::finish`] computes the device's own share and merges everything into
/// `out` (`[row][n_head][head_dim]`).
pub trait LayerAttention<D: Device + ?Sized> {
    /// A begun layer, to be finished.
    type Begun;
    type Error: From<GpuWorkerError>;

    /// Layer `layer` of sub-batch `sub` wholly on the device ([`Device::layer_on_device`]),
    /// where this attention's owner allows it; `false`: the layer goes the usual way.
    fn on_device(&mut self, _device: &D, _sub: usize, _layer: usize, _batch: &mut D::Batch) -> Result<bool, Self::Error> {
        Ok(false)
    }
    fn begin(&mut self, device: &D, sub: usize, layer: usize, qkv: &Qkv) -> Result<Self::Begun, Self::Error>;
    /// `qkv` is the sub-batch's of [`LayerAttention::begin`].
    fn finish(&mut self, device: &D, sub: usize, layer: usize, begun: Self::Begun, qkv: &Qkv, out: &mut [f32]) -> Result<(), Self::Error>;
    /// The rest of the layer on the device ([`Device::finish_layer`]), with the routed
    /// experts it does not hold computed wherever this attention's owner sends them (by
    /// default nowhere: the device holds them all).
    fn finish_layer(&mut self, device: &D, layer: usize, batch: &mut D::Batch, attn: &[f32]) -> Result<(), Self::Error> {
        Ok(device.finish_layer(layer, batch, attn, &mut NoRemoteExperts)?)
    }
}

/// Runs `batches` (sub-batch `i` is `batches[i]`) through every layer of `device`. With one
/// batch each layer is begun and finished in turn; with two, per layer l: begin A(l), finish
/// B(l-1), begin B(l), finish A(l) — each sub-batch's layer finished before its next begins,
/// and each row computing exactly what it would alone.
pub fn run_layers<D: Device + ?Sized, A: LayerAttention<D>>(device: &D, batches: &mut [D::Batch], attention: &mut A) -> Result<(), A::Error> {
    let k = batches.len();
    // Begun layers, oldest first, with their queries, keys and values (stored by then).
    let mut begun: VecDeque<(usize, usize, A::Begun, Qkv)> = VecDeque::with_capacity(k);
    for layer in 0..device.config().n_layer {
        // One batch: the layer wholly on the device where it can.
        if k == 1 && attention.on_device(device, 0, layer, &mut batches[0])? {
            continue;
        }
        for sub in 0..k {
            let qkv = device.qkv(layer, &mut batches[sub])?;
            let b = attention.begin(device, sub, layer, &qkv)?;
            begun.push_back((sub, layer, b, qkv));
            while begun.len() >= k {
                finish_oldest(device, batches, attention, &mut begun)?;
            }
        }
    }
    while !begun.is_empty() {
        finish_oldest(device, batches, attention, &mut begun)?;
    }
    Ok(())
}

fn finish_oldest<D: Device + ?Sized, A: LayerAttention<D>>(
    device: &D,
    batches: &mut [D::Batch],
    attention: &mut A,
    begun: &mut VecDeque<(usize, usize, A::Begun, Qkv)>,
) -> Result<(), A::Error> {
    let Some((sub, layer, b, qkv)) = begun.pop_front() else { return Ok(()) };
    let mut out = vec![0f32; qkv.q.len()];
    attention.finish(device, sub, layer, b, &qkv, &mut out)?;
    attention.finish_layer(device, layer, &mut batches[sub], &out)?;
    Ok(())
}
