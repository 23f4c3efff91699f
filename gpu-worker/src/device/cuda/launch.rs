//! The CUDA device's arithmetic: weights uploaded as the GGUF file stores them, and one
//! method per kernel launch. Linear layers pick their kernel by batch size: quantised weights
//! with up to [`MV_PASS_ROWS`] activation rows (decode batches) run the quantised
//! matrix-vector kernels on the weights as they are, [`MV_MAX_TOK`] rows a launch
//! (activations quantised to Q8_1 once per input); float weights do so up to [`MV_MAX_TOK`]
//! rows. Larger batches dequantise the weight to f16, a bounded slice of rows at a time, and
//! multiply with cuBLAS (f32 accumulation; F32 weights go to cuBLAS as they are).

use std::sync::{Arc, Mutex};

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use duet_kernels::quant::GgmlType;

use super::kernels::{quant_suffix, Kernels};
use super::CudaError;
use crate::device::model::Weight;

/// The most activation rows one matrix-vector launch takes (`MV_MAX_TOK` in matvec.cu): 16,
/// so that 16 streams read the weights once a step and 64 four times (with 8, twice and
/// eight times), for 8 more registers a thread (ptxas, sm_90: 48 against 40).
pub const MV_MAX_TOK: usize = 16;
/// The most activation rows a quantised weight multiplies with the matrix-vector kernels (in
/// launches of [`MV_MAX_TOK`]) before it is dequantised for cuBLAS. The kernels' time grows
/// with the rows (dp4a-bound), cuBLAS's hardly (the dequantisation dominates): on the H200
/// (2026-11-28, 1B shape served at depth 1024) a decode step's linear layers took 1.84 ms for
/// one row, 4.76 ms for 16 and 15.7 ms for 64 through the matrix-vector kernels, and 3.23 ms
/// for 16 and 3.63 ms for 64 through cuBLAS. `DUET_CUDA_MV_ROWS` overrides it, for comparing
/// the two.
pub const MV_PASS_ROWS: usize = 8;
/// The most activation rows an `mmq_*` launch takes (`MQ_TOK` in matvec.cu): decode batches
/// of `MV_PASS_ROWS` + 1 to 64 rows run on the integer tensor cores on the quantised weights,
/// each weight read once, where cuBLAS wrote every weight out as f16 first (the 8B shape's
/// 4.7 GB as 15 GB a step).
pub const MQ_TOK: usize = 64;
/// Weight rows, and threads, of an `mmq_*` block (`MQ_ROWS`, `MQ_WARPS` in matvec.cu).
const MQ_ROWS: u32 = 64;
const MQ_THREADS: u32 = 4 * 32;
/// Warps per block of the matrix-vector and quantisation kernels (`MV_WARPS` in matvec.cu).
const MV_WARPS: u32 = 4;
/// Threads per row of `rms_norm` (`NORM_THREADS` in ops.cu).
const NORM_THREADS: u32 = 256;
/// Warps per block of `silu_mul_q8` (`SILU_Q8_WARPS` in ops.cu).
const SILU_Q8_WARPS: u32 = 4;
/// Threads per row of `argmax_rows` (`ARGMAX_THREADS` in ops.cu).
const ARGMAX_THREADS: u32 = 256;
/// Bytes of one Q8_1 activation unit (`BlockQ8_1` in quants.cuh: d, s, 32 quants).
const Q8_1_BYTES: usize = 40;
/// Units (and threads) of a `dequant_f16_*` block (`DQ_UNITS` in dequant.cu).
const DQ_UNITS: usize = 128;
/// Elements of the f16 workspace a weight is dequantised into for cuBLAS (128 MiB).
pub const WORKSPACE_ELEMS: usize = 64 << 20;

/// A weight matrix on the GPU, its bytes as the file stores them.
pub struct GpuWeight {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    data: CudaSlice<u8>,
}

impl GpuWeight {
    /// Whether the GPU's kernels take weights of type `ty`.
    pub fn takes(ty: GgmlType) -> bool {
        quant_suffix(ty).is_some() || matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }

    /// Uploads `bytes`, the data of `w`, after checking the device has kernels for its type.
    pub fn upload(stream: &Arc<CudaStream>, w: &Weight, bytes: &[u8]) -> Result<GpuWeight, CudaError> {
        if !Self::takes(w.ty) {
            return Err(CudaError::UnsupportedType { tensor: w.name.clone(), ty: w.ty });
        }
        Ok(GpuWeight { ty: w.ty, rows: w.rows, cols: w.cols, data: stream.clone_htod(bytes)? })
    }

    pub fn bytes(&self) -> usize {
        self.data.len()
    }
}

/// One cuBLAS product's device pointers and shape (see [`Launcher::gemm_raw`]).
struct Gemm {
    w: u64,
    x: u64,
    y: u64,
    rows: usize,
    n: usize,
    k: usize,
    ldy: usize,
    f16: bool,
}

