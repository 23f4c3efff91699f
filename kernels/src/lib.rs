//! CPU kernels: ggml block formats, activation quantisation, dot products, matrix products
//! and the element-wise ops of a Llama layer. The instruction set is chosen once, here.

pub mod attention;
#[cfg(target_arch = "x86_64")]
pub mod attention_avx2;
#[cfg(target_arch = "x86_64")]
pub mod attention_avx512;
#[cfg(target_arch = "x86_64")]
mod attention_rows;
pub mod causal;
pub mod decode_batch;
pub mod dot;
pub mod ggml_exact;
pub mod heap;
#[cfg(target_arch = "x86_64")]
pub mod blockdot_avx2;
#[cfg(target_arch = "x86_64")]
pub mod blockdot_avx512;
pub mod matmul;
pub mod mlp;
#[cfg(target_arch = "x86_64")]
pub mod matmul_avx512;
pub mod matmul_k_avx512;
#[cfg(target_arch = "x86_64")]
pub mod matvec_avx512;
pub mod interleaved;
pub mod ops;
pub mod packed_slab;
pub mod quant;
#[cfg(target_arch = "x86_64")]
pub mod quantize_avx512;
#[cfg(target_arch = "x86_64")]
mod simd_x86;

use std::sync::OnceLock;

pub use quant::GgmlType;

/// The SIMD level the kernels run at on this machine, lowest first: each level includes the
/// ones below it (an AVX-512 machine runs the AVX2 kernels where no AVX-512 one exists).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL/DQ on top of [`Isa::Avx2`].
    Avx512,
}

/// Detected once and logged. `DUET_ISA=scalar|avx2` caps it (for comparison runs and for
/// testing the lower levels on a bigger machine); `DUET_FORCE_SCALAR=1` is `DUET_ISA=scalar`.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let detected = detect_isa();
        let cap = isa_cap();
        let isa = detected.min(cap.unwrap_or(Isa::Avx512));
        tracing::info!(?isa, ?detected, capped = cap.is_some(), vnni = has_vnni(), "CPU kernels selected");
        isa
    })
}

/// The cap asked for by `DUET_ISA` / `DUET_FORCE_SCALAR`, if any (unknown values: no cap,
/// with a warning).
pub fn isa_cap() -> Option<Isa> {
    if std::env::var_os("DUET_FORCE_SCALAR").is_some_and(|v| v != "0") {
        return Some(Isa::Scalar);
    }
    match std::env::var("DUET_ISA").ok()?.to_ascii_lowercase().as_str() {
        "scalar" => Some(Isa::Scalar),
        "avx2" => Some(Isa::Avx2),
        "avx512" => Some(Isa::Avx512),
        other => {
            tracing::warn!(value = other, "DUET_ISA must be scalar, avx2 or avx512; ignored");
            None
        }
    }
}

/// Whether the AVX-512 kernels may use VNNI's `vpdpbusd`: detected once; `DUET_NO_VNNI=1`
/// turns it off (to test the `maddubs` + `madd` kernels that CPUs without VNNI run).
pub fn has_vnni() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        let detected = is_x86_feature_detected!("avx512vnni");
        #[cfg(not(target_arch = "x86_64"))]
        let detected = false;
        detected && std::env::var_os("DUET_NO_VNNI").is_none_or(|v| v == "0")
    })
}

