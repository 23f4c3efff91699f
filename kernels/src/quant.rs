//! ggml tensor types: block layouts and scalar dequantisation, bit-exact with ggml's reference.
//!
//! Blocks are `repr(C)` structs of byte arrays (alignment 1), so any byte slice of the right
//! length can be viewed as blocks without copying or alignment concerns.

use std::fmt;

use half::f16;

/// Elements per super-block of the k-quants.
pub const QK_K: usize = 256;

/// ggml tensor type ids as stored in GGUF.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    BF16,
}

impl GgmlType {
    /// Byte offsets of the f16 fields (scales, mins) of one block: random test weights set
    /// them to finite values and leave the rest random quants. None for the float types.
    pub fn f16_field_offsets(self) -> &'static [usize] {
        match self {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            _ => &[],
        }
    }

    /// Every type a weight tensor may have (what Q4_K_M / Q5_K_M files use and the floats);
    /// the activation-only types (Q8_1, Q8_K) are not among them.
    pub const WEIGHT_TYPES: [GgmlType; 11] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// The type with this GGUF id, if ggml defines it and Duet knows it.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            9 => Self::Q8_1,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q8_1 => 9,
            Self::Q2K => 10,
            Self::Q3K => 11,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Q8K => 15,
            Self::BF16 => 30,
        }
    }

    /// Types Duet can load as weights (dequantise and dot with).
    pub fn is_storage_type(self) -> bool {
        !matches!(self, Self::Q8_1 | Self::Q2K | Self::Q3K | Self::Q8K)
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 | Self::Q8_1 => 32,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K | Self::Q8K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q8_1 => 36,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::Q8K => 292,
        }
    }

    /// Bytes of a row of `n` elements (`n` a multiple of the block size).
    pub fn row_bytes(self, n: usize) -> usize {
        n / self.block_size() * self.block_bytes()
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q8_1 => "Q8_1",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::Q8K => "Q8_K",
            Self::BF16 => "BF16",
        };
        f.write_str(s)
    }
}

#[inline(always)]
pub(crate) fn f16_bytes(b: [u8; 2]) -> f32 {
    f16::from_le_bytes(b).to_f32()
}

/// A block type made only of byte arrays: every byte pattern is valid and alignment is 1.
///
/// # Safety
/// Implementors must be `repr(C)`, contain only `u8` arrays, and have size `BYTES`.
pub unsafe trait ByteBlock: Sized {
    const BYTES: usize;

    /// Views `bytes` as blocks; `None` when the length is not a whole number of blocks.
    fn slice(bytes: &[u8]) -> Option<&[Self]> {
        if !bytes.len().is_multiple_of(Self::BYTES) {
            return None;
        }
        // SAFETY: alignment 1, every bit pattern valid, length checked (trait contract).
        Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / Self::BYTES) })
    }

    fn slice_mut(bytes: &mut [u8]) -> Option<&mut [Self]> {
        if !bytes.len().is_multiple_of(Self::BYTES) {
            return None;
        }
        // SAFETY: as above.
        Some(unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast(), bytes.len() / Self::BYTES) })
    }
}

