//! Random valid ggml rows for the CUDA kernels' host checks: random bytes, with each block's
//! f16 scales set to finite values in ±0.05 (zero, now and then).

use duet_kernels::quant::GgmlType;
use half::f16;
use rand::Rng;

/// A random row of `cols` values of the quantised type `ty`.
pub fn random_row(ty: GgmlType, cols: usize, rng: &mut impl Rng) -> Vec<u8> {
    let mut row: Vec<u8> = (0..ty.row_bytes(cols)).map(|_| rng.random()).collect();
    let block = ty.row_bytes(ty.block_size());
    for b in row.chunks_exact_mut(block) {
        for &off in ty.f16_field_offsets() {
            let v = if rng.random_range(0..8) == 0 { 0.0 } else { rng.random_range(-0.05f32..0.05) };
            b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
    }
    row
}