#[cfg(target_arch = "x86_64")]
fn detect_isa() -> Isa {
    let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
    let avx512 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512dq");
    match (avx2, avx512) {
        (true, true) => Isa::Avx512,
        (true, false) => Isa::Avx2,
        _ => Isa::Scalar,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_isa() -> Isa {
    Isa::Scalar
}

/// `ggml_exact::dot_f16` of two `N`-element rows (a head of 64 or 128; `N` a multiple of 64),
/// in registers where AVX2 is present; bit-identical to it. (Decode attention calls the AVX2
/// kernel directly.)
pub fn dot_f16_head<const N: usize>(x: &[f32; N], y: &[f32; N]) -> f32 {
    const { assert!(N.is_multiple_of(64), "heads of whole 64-lane chunks") };
    #[cfg(target_arch = "x86_64")]
    if isa() >= Isa::Avx2 {
        // SAFETY: AVX2, FMA and F16C were detected.
        return unsafe { simd_x86::dot_f16_lanes(x, y) };
    }
    ggml_exact::dot_f16(x, y)
}

/// `ggml_exact::dot_tiled` of two `N`-element rows (`N` a multiple of 16), in registers where
/// AVX2 is present; bit-identical to it. (Decode attention calls the AVX2 kernel directly.)
pub fn dot_tiled_head<const N: usize>(x: &[f32; N], y: &[f32; N]) -> f32 {
    const { assert!(N.is_multiple_of(16), "heads of whole 16-lane chunks") };
    #[cfg(target_arch = "x86_64")]
    if isa() >= Isa::Avx2 {
        // SAFETY: AVX2, FMA and F16C were detected.
        return unsafe { simd_x86::dot_tiled_lanes(x, y) };
    }
    ggml_exact::dot_tiled(x, y)
}

/// `dst[i] = src[i]` widened from f16 (exact) for `i < min(len)`, eight lanes at a time
/// where F16C is present.
#[inline]
pub fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa() >= Isa::Avx2 {
        // SAFETY: F16C (with AVX2) was detected.
        unsafe { simd_x86::widen_f16(src, dst) };
        return;
    }
    widen_f16_scalar(src, dst);
}

/// The scalar twin of [`widen_f16`].
pub fn widen_f16_scalar(src: &[half::f16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// Q8_0 blocks (`src`, whole 34-byte blocks) dequantised to f32 as ggml does (`d · q`) into
/// `dst` (32 values per block): the KV cache's `--kv-type q8_0` rows.
pub fn widen_q8_0(src: &[u8], dst: &mut [f32]) {
    assert!(src.len().is_multiple_of(attention::Q8_0_BLOCK_BYTES) && dst.len() == src.len() / attention::Q8_0_BLOCK_BYTES * 32, "Q8_0 rows and their f32 sizes");
    #[cfg(target_arch = "x86_64")]
    if isa() >= Isa::Avx2 {
        // SAFETY: AVX2 and F16C were detected; the sizes were checked above.
        unsafe { simd_x86::widen_q8_0(src, dst) };
        return;
    }
    widen_q8_0_scalar(src, dst);
}

/// The scalar twin of [`widen_q8_0`] (panics on sizes that disagree).
pub fn widen_q8_0_scalar(src: &[u8], dst: &mut [f32]) {
    for (b, out) in src.chunks_exact(attention::Q8_0_BLOCK_BYTES).zip(dst.chunks_exact_mut(32)) {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        for (o, &q) in out.iter_mut().zip(&b[2..]) {
            *o = q as i8 as f32 * d;
        }
    }
}

/// Dot product of a weight row of type `ty` (`n` elements) with an activation row quantised
/// to `dot::vec_dot_type(ty)`, on the fastest kernel this machine has.
#[inline]
pub fn vec_dot(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 {
        // SAFETY: AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C were detected (VNNI where used);
        // block counts are checked by the slices.
        unsafe {
            match (ty, has_vnni()) {
                (GgmlType::Q4K, true) => return blockdot_avx512::dot_q4k_q8k_vnni(w, a),
                (GgmlType::Q4K, false) => return blockdot_avx512::dot_q4k_q8k(w, a),
                (GgmlType::Q5K, true) => return blockdot_avx512::dot_q5k_q8k_vnni(w, a),
                (GgmlType::Q5K, false) => return blockdot_avx512::dot_q5k_q8k(w, a),
                (GgmlType::Q6K, true) => return blockdot_avx512::dot_q6k_q8k_vnni(w, a),
                (GgmlType::Q6K, false) => return blockdot_avx512::dot_q6k_q8k(w, a),
                (GgmlType::Q5_0, true) => return blockdot_avx512::dot_q5_0_q8_0_vnni(w, a),
                (GgmlType::Q5_0, false) => return blockdot_avx512::dot_q5_0_q8_0(w, a),
                (GgmlType::Q5_1, true) => return blockdot_avx512::dot_q5_1_q8_1_vnni(w, a),
                (GgmlType::Q5_1, false) => return blockdot_avx512::dot_q5_1_q8_1(w, a),
                (GgmlType::F32, _) => return blockdot_avx512::dot_f32_f32(w, a),
                (GgmlType::F16, _) => return blockdot_avx512::dot_f16_f16(w, a),
                (GgmlType::BF16, _) => return blockdot_avx512::dot_bf16_bf16(w, a),
                _ => {}
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if isa() >= Isa::Avx2 {
        // SAFETY: AVX2, FMA and F16C were detected; block counts are checked by the slices.
        unsafe {
            match ty {
                GgmlType::Q4_0 => return simd_x86::dot_q4_0_q8_0(w, a),
                GgmlType::Q4_1 => return simd_x86::dot_q4_1_q8_1(w, a),
                GgmlType::Q8_0 => return simd_x86::dot_q8_0_q8_0(w, a),
                GgmlType::Q4K => return blockdot_avx2::dot_q4k_q8k(w, a),
                GgmlType::Q5K => return blockdot_avx2::dot_q5k_q8k(w, a),
                GgmlType::Q6K => return blockdot_avx2::dot_q6k_q8k(w, a),
                GgmlType::Q5_0 => return blockdot_avx2::dot_q5_0_q8_0(w, a),
                GgmlType::Q5_1 => return blockdot_avx2::dot_q5_1_q8_1(w, a),
                GgmlType::F32 => return blockdot_avx2::dot_f32_f32(w, a),
                GgmlType::F16 => return blockdot_avx2::dot_f16_f16(w, a),
                GgmlType::BF16 => return blockdot_avx2::dot_bf16_bf16(w, a),
                _ => {}
            }
        }
    }
    dot::vec_dot_scalar(ty, n, w, a)
}

/// Four activation rows against one weight row, bit-identical to four [`vec_dot`] calls (a
/// four-row kernel unpacks each weight block once where one exists for `ty`).
#[inline]
pub fn vec_dot_x4(ty: GgmlType, n: usize, w: &[u8], a: [&[u8]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if isa() >= Isa::Avx2 {
        // SAFETY: AVX2, FMA and F16C were detected; block counts are checked by the slices.
        unsafe {
            match ty {
                GgmlType::Q4_1 => return simd_x86::dot_q4_1_q8_1_x4(w, a),
                GgmlType::Q8_0 => return simd_x86::dot_q8_0_q8_0_x4(w, a),
                // AVX-512 machines take their own single-row kernels (and tiles for batches).
                GgmlType::Q4K if isa() == Isa::Avx2 => return blockdot_avx2::dot_q4k_q8k_x4(w, a),
                GgmlType::Q5K if isa() == Isa::Avx2 => return blockdot_avx2::dot_q5k_q8k_x4(w, a),
                GgmlType::Q6K if isa() == Isa::Avx2 => return blockdot_avx2::dot_q6k_q8k_x4(w, a),
                _ => {}
            }
        }
    }
    a.map(|a| vec_dot(ty, n, w, a))
}

/// Four weight rows against one activation row, bit-identical to four [`vec_dot`] calls (on
/// AVX-512 two rows share a register for the types that have such a kernel).
#[inline]
pub fn vec_dot_r4(ty: GgmlType, n: usize, w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512 {
        // SAFETY: AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C were detected (VNNI where used);
        // the row lengths are checked by the callers' slices.
        unsafe {
            match (ty, has_vnni()) {
                (GgmlType::Q4_0, true) => return matvec_avx512::dot_q4_0_q8_0_r4_vnni(w, a),
                (GgmlType::Q4_0, false) => return matvec_avx512::dot_q4_0_q8_0_r4(w, a),
                (GgmlType::Q4_1, true) => return matvec_avx512::dot_q4_1_q8_1_r4_vnni(w, a),
                (GgmlType::Q4_1, false) => return matvec_avx512::dot_q4_1_q8_1_r4(w, a),
                (GgmlType::Q8_0, true) => return matvec_avx512::dot_q8_0_q8_0_r4_vnni(w, a),
                (GgmlType::Q8_0, false) => return matvec_avx512::dot_q8_0_q8_0_r4(w, a),
                _ => {}
            }
        }
    }
    w.map(|w| vec_dot(ty, n, w, a))
}