/// A batch of activation rows on the GPU, with the forms linear layers need made once each.
pub struct Acts<'a> {
    pub x: &'a CudaSlice<f32>,
    pub n: usize,
    pub cols: usize,
    q8: Option<CudaSlice<u8>>,
    h: Option<CudaSlice<u16>>,
}

impl<'a> Acts<'a> {
    pub fn new(x: &'a CudaSlice<f32>, n: usize, cols: usize) -> Self {
        Acts { x, n, cols, q8: None, h: None }
    }

    /// With their Q8_1 units made already (by a fused kernel: [`Launcher::norm_fused`],
    /// [`Launcher::silu_mul_q8`]).
    pub fn with_q8(x: &'a CudaSlice<f32>, n: usize, cols: usize, q8: Option<CudaSlice<u8>>) -> Self {
        Acts { x, n, cols, q8, h: None }
    }
}

/// The stream, the kernels, cuBLAS and the dequantisation workspace.
pub struct Launcher {
    pub stream: Arc<CudaStream>,
    kernels: Kernels,
    blas: CudaBlas,
    /// f16 rows of the weight being multiplied by cuBLAS; locked from the dequantisation to
    /// the multiplication that reads it.
    workspace: Mutex<CudaSlice<u16>>,
    /// [`MV_PASS_ROWS`], or `DUET_CUDA_MV_ROWS`.
    mv_pass_rows: usize,
    /// Batches above `mv_pass_rows` and up to [`MQ_TOK`] rows take `mmq_*` (the integer tensor
    /// cores, on the quantised weights) rather than cuBLAS on weights dequantised to f16: on
    /// sm_80 and later unless `DUET_CUDA_MMQ=0`.
    mmq: bool,
    /// The GPU's multiprocessors: an `mmq_*` launch splits a narrow weight's units until it
    /// has two blocks for each.
    sm_count: usize,
}

#[cfg(test)]
impl Launcher {
    /// Sets the rows up to which quantised weights take the matrix-vector kernels (the twins
    /// check both rules).
    pub(super) fn set_mv_pass_rows(&mut self, rows: usize) {
        self.mv_pass_rows = rows;
    }

    /// Whether batches of up to [`MQ_TOK`] rows take `mmq_*` (the twins check both ways).
    pub(super) fn set_mmq(&mut self, on: bool) {
        self.mmq = on && self.kernels.arch >= 80;
    }
}

fn grid_1d(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

/// How an `mmq_*` launch of `blocks` blocks of rows splits a weight's `n_units` units: units
/// a split (whole stages of 4) and splits, enough for `target` blocks, each split at least two
/// stages.
fn mmq_splits(blocks: usize, n_units: usize, target: usize) -> (usize, usize) {
    let most = n_units.div_ceil(8).max(1);
    let splits = target.div_ceil(blocks.max(1)).clamp(1, most);
    let per_split = n_units.div_ceil(splits).next_multiple_of(4);
    (per_split, n_units.div_ceil(per_split))
}

fn mv_config(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: ((rows as u32).div_ceil(MV_WARPS), 1, 1), block_dim: (32, MV_WARPS, 1), shared_mem_bytes: 0 }
}

impl Launcher {
    pub fn new(stream: Arc<CudaStream>, kernels: Kernels, workspace_elems: usize) -> Result<Self, CudaError> {
        let blas = CudaBlas::new(stream.clone())?;
        let workspace = Mutex::new(stream.alloc_zeros::<u16>(workspace_elems.max(1))?);
        let mv_pass_rows = match std::env::var("DUET_CUDA_MV_ROWS") {
            Ok(v) => v.parse::<usize>().ok().filter(|&n| n >= 1).ok_or(CudaError::Setting {
                name: "DUET_CUDA_MV_ROWS",
                why: format!("{v:?} is not a number of rows of at least 1"),
            })?,
            Err(_) => MV_PASS_ROWS,
        };
        let mmq = kernels.arch >= 80 && std::env::var("DUET_CUDA_MMQ").map_or(true, |v| v != "0");
        let sms = stream.context().attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok(Launcher { stream, kernels, blas, workspace, mv_pass_rows, mmq, sm_count: sms.max(1) as usize })
    }

    /// The loaded kernels (for launches outside this file: the KV mirror's).
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    fn f(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.kernels.get(name)
    }

    /// A new buffer of `n` f32 (contents undefined until written).
    pub fn alloc(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        // SAFETY: every caller writes the buffer whole before reading it.
        Ok(unsafe { self.stream.alloc::<f32>(n.max(1)) }?)
    }

