//! The CUDA device's kernel sources against NVRTC, on any machine: every file compiles to
//! PTX for the oldest architecture CUDA 13 compiles for (sm_75, a T4) and for Hopper (sm_90), and its
//! PTX has exactly the entry points the device loads. Needs NVRTC (PyPI's nvidia-cuda-nvrtc,
//! which `scripts/test.sh` installs), not a GPU; without it the test says it was skipped, and
//! `DUET_REQUIRE_NVRTC=1` (CI) turns that into a failure.

use std::collections::BTreeSet;

use duet_gpu_worker::device::cuda::{compile_kernel_file, nvrtc_version, KERNEL_FILES};

fn nvrtc_or_skip() -> bool {
    // SAFETY: only opens and closes the library.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return true;
    }
    let why = "NVRTC (libnvrtc.so.13) not found: pip install 'nvidia-cuda-nvrtc==13.0.*' and put its lib folder on LD_LIBRARY_PATH";
    if std::env::var("DUET_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
        panic!("{why}");
    }
    eprintln!("skipped: {why}");
    false
}

/// The names of a PTX module's kernels (`.entry NAME(`).
fn entries(ptx: &str) -> BTreeSet<String> {
    ptx.lines()
        .filter_map(|l| l.split_once(".entry ").map(|(_, rest)| rest.trim().trim_end_matches('(').trim().to_string()))
        .collect()
}

#[test]
fn every_kernel_file_compiles_with_nvrtc_and_exports_its_entry_points() {
    if !nvrtc_or_skip() {
        return;
    }
    let (major, minor) = nvrtc_version().unwrap();
    println!("NVRTC {major}.{minor}");
    for arch in [75, 90] {
        for file in &KERNEL_FILES {
            let ptx = compile_kernel_file(file, arch, None).unwrap_or_else(|e| panic!("sm_{arch}: {e}"));
            assert!(ptx.contains(&format!(".target sm_{arch}")), "{}: PTX not for sm_{arch}", file.name);
            let found = entries(&ptx);
            let want: BTreeSet<String> = file.entries.iter().map(|e| e.to_string()).collect();
            assert_eq!(found, want, "{} for sm_{arch}: the PTX's kernels differ from the ones the device loads", file.name);
            println!("sm_{arch} {}: {} kernels, {} bytes of PTX", file.name, found.len(), ptx.len());
        }
    }
}

#[test]
fn compiled_ptx_is_cached_on_disk_and_reused() {
    if !nvrtc_or_skip() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("duet-ptx-cache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = &KERNEL_FILES[2];
    let first = compile_kernel_file(file, 90, Some(&dir)).unwrap();
    let cached: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(cached.len(), 1, "{cached:?}");
    // A cached file is what the next load uses: prove it by changing it.
    std::fs::write(&cached[0], "// cached\n").unwrap();
    assert_eq!(compile_kernel_file(file, 90, Some(&dir)).unwrap(), "// cached\n");
    assert!(first.contains(".entry rms_norm"));
    // Another architecture is another key.
    compile_kernel_file(file, 75, Some(&dir)).unwrap();
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}
