//! The CUDA device's kernels: CUDA C sources (`kernels/*.cu`, self-contained: NVRTC finds no
//! headers) compiled at run time with NVRTC for the GPU's architecture, the PTX cached on
//! disk, keyed by the source's hash, the architecture and the NVRTC version.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileOptions, Ptx};
use duet_kernels::quant::GgmlType;

use super::CudaError;

const TYPES: &str = include_str!("kernels/types.cuh");
const COMMON: &str = include_str!("kernels/common.cuh");
const QUANTS: &str = include_str!("kernels/quants.cuh");

/// One NVRTC program: a kernel file and the entry points the device loads from it.
#[derive(Debug)]
pub struct KernelFile {
    pub name: &'static str,
    body: &'static str,
    pub entries: &'static [&'static str],
}

/// Every kernel file, with every entry point the device uses.
pub const FILES: [KernelFile; 4] = [
    KernelFile {
        name: "matvec.cu",
        body: include_str!("kernels/matvec.cu"),
        entries: &[
            "quantize_q8_1",
            "mmvq_q4_0",
            "mmvq_q4_1",
            "mmvq_q5_0",
            "mmvq_q5_1",
            "mmvq_q8_0",
            "mmvq_q4_k",
            "mmvq_q5_k",
            "mmvq_q6_k",
            "mmvq_q4_0_group",
            "mmvq_q4_1_group",
            "mmvq_q5_0_group",
            "mmvq_q5_1_group",
            "mmvq_q8_0_group",
            "mmvq_q4_k_group",
            "mmvq_q5_k_group",
            "mmvq_q6_k_group",
            "mmq_q4_0",
            "mmq_q4_1",
            "mmq_q5_0",
            "mmq_q5_1",
            "mmq_q8_0",
            "mmq_q4_k",
            "mmq_q5_k",
            "mmq_q6_k",
            "mmq_reduce",
            "mv_f32",
            "mv_f16",
            "mv_bf16",
        ],
    },
    KernelFile {
        name: "dequant.cu",
        body: include_str!("kernels/dequant.cu"),
        entries: &[
            "dequant_f16_q4_0",
            "dequant_f16_q4_1",
            "dequant_f16_q5_0",
            "dequant_f16_q5_1",
            "dequant_f16_q8_0",
            "dequant_f16_q4_k",
            "dequant_f16_q5_k",
            "dequant_f16_q6_k",
            "dequant_f16_float",
            "get_rows_q4_0",
            "get_rows_q4_1",
            "get_rows_q5_0",
            "get_rows_q5_1",
            "get_rows_q8_0",
            "get_rows_q4_k",
            "get_rows_q5_k",
            "get_rows_q6_k",
            "get_rows_float",
        ],
    },
    KernelFile {
        name: "ops.cu",
        body: include_str!("kernels/ops.cu"),
        entries: &["rms_norm", "rms_norm_fused", "rope", "silu_mul", "silu_mul_q8", "add_assign", "add_bias", "to_f16", "gather_rows", "scatter_add_scaled", "argmax_rows"],
    },
    KernelFile { name: "attention.cu", body: include_str!("kernels/attention.cu"), entries: &["kv_store", "kv_to_arena", "arena_to_mirror", "attn_partial", "attn_merge", "attn_prefill", "attn_prefill_mma64", "attn_prefill_mma128"] },
];

impl KernelFile {
    /// The whole program NVRTC compiles: the shared definitions (types, helpers, block
    /// formats), then the file.
    pub fn source(&self) -> String {
        format!("{TYPES}\n{COMMON}\n{QUANTS}\n// ---- {} ----\n{}", self.name, self.body)
    }
}

/// How the kernels of a weight type are named (`mmvq_<suffix>`, `get_rows_<suffix>`, ...);
/// `None` for the float types, which have their own kernels, and for types no weight has.
pub fn quant_suffix(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4K => "q4_k",
        GgmlType::Q5K => "q5_k",
        GgmlType::Q6K => "q6_k",
        _ => return None,
    })
}

/// The version of the NVRTC library found, e.g. (13, 0).
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters; the caller checked that the library is present.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::NvrtcVersion(format!("{status:?}")));
    }
    Ok((major, minor))
}

/// Compiles `file` to PTX for `compute_<arch>` (e.g. 90), reading and filling the cache in
/// `cache` when given (a cache that cannot be written only costs the compile next time).
pub fn compile(file: &KernelFile, arch: u32, cache: Option<&Path>) -> Result<String, CudaError> {
    let source = file.source();
    let (major, minor) = nvrtc_version()?;
    let key = format!("{}-{:016x}-sm{arch}-nvrtc{major}.{minor}.ptx", file.name.trim_end_matches(".cu"), fnv1a(source.as_bytes()));
    let cached = cache.map(|dir| dir.join(&key));
    if let Some(ptx) = cached.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        return Ok(ptx);
    }
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{arch}"), "--std=c++17".into()],
        name: Some(file.name.into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&source, opts)
        .map_err(|e| CudaError::Compile { file: file.name, log: compile_log(&e) })?
        .to_src();
    if let Some(path) = cached {
        if let Err(e) = write_atomically(&path, &ptx) {
            tracing::warn!(path = %path.display(), "cannot cache PTX ({e}); kernels are compiled again next time");
        }
    }
    Ok(ptx)
}

/// The loaded kernels of every file, by entry-point name.
pub struct Kernels {
    functions: HashMap<&'static str, CudaFunction>,
    /// The architecture they were compiled for (e.g. 90).
    pub arch: u32,
}

impl Kernels {
    /// Compiles (or reads from the cache) and loads every kernel file onto `ctx`'s GPU.
    pub fn load(ctx: &Arc<CudaContext>, arch: u32) -> Result<Kernels, CudaError> {
        let cache = cache_dir();
        if let Some(dir) = &cache {
            let _ = std::fs::create_dir_all(dir);
        }
        let mut functions = HashMap::new();
        for file in &FILES {
            let ptx = compile(file, arch, cache.as_deref())?;
            let module = ctx.load_module(Ptx::from_src(ptx))?;
            for &entry in file.entries {
                functions.insert(entry, module.load_function(entry)?);
            }
        }
        Ok(Kernels { functions, arch })
    }

    /// The kernel `name` (one of [`FILES`]' entries).
    pub fn get(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.functions.get(name).ok_or_else(|| CudaError::NoKernel(name.to_string()))
    }
}

/// Where compiled PTX is kept: `$DUET_CUDA_CACHE`, else `$XDG_CACHE_HOME/duet/ptx`, else
/// `~/.cache/duet/ptx`; none when no home is known.
fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("DUET_CUDA_CACHE") {
        return Some(dir.into());
    }
    let base = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))?;
    Some(base.join("duet").join("ptx"))
}

fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

fn compile_log(e: &cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        other => format!("{other:?}"),
    }
}

/// FNV-1a, 64 bits: a hash of the kernel source that stays the same across builds.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}