    /// `acts` times `w`: `acts.n` rows of `w.rows`.
    pub fn linear(&self, w: &GpuWeight, acts: &mut Acts<'_>) -> Result<CudaSlice<f32>, CudaError> {
        debug_assert_eq!(acts.cols, w.cols);
        let mut y = self.alloc(acts.n * w.rows)?;
        let (rows, n) = (w.rows as i32, acts.n as i32);
        if let (Some(suffix), true) = (quant_suffix(w.ty), acts.n <= self.mv_pass_rows) {
            let (units, n_acts) = (w.cols / 32, acts.n);
            let q8 = self.q8(acts)?;
            let f = self.f(&format!("mmvq_{suffix}"))?;
            let units_i = units as i32;
            // Activation rows t0.. of one launch: their Q8_1 units and their rows of y.
            for t0 in (0..n_acts).step_by(MV_MAX_TOK) {
                let nt = MV_MAX_TOK.min(n_acts - t0);
                let nt_i = nt as i32;
                let x = q8.slice(t0 * units * Q8_1_BYTES..(t0 + nt) * units * Q8_1_BYTES);
                let mut out = y.slice_mut(t0 * w.rows..(t0 + nt) * w.rows);
                let mut b = self.stream.launch_builder(f);
                b.arg(&w.data).arg(&rows).arg(&units_i).arg(&x).arg(&nt_i).arg(&mut out);
                // SAFETY: the arguments match mmvq's signature; sizes were checked at upload;
                // x holds nt rows of units Q8_1 units, out nt rows of w.rows.
                unsafe { b.launch(mv_config(w.rows)) }?;
            }
            return Ok(y);
        }
        if let (Some(suffix), true) = (quant_suffix(w.ty), self.takes_mmq(w, acts.n)) {
            let (n_units, n) = (w.cols / 32, acts.n);
            let (units, nt) = (n_units as i32, n as i32);
            let blocks = w.rows.div_ceil(MQ_ROWS as usize);
            let (per_split, splits) = mmq_splits(blocks, n_units, 2 * self.sm_count);
            let per_split_i = per_split as i32;
            let cfg = LaunchConfig { grid_dim: (blocks as u32, splits as u32, 1), block_dim: (MQ_THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: mmq writes every partial sum of its splits.
            let mut part = if splits > 1 { Some(unsafe { self.stream.alloc::<f32>(splits * n * w.rows) }?) } else { None };
            let q8 = self.q8(acts)?;
            let mut b = self.stream.launch_builder(self.f(&format!("mmq_{suffix}"))?);
            b.arg(&w.data).arg(&rows).arg(&units).arg(q8).arg(&nt);
            match part.as_mut() {
                Some(p) => b.arg(p),
                None => b.arg(&mut y),
            };
            b.arg(&per_split_i);
            // SAFETY: the arguments match mmq's signature; q8 holds n (<= MQ_TOK) rows of
            // n_units Q8_1 units; its output holds n rows of w.rows for each split.
            unsafe { b.launch(cfg) }?;
            if let Some(p) = &part {
                let (splits_i, total) = (splits as i32, (n * w.rows) as i32);
                let mut b = self.stream.launch_builder(self.f("mmq_reduce")?);
                b.arg(p).arg(&splits_i).arg(&total).arg(&mut y);
                // SAFETY: p holds `splits` partial sums of y's n * w.rows values.
                unsafe { b.launch(grid_1d(n * w.rows)) }?;
            }
            return Ok(y);
        }
        if acts.n <= MV_MAX_TOK.min(self.mv_pass_rows) && quant_suffix(w.ty).is_none() {
            let name = match w.ty {
                GgmlType::F32 => "mv_f32",
                GgmlType::F16 => "mv_f16",
                _ => "mv_bf16",
            };
            let cols = w.cols as i32;
            let mut b = self.stream.launch_builder(self.f(name)?);
            b.arg(&w.data).arg(&rows).arg(&cols).arg(acts.x).arg(&n).arg(&mut y);
            // SAFETY: as above, for mv_float.
            unsafe { b.launch(mv_config(w.rows)) }?;
            return Ok(y);
        }
        self.gemm(w, acts, &mut y)?;
        Ok(y)
    }

    /// `acts` times each of `ws` (a layer's Q, K and V, or its gate and up): one launch
    /// (`mmvq_*_group`) where the weights share a quantised type and width and the batch fits
    /// one pass of the matrix-vector kernels, else one product each. Each output as
    /// [`linear`](Self::linear) gives it, bit for bit (the same warp code per row).
    pub fn linear_group<const N: usize>(&self, ws: [&GpuWeight; N], acts: &mut Acts<'_>) -> Result<[CudaSlice<f32>; N], CudaError> {
        let first = ws[0];
        let grouped = (2..=3).contains(&N)
            && acts.n <= MV_MAX_TOK.min(self.mv_pass_rows)
            && quant_suffix(first.ty).is_some()
            && ws.iter().all(|w| w.ty == first.ty && w.cols == first.cols && w.cols == acts.cols);
        if !grouped {
            let mut out = Vec::with_capacity(N);
            for w in ws {
                out.push(self.linear(w, acts)?);
            }
            return Ok(out.try_into().unwrap_or_else(|_| unreachable!("N outputs")));
        }
        let suffix = quant_suffix(first.ty).expect("checked above");
        let mut ys = Vec::with_capacity(N);
        for w in ws {
            ys.push(self.alloc(acts.n * w.rows)?);
        }
        let (units, nt) = ((first.cols / 32) as i32, acts.n as i32);
        let q8 = self.q8(acts)?;
        let f = self.f(&format!("mmvq_{suffix}_group"))?;
        let rows: Vec<i32> = (0..3).map(|i| ws.get(i).map_or(0, |w| w.rows as i32)).collect();
        let total: usize = ws.iter().map(|w| w.rows).sum();
        let mut b = self.stream.launch_builder(f);
        // A third weight absent: null pointers with no rows (never read or written).
        let null: u64 = 0;
        let mut ys_iter = ys.iter_mut();
        for (i, r) in rows.iter().enumerate() {
            match (ws.get(i), ys_iter.next()) {
                (Some(w), Some(y)) => b.arg(&w.data).arg(r).arg(y),
                _ => b.arg(&null).arg(r).arg(&null),
            };
        }
        b.arg(&units).arg(q8).arg(&nt);
        // SAFETY: the arguments match mmvq_group's signature; every weight is `units` Q8_1
        // units wide with its rows (checked at upload), q8 holds acts.n rows of them, and each
        // y holds acts.n rows of its weight's rows; a weight with rows 0 is never touched.
        unsafe { b.launch(mv_config(total)) }?;
        Ok(ys.try_into().unwrap_or_else(|_| unreachable!("N outputs")))
    }

    /// The activations as Q8_1 units, made on first use.
    fn q8<'b>(&self, acts: &'b mut Acts<'_>) -> Result<&'b CudaSlice<u8>, CudaError> {
        if acts.q8.is_none() {
            let units = acts.n * acts.cols / 32;
            // SAFETY: quantize_q8_1 writes every unit.
            let mut q8 = unsafe { self.stream.alloc::<u8>(units * Q8_1_BYTES) }?;
            let units_i = units as i32;
            let mut b = self.stream.launch_builder(self.f("quantize_q8_1")?);
            b.arg(acts.x).arg(&mut q8).arg(&units_i);
            let cfg = LaunchConfig { grid_dim: ((units as u32).div_ceil(MV_WARPS), 1, 1), block_dim: (32, MV_WARPS, 1), shared_mem_bytes: 0 };
            // SAFETY: x holds `units` units of 32 f32; q8 has room for as many BlockQ8_1.
            unsafe { b.launch(cfg) }?;
            acts.q8 = Some(q8);
        }
        Ok(acts.q8.as_ref().expect("made above"))
    }

    /// `acts` times `w` through cuBLAS: F32 weights as they are (SGEMM on the f32
    /// activations); others dequantised to f16 in slices of rows that fit the workspace, each
    /// multiplied with the f16 activations into its columns of `y` (f32 accumulation).
    fn gemm(&self, w: &GpuWeight, acts: &mut Acts<'_>, y: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        if w.ty == GgmlType::F32 {
            let (wp, _g1) = w.data.device_ptr(&self.stream);
            let (xp, _g2) = acts.x.device_ptr(&self.stream);
            let (yp, _g3) = y.device_ptr_mut(&self.stream);
            // SAFETY: the weight holds rows*cols f32, x n*cols, y n*rows.
            return unsafe { self.gemm_raw(Gemm { w: wp, x: xp, y: yp, rows: w.rows, n: acts.n, k: w.cols, ldy: w.rows, f16: false }) };
        }
        if acts.h.is_none() {
            let n = acts.n * acts.cols;
            // SAFETY: to_f16 writes all n.
            let mut h = unsafe { self.stream.alloc::<u16>(n) }?;
            let mut b = self.stream.launch_builder(self.f("to_f16")?);
            b.arg(acts.x).arg(&mut h).arg(&n);
            // SAFETY: x and h hold n elements.
            unsafe { b.launch(grid_1d(n)) }?;
            acts.h = Some(h);
        }
        let h = acts.h.as_ref().expect("made above");
        let mut ws = self.workspace.lock().unwrap_or_else(|p| p.into_inner());
        let chunk = (ws.len() / w.cols).clamp(1, w.rows);
        let mut row0 = 0;
        while row0 < w.rows {
            let rows = chunk.min(w.rows - row0);
            self.dequant_f16(w, row0, rows, &mut ws)?;
            let (wp, _g1) = ws.device_ptr(&self.stream);
            let (hp, _g2) = h.device_ptr(&self.stream);
            let (yp, _g3) = y.device_ptr_mut(&self.stream);
            // SAFETY: the workspace holds rows*cols f16, h n*cols, y n*w.rows f32 (this slice
            // writes its columns row0..row0 + rows of each of y's rows).
            unsafe { self.gemm_raw(Gemm { w: wp, x: hp, y: yp + (row0 * 4) as u64, rows, n: acts.n, k: w.cols, ldy: w.rows, f16: true }) }?;
            row0 += rows;
        }
        Ok(())
    }

    /// `y[t][r] = sum_c w[r][c] * x[t][c]` for `rows` weight rows and `n` activation rows, `y`'s
    /// rows `ldy` apart. In cuBLAS's column-major terms: y^T (rows x n) = W^T' (w is k x rows,
    /// transposed) * x^T (k x n).
    ///
    /// # Safety
    /// The pointers must hold what `g` says, of f16 (`g.f16`) or f32.
    unsafe fn gemm_raw(&self, g: Gemm) -> Result<(), CudaError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let ty = if g.f16 { blas_sys::cudaDataType_t::CUDA_R_16F } else { blas_sys::cudaDataType_t::CUDA_R_32F };
        cudarc::cublas::result::gemm_ex(
            *self.blas.handle(),
            blas_sys::cublasOperation_t::CUBLAS_OP_T,
            blas_sys::cublasOperation_t::CUBLAS_OP_N,
            g.rows as i32,
            g.n as i32,
            g.k as i32,
            (&alpha) as *const f32 as *const _,
            g.w as *const _,
            ty,
            g.k as i32,
            g.x as *const _,
            ty,
            g.k as i32,
            (&beta) as *const f32 as *const _,
            g.y as *mut _,
            blas_sys::cudaDataType_t::CUDA_R_32F,
            g.ldy as i32,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )?;
        Ok(())
    }

