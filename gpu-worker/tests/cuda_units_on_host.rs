//! The CUDA kernels' block decoding (`quants.cuh`: `load_unit`, `unit_value`, `unit_dot`)
//! checked on any machine: the header is compiled as host C++ (`c++`, with one-line stand-ins
//! for the few CUDA intrinsics it uses: `__dp4a`, `__fmul_rn`, `__fadd_rn`, the f16
//! conversion) and run on random blocks of every quantised type. Dequantisation must be bit
//! for bit the CPU's (`kernels::quant::dequantize`); the dp4a dot product against Q8_1
//! activations must be within the activations' rounding bound of the exact product. This is
//! the layout logic the GPU kernels run; the GPU twins (`device::cuda::twins`) check the
//! kernels themselves on a GPU. Without a C++ compiler the test says it was skipped. The types
//! and type ids come from the kernels' own `types.cuh`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use duet_kernels::quant::{dequantize, GgmlType};

#[path = "support/host_kernels.rs"]
mod host_kernels;
use rand::{Rng, SeedableRng};

const HARNESS: &str = r#"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define __device__
#define __forceinline__ inline
#include "types.cuh"
static float f16_to_f32(u16 h) {
    u32 sign = (u32)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { int e = -1; do { ++e; man <<= 1; } while (!(man & 0x400)); bits = sign | ((u32)(112 - e) << 23) | ((man & 0x3ff) << 13); }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f; memcpy(&f, &bits, 4); return f;
}
static float bf16_to_f32(u16 b) { u32 bits = (u32)b << 16; float f; memcpy(&f, &bits, 4); return f; }
static u16 ld_u16(const u8* p, int off) { u16 v; memcpy(&v, p + off, 2); return v; }
static int ld_int_b2(const u8* p) { int v; memcpy(&v, p, 4); return v; }
static float __fmul_rn(float a, float b) { return a * b; }
static float __fadd_rn(float a, float b) { return a + b; }
static float __uint_as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
// Declared only: quants.cuh's q8_1_unit, which this check does not call, names them.
#include <cmath>
float warp_max(float v);
int warp_sum_int(int v);
static int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(i8)(a >> (8 * i)) * (int)(i8)(b >> (8 * i));
    return c;
}
#include "quants.cuh"
template <int T> static void run(const u8* row, int units, const BlockQ8_1* acts, float* values, float* dot) {
    float acc = 0.0f;
    for (int u = 0; u < units; ++u) {
        Unit r;
        load_unit<T>(row, u, r);
        for (int e = 0; e < 32; ++e) values[u * 32 + e] = unit_value(r, e);
        acc += unit_dot(r, acts[u]);
    }
    *dot = acc;
}
// stdin: type, units, the row's bytes, then units BlockQ8_1; stdout: 32*units values, the dot.
int main() {
    int ty, units;
    if (fread(&ty, 4, 1, stdin) != 1 || fread(&units, 4, 1, stdin) != 1) return 2;
    std::vector<u8> in((size_t)1 << 20);
    size_t n = fread(in.data(), 1, in.size(), stdin);
    size_t acts_bytes = (size_t)units * sizeof(BlockQ8_1);
    if (n < acts_bytes) return 3;
    std::vector<BlockQ8_1> acts(units);
    memcpy(acts.data(), in.data() + n - acts_bytes, acts_bytes);
    std::vector<u8> row(in.begin(), in.begin() + (n - acts_bytes));
    std::vector<float> values(units * 32);
    float dot = 0;
    switch (ty) {
        case T_Q4_0: run<T_Q4_0>(row.data(), units, acts.data(), values.data(), &dot); break;
        case T_Q4_1: run<T_Q4_1>(row.data(), units, acts.data(), values.data(), &dot); break;
        case T_Q5_0: run<T_Q5_0>(row.data(), units, acts.data(), values.data(), &dot); break;
        case T_Q5_1: run<T_Q5_1>(row.data(), units, acts.data(), values.data(), &dot); break;
        case T_Q8_0: run<T_Q8_0>(row.data(), units, acts.data(), values.data(), &dot); break;
        case T_Q4_K: run<T_Q4_K>(row.data(), units, acts.data(), values.data(), &dot); break;
        case T_Q5_K: run<T_Q5_K>(row.data(), units, acts.data(), values.data(), &dot); break;
        case T_Q6_K: run<T_Q6_K>(row.data(), units, acts.data(), values.data(), &dot); break;
        default: return 4;
    }
    fwrite(values.data(), 4, values.size(), stdout);
    fwrite(&dot, 4, 1, stdout);
    return 0;
}
"#;

/// Compiles the harness, or `None` (having said why) without a C++ compiler.
fn harness() -> Option<PathBuf> {
    let dir = std::env::temp_dir().join(format!("duet-units-src-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("units_on_host.cpp");
    std::fs::write(&src, HARNESS).unwrap();
    host_kernels::compile_harness(&src)
}

/// Q8_1 units of `x` as the `quantize_q8_1` kernel makes them: d = amax / 127, q = round(x / d),
/// s = d * sum(q); also the activations those units stand for.
fn q8_1(x: &[f32]) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut back = Vec::new();
    for u in x.chunks_exact(32) {
        let amax = u.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q: Vec<i8> = u.iter().map(|&v| (v * id).round() as i8).collect();
        let sum: i32 = q.iter().map(|&v| v as i32).sum();
        bytes.extend(d.to_le_bytes());
        bytes.extend((d * sum as f32).to_le_bytes());
        bytes.extend(q.iter().map(|&v| v as u8));
        back.extend(q.iter().map(|&v| v as f32 * d));
    }
    (bytes, back)
}

fn run(exe: &Path, ty: GgmlType, row: &[u8], units: usize, acts: &[u8]) -> (Vec<f32>, f32) {
    let mut child = Command::new(exe).stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn().unwrap();
    let mut input = Vec::new();
    input.extend((ty.id() as i32).to_le_bytes());
    input.extend((units as i32).to_le_bytes());
    input.extend(row);
    input.extend(acts);
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{ty:?}: harness exit {:?}", out.status);
    let f: Vec<f32> = out.stdout.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    assert_eq!(f.len(), units * 32 + 1);
    (f[..units * 32].to_vec(), f[units * 32])
}

#[test]
fn block_decoding_of_every_quantised_type_matches_the_cpu() {
    let Some(exe) = harness() else { return };
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let types = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];
    let cols = 1024;
    for ty in types {
        for trial in 0..4 {
            // Zero scales too, and negative ones, now and then.
            let row = host_kernels::random_row(ty, cols, &mut rng);
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-2.0f32..2.0)).collect();
            let (acts, xq) = q8_1(&x);
            let (values, dot) = run(&exe, ty, &row, cols / 32, &acts);
            let mut want = vec![0f32; cols];
            dequantize(ty, &row, &mut want).unwrap();
            for (i, (&g, &e)) in values.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), e.to_bits(), "{ty:?} trial {trial}: element {i}: kernel {g}, CPU {e}");
            }
            // The dot product of the weights with the quantised activations, exactly.
            let exact: f64 = want.iter().zip(&xq).map(|(&w, &a)| w as f64 * a as f64).sum();
            let scale: f64 = want.iter().zip(&xq).map(|(&w, &a)| (w as f64 * a as f64).abs()).sum();
            assert!((dot as f64 - exact).abs() <= 1e-5 * scale + 1e-6, "{ty:?} trial {trial}: unit_dot {dot} vs exact {exact} (scale {scale})");
        }
        println!("{ty:?}: decoding exact, dp4a dot within 1e-5 of the exact product");
    }
}
