//! Shared by the CUDA kernels' host checks (`cuda_units_on_host`, `cuda_kernels_on_host`):
//! compiling a harness with the kernel files as host C++, and random valid ggml rows.

use std::path::{Path, PathBuf};
use std::process::Command;

use duet_kernels::quant::GgmlType;
use duet_model::testutil::workspace_root;
use half::f16;
use rand::Rng;

/// Compiles the C++ harness `src` (the kernel files and `tests/support` on its include path)
/// into an executable in a temporary directory of its own; `None` (having said why) without a
/// C++ compiler, or a panic where `DUET_REQUIRE_CXX=1` (the test script sets it).
pub fn compile_harness(src: &Path) -> Option<PathBuf> {
    let root = workspace_root().join("gpu-worker");
    let name = src.file_stem().expect("a file name").to_string_lossy().into_owned();
    let dir = std::env::temp_dir().join(format!("duet-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join(&name);
    // -ffp-contract=off: no fused multiply-adds the kernels did not write (__fmul_rn /
    // __fadd_rn promise none; where NVRTC fuses others, the checks' tolerances allow it).
    let out = Command::new("c++")
        .args(["-std=c++20", "-O1", "-ffp-contract=off", "-pthread", "-I"])
        .arg(root.join("src/device/cuda/kernels"))
        .arg("-I")
        .arg(root.join("tests/support"))
        .arg(src)
        .arg("-o")
        .arg(&exe)
        .output();
    match out {
        Err(e) if std::env::var("DUET_REQUIRE_CXX").is_ok_and(|v| v == "1") => panic!("DUET_REQUIRE_CXX=1: no C++ compiler (c++: {e})"),
        Err(e) => {
            eprintln!("skipped: no C++ compiler (c++: {e})");
            None
        }
        Ok(out) => {
            assert!(out.status.success(), "{} does not compile as host C++:\n{}", src.display(), String::from_utf8_lossy(&out.stderr));
            Some(exe)
        }
    }
}

/// A random row of `cols` values of the quantised type `ty`: random bytes, with each block's
/// f16 scales set to finite values in ±0.05 (zero, now and then).
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