    /// Rows `row0..row0 + rows` of `w` as f16 into the front of `out`.
    pub fn dequant_f16(&self, w: &GpuWeight, row0: usize, rows: usize, out: &mut CudaSlice<u16>) -> Result<(), CudaError> {
        let (row0_i, rows_i) = (row0 as i32, rows as i32);
        match quant_suffix(w.ty) {
            Some(suffix) => {
                let units = w.cols / 32;
                let units_i = units as i32;
                let mut b = self.stream.launch_builder(self.f(&format!("dequant_f16_{suffix}"))?);
                b.arg(&w.data).arg(&row0_i).arg(&rows_i).arg(&units_i).arg(out);
                // SAFETY: `out` holds rows*cols f16 (the callers' chunking); the rows exist.
                let blocks = (rows * units).div_ceil(DQ_UNITS) as u32;
                unsafe { b.launch(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (DQ_UNITS as u32, 1, 1), shared_mem_bytes: 0 }) }?;
            }
            None => {
                let (ty, cols) = (w.ty.id() as i32, w.cols as i32);
                let mut b = self.stream.launch_builder(self.f("dequant_f16_float")?);
                b.arg(&ty).arg(&w.data).arg(&row0_i).arg(&rows_i).arg(&cols).arg(out);
                // SAFETY: as above.
                unsafe { b.launch(grid_1d(rows * w.cols)) }?;
            }
        }
        Ok(())
    }

    /// The embedding rows of `tokens` as f32, `[token][w.cols]`.
    pub fn get_rows(&self, w: &GpuWeight, tokens: &CudaSlice<u32>, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        let mut out = self.alloc(n * w.cols)?;
        let n_i = n as i32;
        match quant_suffix(w.ty) {
            Some(suffix) => {
                let units = w.cols / 32;
                let units_i = units as i32;
                let mut b = self.stream.launch_builder(self.f(&format!("get_rows_{suffix}"))?);
                b.arg(&w.data).arg(&units_i).arg(tokens).arg(&n_i).arg(&mut out);
                // SAFETY: tokens were checked against the vocabulary (the weight's rows).
                unsafe { b.launch(grid_1d(n * units)) }?;
            }
            None => {
                let (ty, cols) = (w.ty.id() as i32, w.cols as i32);
                let mut b = self.stream.launch_builder(self.f("get_rows_float")?);
                b.arg(&ty).arg(&w.data).arg(&cols).arg(tokens).arg(&n_i).arg(&mut out);
                // SAFETY: as above.
                unsafe { b.launch(grid_1d(n * w.cols)) }?;
            }
        }
        Ok(out)
    }

    /// RMS norm of each of `x`'s rows of `weight.len()`, times `weight`.
    pub fn rms_norm(&self, x: &CudaSlice<f32>, weight: &CudaSlice<f32>, n_rows: usize, eps: f32) -> Result<CudaSlice<f32>, CudaError> {
        let cols = weight.len();
        let mut out = self.alloc(n_rows * cols)?;
        let cols_i = cols as i32;
        let mut b = self.stream.launch_builder(self.f("rms_norm")?);
        b.arg(x).arg(weight).arg(&mut out).arg(&cols_i).arg(&eps);
        let cfg = LaunchConfig { grid_dim: (n_rows as u32, 1, 1), block_dim: (NORM_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: x and out hold n_rows rows of cols.
        unsafe { b.launch(cfg) }?;
        Ok(out)
    }

    /// Whether a product of `n` activation rows with `w` runs the matrix-vector kernels on
    /// Q8_1 units (else cuBLAS, or the float kernels).
    pub fn takes_q8(&self, w: &GpuWeight, n: usize) -> bool {
        quant_suffix(w.ty).is_some() && (n <= self.mv_pass_rows || self.takes_mmq(w, n)) && w.cols.is_multiple_of(32)
    }

    /// Whether a product of `n` activation rows with `w` runs `mmq_*`: a quantised weight, a
    /// batch over the matrix-vector kernels' rows and within [`MQ_TOK`].
    fn takes_mmq(&self, w: &GpuWeight, n: usize) -> bool {
        self.mmq && quant_suffix(w.ty).is_some() && n > self.mv_pass_rows && n <= MQ_TOK && w.cols.is_multiple_of(32)
    }

    /// [`Launcher::rms_norm`] of `x`'s rows fused with what surrounds it in a decode layer, in
    /// one launch: with `add`, `x += add` first (the residual, written back); with `q8`, the
    /// normed rows' Q8_1 units as well (what [`Acts::with_q8`] takes; the rows must be whole
    /// units). Bit for bit the separate kernels.
    pub fn norm_fused(&self, x: &mut CudaSlice<f32>, add: Option<&CudaSlice<f32>>, weight: &CudaSlice<f32>, n_rows: usize, eps: f32, q8: bool) -> Result<(CudaSlice<f32>, Option<CudaSlice<u8>>), CudaError> {
        let cols = weight.len();
        debug_assert!(!q8 || cols.is_multiple_of(32));
        let mut out = self.alloc(n_rows * cols)?;
        // SAFETY: the kernel writes every unit of every row.
        let mut units = if q8 { Some(unsafe { self.stream.alloc::<u8>(n_rows * cols / 32 * Q8_1_BYTES) }?) } else { None };
        let cols_i = cols as i32;
        let (null_f, null_q) = (0u64, 0u64);
        let mut b = self.stream.launch_builder(self.f("rms_norm_fused")?);
        b.arg(x);
        match add {
            Some(y) => b.arg(y),
            None => b.arg(&null_f),
        };
        b.arg(weight).arg(&mut out);
        match units.as_mut() {
            Some(u) => b.arg(u),
            None => b.arg(&null_q),
        };
        b.arg(&cols_i).arg(&eps);
        let cfg = LaunchConfig { grid_dim: (n_rows as u32, 1, 1), block_dim: (NORM_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: x, add and out hold n_rows rows of cols; units (when asked) n_rows · cols / 32
        // Q8_1 units; a null pointer stands for a missing add or units, as the kernel expects.
        unsafe { b.launch(cfg) }?;
        Ok((out, units))
    }

    /// [`Launcher::silu_mul`] with `g`'s Q8_1 units made in the same launch (rows of whole
    /// units), for the down projection's matrix-vector product.
    pub fn silu_mul_q8(&self, g: &mut CudaSlice<f32>, u: &CudaSlice<f32>) -> Result<CudaSlice<u8>, CudaError> {
        let units = g.len() / 32;
        debug_assert!(g.len().is_multiple_of(32) && u.len() == g.len());
        // SAFETY: the kernel writes every unit.
        let mut q8 = unsafe { self.stream.alloc::<u8>(units * Q8_1_BYTES) }?;
        let units_i = units as i32;
        let mut b = self.stream.launch_builder(self.f("silu_mul_q8")?);
        b.arg(g).arg(u).arg(&mut q8).arg(&units_i);
        let cfg = LaunchConfig { grid_dim: ((units as u32).div_ceil(SILU_Q8_WARPS), 1, 1), block_dim: (32, SILU_Q8_WARPS, 1), shared_mem_bytes: 0 };
        // SAFETY: g and u hold units · 32 values; q8 has room for as many units.
        unsafe { b.launch(cfg) }?;
        Ok(q8)
    }

    /// A SiLU-gated MLP, `down(silu(gate(x)) · up(x))`, of `acts.n` rows (`ff` wide between
    /// the projections): SiLU·mul makes the down projection's Q8_1 units in the same launch
    /// where it takes the matrix-vector kernels. A dense layer's MLP and a hot expert's.
    pub fn silu_mlp(&self, gate: &GpuWeight, up: &GpuWeight, down: &GpuWeight, acts: &mut Acts<'_>, ff: usize) -> Result<CudaSlice<f32>, CudaError> {
        let n = acts.n;
        let [mut g, u] = self.linear_group([gate, up], acts)?;
        let units = match self.takes_q8(down, n) {
            true => Some(self.silu_mul_q8(&mut g, &u)?),
            false => {
                self.silu_mul(&mut g, &u)?;
                None
            }
        };
        self.linear(down, &mut Acts::with_q8(&g, n, ff, units))
    }

    /// RoPE in place on a batch's queries `q` and keys `k` (`[row][heads][head_dim]`, `q_heads`
    /// and `k_heads` a row) with the rows' (cos, sin) tables, in one launch: normal pairs, or
    /// NeoX's with `neox`.
    #[allow(clippy::too_many_arguments)] // the kernel's arguments, one each
    pub fn rope(&self, q: &mut CudaSlice<f32>, k: &mut CudaSlice<f32>, tables: &CudaSlice<f32>, n_rows: usize, q_heads: usize, k_heads: usize, head_dim: usize, n_rot: usize, neox: bool) -> Result<(), CudaError> {
        let (r, qh, kh, d, nr, nx) = (n_rows as i32, q_heads as i32, k_heads as i32, head_dim as i32, n_rot as i32, i32::from(neox));
        let mut b = self.stream.launch_builder(self.f("rope")?);
        b.arg(q).arg(k).arg(tables).arg(&r).arg(&qh).arg(&kh).arg(&d).arg(&nr).arg(&nx);
        // SAFETY: q holds n_rows * q_heads * head_dim, k n_rows * k_heads * head_dim; tables
        // n_rows * n_rot pairs' halves.
        unsafe { b.launch(grid_1d(n_rows * (q_heads + k_heads) * (n_rot / 2))) }?;
        Ok(())
    }

    /// `g = silu(g) * u`.
    pub fn silu_mul(&self, g: &mut CudaSlice<f32>, u: &CudaSlice<f32>) -> Result<(), CudaError> {
        let n = g.len();
        let mut b = self.stream.launch_builder(self.f("silu_mul")?);
        b.arg(g).arg(u).arg(&n);
        // SAFETY: g and u have the same length.
        unsafe { b.launch(grid_1d(n)) }?;
        Ok(())
    }

    /// `x += y`.
    pub fn add_assign(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<(), CudaError> {
        let n = x.len().min(y.len());
        let mut b = self.stream.launch_builder(self.f("add_assign")?);
        b.arg(x).arg(y).arg(&n);
        // SAFETY: both hold n elements.
        unsafe { b.launch(grid_1d(n)) }?;
        Ok(())
    }

    /// `bias` added to every row of `x` (rows of `bias.len()`).
    pub fn add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaSlice<f32>) -> Result<(), CudaError> {
        let (n, cols) = (x.len(), bias.len() as i32);
        let mut b = self.stream.launch_builder(self.f("add_bias")?);
        b.arg(x).arg(bias).arg(&n).arg(&cols);
        // SAFETY: x holds n elements, bias cols.
        unsafe { b.launch(grid_1d(n)) }?;
        Ok(())
    }

    /// The index of the largest value of each of `x`'s `n` rows of `cols` (the first on ties;
    /// as `sampler::argmax`).
    pub fn argmax_rows(&self, x: &CudaSlice<f32>, n: usize, cols: usize) -> Result<CudaSlice<u32>, CudaError> {
        // SAFETY: argmax_rows writes one index per row.
        let mut out = unsafe { self.stream.alloc::<u32>(n.max(1)) }?;
        let cols_i = cols as i32;
        let mut b = self.stream.launch_builder(self.f("argmax_rows")?);
        b.arg(x).arg(&cols_i).arg(&mut out);
        let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (ARGMAX_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: x holds n rows of cols.
        unsafe { b.launch(cfg) }?;
        Ok(out)
    }

    /// Rows `rows` of `x` (rows of `cols`), in that order.
    pub fn gather_rows(&self, x: &CudaSlice<f32>, rows: &[usize], cols: usize) -> Result<CudaSlice<f32>, CudaError> {
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.stream.clone_htod(&idx)?;
        self.gather_rows_at(x, &idx.as_view(), cols)
    }

    /// The rows `idx` (on the GPU) of `x`, rows of `cols`.
    pub fn gather_rows_at(&self, x: &CudaSlice<f32>, idx: &CudaView<'_, u32>, cols: usize) -> Result<CudaSlice<f32>, CudaError> {
        let mut out = self.alloc(idx.len() * cols)?;
        let (n, c) = (idx.len() as i32, cols as i32);
        let mut b = self.stream.launch_builder(self.f("gather_rows")?);
        b.arg(x).arg(idx).arg(&n).arg(&c).arg(&mut out);
        // SAFETY: the callers' rows are rows of x (checked against the batch when it started,
        // or a routed expert's rows of the layer's batch).
        unsafe { b.launch(grid_1d(idx.len() * cols)) }?;
        Ok(out)
    }

    /// Rows' K and V (`[row][n_kv_head · head_dim]`) of `layer` into the arenas the GPU
    /// maps, in place: row r's slot at `rows[r]`, its runs `strides[r]` bytes apart
    /// ([`crate::device::InPlaceRow`]), as f16 or (`q8`) Q8_0 blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_to_arena(&self, k: &CudaSlice<f32>, v: &CudaSlice<f32>, rows: &CudaSlice<u64>, strides: &CudaSlice<u64>, n_kv_head: usize, head_dim: usize, layer: usize, q8: bool) -> Result<(), CudaError> {
        let n = rows.len();
        debug_assert!(k.len() == n * n_kv_head * head_dim && v.len() == k.len() && strides.len() == n);
        let (h, d, l, q) = (n_kv_head as i32, head_dim as i32, layer as i32, i32::from(q8));
        let mut b = self.stream.launch_builder(self.f("kv_to_arena")?);
        b.arg(k).arg(v).arg(rows).arg(strides).arg(&h).arg(&d).arg(&l).arg(&q);
        let cfg = LaunchConfig { grid_dim: (n as u32, n_kv_head as u32, 2), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: k and v hold n rows of n_kv_head · head_dim; each row's address and stride
        // name its slot in an arena the GPU maps (`host_map`), whose runs of this layer lie
        // inside the arena (`ArenaLayout::slot_runs`); no two rows name one slot.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Rows of `layer` from the arenas the GPU maps into the KV mirror's `pool`: row r read at
    /// `rows[r]`, its runs `strides[r]` bytes apart ([`crate::device::InPlaceRow`]), f16 or
    /// (`q8`) Q8_0, stored at `slots[r]` (page · `page_size` + offset) as f16.
    #[allow(clippy::too_many_arguments)]
    pub fn arena_to_mirror(
        &self,
        rows: &CudaSlice<u64>,
        strides: &CudaSlice<u64>,
        slots: &CudaSlice<i32>,
        (n_kv_head, head_dim, layer, q8): (usize, usize, usize, bool),
        pool: &mut CudaSlice<u16>,
        page_elems: usize,
        page_size: usize,
    ) -> Result<(), CudaError> {
        let n = rows.len();
        debug_assert!(strides.len() == n && slots.len() == n);
        let (h, d, l, q, pe, ps) = (n_kv_head as i32, head_dim as i32, layer as i32, i32::from(q8), page_elems as i64, page_size as i32);
        let mut b = self.stream.launch_builder(self.f("arena_to_mirror")?);
        b.arg(rows).arg(strides).arg(slots).arg(&h).arg(&d).arg(&l).arg(&q).arg(pool).arg(&pe).arg(&ps);
        let cfg = LaunchConfig { grid_dim: (n as u32, n_kv_head as u32, 2), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: each row's address and stride name its slot in an arena the GPU maps, whose
        // runs of this layer lie inside the arena; every slot is a page of the pool.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `y[rows[j]] += w[j] * src[j]` for each row `j` of `src` (rows of `cols`); no two `j`
    /// may name one row of `y`.
    pub fn scatter_add_scaled(&self, src: &CudaSlice<f32>, rows: &CudaView<'_, u32>, w: &CudaView<'_, f32>, cols: usize, y: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        let (n, c) = (rows.len() as i32, cols as i32);
        let mut b = self.stream.launch_builder(self.f("scatter_add_scaled")?);
        b.arg(src).arg(rows).arg(w).arg(&n).arg(&c).arg(y);
        // SAFETY: src holds rows.len() rows of cols, w rows.len() weights, and every row
        // named is a row of y (the caller's routed rows of the layer's batch).
        unsafe { b.launch(grid_1d(rows.len() * cols)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::mmq_splits;

    #[test]
    fn mmq_splits_a_narrow_weights_units_until_the_gpu_has_two_blocks_a_multiprocessor() {
        // The 1B shape on an H200 (132 multiprocessors, 264 blocks wanted): K and V (512 rows:
        // 8 blocks, 64 units) and Q (2 048 rows: 32 blocks) in 8 splits of 8 units; the down
        // projection (256 units) in 8 of 32; the gate (8 192 rows) in 3 of 24; the LM head
        // (128 256 rows) whole.
        assert_eq!(mmq_splits(8, 64, 264), (8, 8));
        assert_eq!(mmq_splits(32, 64, 264), (8, 8));
        assert_eq!(mmq_splits(32, 256, 264), (32, 8));
        assert_eq!(mmq_splits(128, 64, 264), (24, 3));
        assert_eq!(mmq_splits(2004, 64, 264), (64, 1));
        // Every unit in exactly one split, whole stages of 4 a split, at least two stages.
        for (blocks, units) in [(1, 25), (3, 7), (64, 448), (1, 1), (7, 4096)] {
            let (per, splits) = mmq_splits(blocks, units, 264);
            assert!(per % 4 == 0 && per >= 4 && (splits - 1) * per < units && splits * per >= units, "{blocks} {units}: {per} x {splits}");
        }
    }
}