macro_rules! byte_block {
    ($(#[$doc:meta])* $name:ident, $bytes:expr, { $($field:ident : $n:expr),* $(,)? }) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug)]
        pub struct $name { $(pub $field: [u8; $n]),* }
        const _: () = assert!(std::mem::size_of::<$name>() == $bytes);
        // SAFETY: repr(C) of u8 arrays, size asserted above.
        unsafe impl ByteBlock for $name { const BYTES: usize = $bytes; }
    };
}

byte_block!(/// 32 weights: `x = (q - 8) * d`.
    BlockQ4_0, 18, { d: 2, qs: 16 });
byte_block!(/// 32 weights: `x = q * d + m`.
    BlockQ4_1, 20, { d: 2, m: 2, qs: 16 });
byte_block!(/// 32 weights with a fifth bit in `qh`: `x = (q - 16) * d`.
    BlockQ5_0, 22, { d: 2, qh: 4, qs: 16 });
byte_block!(/// 32 weights with a fifth bit in `qh`: `x = q * d + m`.
    BlockQ5_1, 24, { d: 2, m: 2, qh: 4, qs: 16 });
byte_block!(/// 32 weights: `x = q * d` (also the activation format for Q4_0/Q5_0/Q8_0).
    BlockQ8_0, 34, { d: 2, qs: 32 });
byte_block!(/// 32 activations: `x = q * d`, with `s = d * sum(q)` (for Q4_1/Q5_1).
    BlockQ8_1, 36, { d: 2, s: 2, qs: 32 });
byte_block!(/// 256 weights in 8 sub-blocks of 32 with 6-bit scales and mins.
    BlockQ4K, 144, { d: 2, dmin: 2, scales: 12, qs: 128 });
byte_block!(/// 256 weights in 8 sub-blocks of 32 with 6-bit scales and mins and a fifth bit.
    BlockQ5K, 176, { d: 2, dmin: 2, scales: 12, qh: 32, qs: 128 });
byte_block!(/// 256 weights in 16 sub-blocks of 16, 6 bits each, 8-bit scales.
    BlockQ6K, 210, { ql: 128, qh: 64, scales: 16, d: 2 });

byte_block!(/// 256 activations for the k-quant dot products (ggml's `block_q8_K`): f32 `d`,
    /// 256 i8 quants, 16 i16 sums of 16 quants each.
    BlockQ8K, 292, { d: 4, qs: 256, bsums: 32 });

impl BlockQ8K {
    pub fn scale(&self) -> f32 {
        f32::from_le_bytes(self.d)
    }
    pub fn bsum(&self, j: usize) -> i32 {
        i16::from_le_bytes([self.bsums[2 * j], self.bsums[2 * j + 1]]) as i32
    }
}

/// Scale and min of sub-block `j` of a Q4_K/Q5_K block (ggml's `get_scale_min_k4`).
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Why a row cannot be dequantised.
#[derive(Debug, thiserror::Error)]
pub enum DequantError {
    #[error("{ty} row of {bytes} bytes does not hold {n} elements")]
    Length { ty: GgmlType, bytes: usize, n: usize },
    #[error("{0} is not a weight storage type")]
    NotStorage(GgmlType),
}

/// Dequantises one row (or any whole number of blocks) of `ty` into `out`.
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    let n = out.len();
    if !n.is_multiple_of(ty.block_size()) || src.len() != ty.row_bytes(n) {
        return Err(DequantError::Length { ty, bytes: src.len(), n });
    }
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16_bytes([c[0], c[1]]);
            }
        }
        GgmlType::BF16 => {
            // ggml's GGML_BF16_TO_FP32 is a plain shift; `half` would set the quiet bit of a
            // signalling NaN, so its conversion is not bit-exact with ggml for those.
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        GgmlType::Q4_0 => blocks::<BlockQ4_0>(src, out, 32, dequant_q4_0),
        GgmlType::Q4_1 => blocks::<BlockQ4_1>(src, out, 32, dequant_q4_1),
        GgmlType::Q5_0 => blocks::<BlockQ5_0>(src, out, 32, dequant_q5_0),
        GgmlType::Q5_1 => blocks::<BlockQ5_1>(src, out, 32, dequant_q5_1),
        GgmlType::Q8_0 => blocks::<BlockQ8_0>(src, out, 32, dequant_q8_0),
        GgmlType::Q4K => blocks::<BlockQ4K>(src, out, QK_K, dequant_q4_k),
        GgmlType::Q5K => blocks::<BlockQ5K>(src, out, QK_K, dequant_q5_k),
        GgmlType::Q6K => blocks::<BlockQ6K>(src, out, QK_K, dequant_q6_k),
        GgmlType::Q8_1 | GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q8K => {
            return Err(DequantError::NotStorage(ty));
        }
    }
    Ok(())
}

fn blocks<B: ByteBlock>(src: &[u8], out: &mut [f32], qk: usize, f: fn(&B, &mut [f32])) {
    let blocks = B::slice(src).expect("length checked by dequantize");
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(qk)) {
        f(b, o);
    }
}

