//! What the kernel twin tests share: random valid weight rows, random activations with a
//! magnitude per block, the row lengths they are tried at.

// Each test binary uses its own part of these.
#![allow(dead_code)]

use duet_kernels::dot::quantize_row;
use duet_kernels::quant::GgmlType;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, RngCore};

/// Random rows tried per row length.
pub const ROWS_PER_SIZE: usize = 6;

/// Row lengths: multiples of the block size with odd block counts (and odd lengths for the
/// float types, whose "block" is one element).
pub fn sizes(ty: GgmlType) -> Vec<usize> {
    match ty.block_size() {
        1 => vec![1, 7, 33, 255, 1031],
        b => [1, 7, 33, 3].iter().map(|k| k * b).collect(),
    }
}

pub fn random_f16(rng: &mut StdRng) -> f16 {
    if rng.random_bool(0.03) {
        return f16::ZERO;
    }
    let m = 2f32.powf(rng.random_range(-16.0..2.0));
    f16::from_f32(if rng.random_bool(0.5) { m } else { -m })
}

/// Random f32 activations: each block of 32 has its own magnitude (1e-3 .. 1e3); some blocks
/// are all zero, some values are outliers, signs are mixed.
pub fn random_acts(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n);
    while x.len() < n {
        let zero = rng.random_bool(0.08);
        let scale = 10f32.powf(rng.random_range(-3.0..3.0));
        for _ in 0..32.min(n - x.len()) {
            let mut v = rng.random_range(-1.0f32..1.0) * scale;
            if rng.random_bool(0.02) {
                v *= 40.0;
            }
            x.push(if zero { 0.0 } else { v });
        }
    }
    x
}

/// A random valid weight row of `n` elements of type `ty`.
pub fn random_weight_row(rng: &mut StdRng, ty: GgmlType, n: usize) -> Vec<u8> {
    match ty {
        GgmlType::F32 => random_acts(rng, n).iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => random_acts(rng, n).iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect(),
        GgmlType::BF16 => random_acts(rng, n).iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect(),
        _ => {
            let mut bytes = vec![0u8; ty.row_bytes(n)];
            rng.fill_bytes(&mut bytes);
            for b in bytes.chunks_exact_mut(ty.block_bytes()) {
                for &off in ty.f16_field_offsets() {
                    b[off..off + 2].copy_from_slice(&random_f16(rng).to_le_bytes());
                }
            }
            bytes
        }
    }
}

pub fn quantized(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; ty.row_bytes(x.len())];
    quantize_row(ty, x, &mut out);
    out
}