pub fn dequant_q4_0(b: &BlockQ4_0, y: &mut [f32]) {
    let d = f16_bytes(b.d);
    for j in 0..16 {
        y[j] = ((b.qs[j] & 0xF) as i32 - 8) as f32 * d;
        y[j + 16] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

pub fn dequant_q4_1(b: &BlockQ4_1, y: &mut [f32]) {
    let (d, m) = (f16_bytes(b.d), f16_bytes(b.m));
    for j in 0..16 {
        y[j] = (b.qs[j] & 0xF) as f32 * d + m;
        y[j + 16] = (b.qs[j] >> 4) as f32 * d + m;
    }
}

/// The 5-bit quants of a Q5_0/Q5_1 block, unsigned (0..32), in element order.
#[inline(always)]
pub fn q5_values(qh: [u8; 4], qs: &[u8; 16]) -> [u8; 32] {
    let qh = u32::from_le_bytes(qh);
    let mut v = [0u8; 32];
    for j in 0..16 {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        v[j] = (qs[j] & 0xF) | h0;
        v[j + 16] = (qs[j] >> 4) | h1;
    }
    v
}

pub fn dequant_q5_0(b: &BlockQ5_0, y: &mut [f32]) {
    let d = f16_bytes(b.d);
    for (o, q) in y.iter_mut().zip(q5_values(b.qh, &b.qs)) {
        *o = (q as i32 - 16) as f32 * d;
    }
}

pub fn dequant_q5_1(b: &BlockQ5_1, y: &mut [f32]) {
    let (d, m) = (f16_bytes(b.d), f16_bytes(b.m));
    for (o, q) in y.iter_mut().zip(q5_values(b.qh, &b.qs)) {
        *o = q as f32 * d + m;
    }
}

pub fn dequant_q8_0(b: &BlockQ8_0, y: &mut [f32]) {
    let d = f16_bytes(b.d);
    for (o, &q) in y.iter_mut().zip(&b.qs) {
        *o = q as i8 as f32 * d;
    }
}

pub fn dequant_q4_k(b: &BlockQ4K, y: &mut [f32]) {
    let (d, min) = (f16_bytes(b.d), f16_bytes(b.dmin));
    for (j, (q, out)) in b.qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * j, &b.scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, &b.scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        for l in 0..32 {
            out[l] = d1 * (q[l] & 0xF) as f32 - m1;
            out[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

pub fn dequant_q5_k(b: &BlockQ5K, y: &mut [f32]) {
    let (d, min) = (f16_bytes(b.d), f16_bytes(b.dmin));
    for (j, (ql, out)) in b.qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * j, &b.scales);
        let (sc2, m2) = scale_min_k4(2 * j + 1, &b.scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
        for l in 0..32 {
            let h1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
            out[l] = d1 * ((ql[l] & 0xF) + h1) as f32 - m1;
            out[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

/// The signed 6-bit quants (-32..32) of a Q6_K block in element order.
#[inline(always)]
pub fn q6k_values(b: &BlockQ6K) -> [i8; QK_K] {
    let mut v = [0i8; QK_K];
    for n in 0..2 {
        let (ql, qh) = (&b.ql[64 * n..64 * n + 64], &b.qh[32 * n..32 * n + 32]);
        let out = &mut v[128 * n..128 * n + 128];
        for l in 0..32 {
            out[l] = ((ql[l] & 0xF) | (qh[l] & 3) << 4) as i8 - 32;
            out[l + 32] = ((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) as i8 - 32;
            out[l + 64] = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) as i8 - 32;
            out[l + 96] = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) as i8 - 32;
        }
    }
    v
}

pub fn dequant_q6_k(b: &BlockQ6K, y: &mut [f32]) {
    let d = f16_bytes(b.d);
    for (i, (o, q)) in y.iter_mut().zip(q6k_values(b)).enumerate() {
        *o = d * (b.scales[i / 16] as i8) as f32 * q as f32;
    }
}
