//! Quantised matrix products: weight matrix (rows of ggml blocks) times a batch of activation
//! rows, threads split by output rows with rayon, each thread's weight rows reused across the
//! whole batch while they sit in cache.

use std::ops::Range;

use rayon::prelude::*;

use super::dot::{quantize_row, vec_dot_type};
use super::interleaved::{GroupActs, Interleaved, GROUP_ROWS};
use super::quant::GgmlType;
use super::{vec_dot, vec_dot_r4, vec_dot_x4};

/// A weight matrix borrowed from the model file: `rows` rows of `cols` elements of type `ty`,
/// and maybe a copy repacked for faster kernels (the products use it when present).
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    interleaved: Option<&'a Interleaved>,
}

impl<'a> QMatrix<'a> {
    /// Panics if `data` is not `rows` rows of `cols` elements (checked by the loader).
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Self {
        assert_eq!(data.len(), rows * ty.row_bytes(cols), "QMatrix size");
        QMatrix {
            ty,
            rows,
            cols,
            data,
            interleaved: None,
        }
    }

    /// The same matrix with its rows also interleaved (`packed`, made from `data`), which
    /// the products then read instead. Panics if `packed` is not this matrix's shape.
    pub fn with_interleaved(self, packed: &'a Interleaved) -> Self {
        assert!(
            packed.ty() == self.ty && packed.rows() == self.rows && packed.cols() == self.cols,
            "interleaved copy of another matrix"
        );
        QMatrix {
            interleaved: Some(packed),
            ..self
        }
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.ty.row_bytes(self.cols);
        &self.data[r * rb..(r + 1) * rb]
    }
}

/// A batch of activation rows quantised to the vec-dot type of some weight type.
#[derive(Debug, Clone)]
pub struct QuantizedActs {
    pub ty: GgmlType,
    pub cols: usize,
    pub n_rows: usize,
    pub data: Vec<u8>,
}

impl QuantizedActs {
    /// Quantises `x` (`x.len() / cols` rows) for multiplication with weights of `weight_ty`.
    pub fn new(weight_ty: GgmlType, x: &[f32], cols: usize) -> Self {
        let ty = vec_dot_type(weight_ty);
        let rb = ty.row_bytes(cols);
        let n_rows = x.len() / cols;
        let mut data = vec![0u8; rb * n_rows];
        data.par_chunks_mut(rb).zip(x.par_chunks(cols)).for_each(|(o, x)| quantize_row(ty, x, o));
        QuantizedActs { ty, cols, n_rows, data }
    }

    pub fn row(&self, t: usize) -> &[u8] {
        let rb = self.ty.row_bytes(self.cols);
        &self.data[t * rb..(t + 1) * rb]
    }
}

/// The most weight rows one task of [`matmul_many`] takes.
const MAX_TASK_ROWS: usize = 256;

/// `out[t * w.rows + r] = w.row(r) · x.row(t)` for every row `r` and batch row `t`.
pub fn matmul(w: &QMatrix<'_>, x: &QuantizedActs, out: &mut [f32]) {
    matmul_many(&[*w], x, &mut [out]);
}

/// [`matmul`] of several weight matrices with the same input (a layer's Q, K and V
/// projections; its gate and up projections), in one parallel loop over all their rows:
/// `outs[i][t * ws[i].rows + r] = ws[i].row(r) · x.row(t)`. One loop instead of several
/// matters at batch 1, where a projection is a few microseconds of work.
pub fn matmul_many(ws: &[QMatrix<'_>], x: &QuantizedActs, outs: &mut [&mut [f32]]) {
    assert_eq!(ws.len(), outs.len(), "one output per weight matrix");
    for (w, out) in ws.iter().zip(outs.iter()) {
        assert_eq!(x.ty, vec_dot_type(w.ty), "activations quantised for another weight type");
        assert_eq!(x.cols, w.cols, "matmul inner dimension");
        assert_eq!(out.len(), w.rows * x.n_rows, "matmul output size");
    }
    let outs: Vec<SyncPtr> = outs.iter_mut().map(|o| SyncPtr(o.as_mut_ptr())).collect();
    let threads = rayon::current_num_threads();
    let tasks: Vec<(usize, Range<usize>)> = ws
        .iter()
        .enumerate()
        .flat_map(|(i, w)| {
            let mut chunk = (w.rows / (threads * 8)).clamp(8, MAX_TASK_ROWS);
            if w.interleaved.is_some() {
                // Whole groups of interleaved rows.
                chunk = chunk.next_multiple_of(GROUP_ROWS);
            }
            (0..w.rows.div_ceil(chunk)).map(move |c| (i, c * chunk..((c + 1) * chunk).min(w.rows)))
        })
        .collect();
    // The interleaved matrices (where this CPU has their kernels) take their own kernels; the
    // others' path is chosen by their types.
    let packed: Vec<Option<&Interleaved>> = ws
        .iter()
        .map(|w| w.interleaved.filter(|p| super::interleaved::available() && super::interleaved::packs(p.ty())))
        .collect();
    let rows_layout = || {
        ws.iter()
            .zip(&packed)
            .filter(|(_, p)| p.is_none())
            .map(|(w, _)| w)
    };
    #[cfg(target_arch = "x86_64")]
    let avx512 = super::isa() == super::Isa::Avx512 && rows_layout().next().is_some();
    #[cfg(target_arch = "x86_64")]
    let paired = (avx512
        && x.n_rows >= 2
        && rows_layout().all(|w| matches!(w.ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)))
    .then(|| {
        let nb = x.cols / rows_layout().next().expect("one").ty.block_size();
        // SAFETY: AVX-512 was detected (`isa()`); `x.data` is `n_rows` rows of `nb` blocks.
        unsafe { super::matmul_avx512::PairedActs::new(x.ty, &x.data, x.n_rows, nb) }
    });
    #[cfg(target_arch = "x86_64")]
    let k_tiles = (avx512
        && x.n_rows >= super::matmul_k_avx512::MIN_PARTIAL
        && rows_layout().all(|w| matches!(w.ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K)))
    .then(|| {
        let nb = x.cols / GgmlType::Q8K.block_size();
        // SAFETY: AVX-512 was detected (`isa()`); `x.data` is `n_rows` rows of `nb` blocks.
        unsafe { super::matmul_k_avx512::KTileActs::new(&x.data, x.n_rows, nb) }
    });
    // The interleaved kernels' activations, once for every task.
    let group_acts = packed.iter().any(Option::is_some).then(|| GroupActs::new(x.ty, (0..x.n_rows).map(|t| x.row(t)).collect()));
    tasks.into_par_iter().for_each(|(i, rows)| {
        let (w, out) = (&ws[i], outs[i]);
        #[cfg(target_arch = "x86_64")]
        {
            if let (Some(packed), Some(acts)) = (packed[i], &group_acts) {
                let groups = rows.start / GROUP_ROWS..rows.end / GROUP_ROWS;
                // SAFETY: `out` is this weight's output of `x.n_rows` rows of `w.rows` floats
                // (asserted above); each task writes only its own groups' rows.
                unsafe {
                    super::interleaved::matmul_groups(packed, groups, acts, out.get(), w.rows)
                };
                return;
            }
            if let Some(acts) = &paired {
                return paired_rows(w, x.n_rows, acts, rows, out);
            }
            if let Some(acts) = &k_tiles {
                return k_tile_rows(w, x, acts, rows, out);
            }
        }
        plain_rows(w, x, 0, rows, out)
    });
}

/// Rows `rows` of `w` against the activation rows from `t0` on, into `out` (`[t][w.rows]`).
fn plain_rows(w: &QMatrix<'_>, x: &QuantizedActs, t0: usize, rows: Range<usize>, out: SyncPtr) {
    // SAFETY (every write): each task writes only its own rows `r` of every batch row `t`,
    // so the indices `t * w.rows + r` of different tasks never overlap; in bounds by the
    // size assertions of `matmul_many`.
    let write = |t: usize, r: usize, v: f32| unsafe { *out.get().add(t * w.rows + r) = v };
    let mut t = t0;
    // Four batch rows at a time: same bits as one at a time, weight blocks unpacked once.
    while t + 4 <= x.n_rows {
        let a = [x.row(t), x.row(t + 1), x.row(t + 2), x.row(t + 3)];
        for r in rows.clone() {
            let v = vec_dot_x4(w.ty, w.cols, w.row(r), a);
            for (i, &v) in v.iter().enumerate() {
                write(t + i, r, v);
            }
        }
        t += 4;
    }
    for t in t..x.n_rows {
        let a = x.row(t);
        // Four weight rows at a time (same bits as one at a time), the rest one by one.
        let mut r = rows.start;
        while r + 4 <= rows.end {
            let v = vec_dot_r4(w.ty, w.cols, [w.row(r), w.row(r + 1), w.row(r + 2), w.row(r + 3)], a);
            for (i, &v) in v.iter().enumerate() {
                write(t, r + i, v);
            }
            r += 4;
        }
        for r in r..rows.end {
            write(t, r, vec_dot(w.ty, w.cols, w.row(r), a));
        }
    }
}

/// [`plain_rows`] with the AVX-512 tile kernels over activation rows regrouped in pairs
/// (same bits as `vec_dot`): every tile of sixteen activation rows for the task's weight rows,
/// into a buffer (one vector of results per weight row) copied out to each batch row as one
/// contiguous run. Stored straight into the output, a weight row's sixteen results went to
/// sixteen rows a whole output row apart (for the vocabulary, 192 KiB apart: one cache set).
#[cfg(target_arch = "x86_64")]
fn paired_rows(w: &QMatrix<'_>, n_rows: usize, acts: &super::matmul_avx512::PairedActs, rows: Range<usize>, out: SyncPtr) {
    use super::matmul_avx512 as k;
    let kernel: k::RowsTileKernel = match (w.ty, super::has_vnni()) {
        (GgmlType::Q4_1, true) => k::q4_1_rows_tile_vnni,
        (GgmlType::Q4_1, false) => k::q4_1_rows_tile,
        (GgmlType::Q4_0, true) => k::q4_0_rows_tile_vnni,
        (GgmlType::Q4_0, false) => k::q4_0_rows_tile,
        (_, true) => k::q8_0_rows_tile_vnni,
        (_, false) => k::q8_0_rows_tile,
    };
    with_tile_buf(rows.len(), |buf| paired_tiles(w, n_rows, acts, rows, out, kernel, buf));
}

/// Runs `f` with this thread's buffer of tile results (one vector per weight row), `len` long;
/// the kernels write every row of it before it is read.
#[cfg(target_arch = "x86_64")]
fn with_tile_buf(len: usize, f: impl FnOnce(&mut [[f32; super::matmul_avx512::TILE]])) {
    use super::matmul_avx512::TILE;
    thread_local! {
        // Reused by every task on this thread (a fresh buffer per task showed up in profiles:
        // 16 KiB cleared on the stack, or an allocation and a free).
        static TILE_OUT: std::cell::RefCell<Vec<[f32; TILE]>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    TILE_OUT.with_borrow_mut(|buf| {
        buf.resize(len, [0.0; TILE]);
        f(buf)
    });
}

/// Results `buf` (one vector per weight row of `rows`) of the activation rows `t0..t0 +
/// in_tile` into `out` (`[t][w_rows]`), each activation row's as one contiguous run.
#[cfg(target_arch = "x86_64")]
fn store_tile(out: SyncPtr, w_rows: usize, rows: &Range<usize>, t0: usize, in_tile: usize, buf: &[[f32; super::matmul_avx512::TILE]]) {
    for i in 0..in_tile {
        // SAFETY: as in `plain_rows` — this task's rows only, in bounds.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.get().add((t0 + i) * w_rows + rows.start), rows.len()) };
        for (d, b) in dst.iter_mut().zip(buf.iter()) {
            *d = b[i];
        }
    }
}

/// Every tile of `acts` for `rows` of `w` through `kernel`, via `buf` (`rows.len()` results).
#[cfg(target_arch = "x86_64")]
fn paired_tiles(
    w: &QMatrix<'_>,
    n_rows: usize,
    acts: &super::matmul_avx512::PairedActs,
    rows: Range<usize>,
    out: SyncPtr,
    kernel: super::matmul_avx512::RowsTileKernel,
    buf: &mut [[f32; super::matmul_avx512::TILE]],
) {
    use super::matmul_avx512::TILE;
    let rb = w.ty.row_bytes(w.cols);
    for tile in 0..acts.n_tiles() {
        let t0 = tile * TILE;
        let in_tile = (n_rows - t0).min(TILE);
        // SAFETY: the kernel's CPU features were detected; the rows have the acts' blocks.
        unsafe { kernel(&w.data[rows.start * rb..rows.end * rb], rb, acts, tile, in_tile, buf) };
        store_tile(out, w.rows, &rows, t0, in_tile, buf);
    }
}

/// [`plain_rows`] with the AVX-512 Q4_K / Q5_K / Q6_K tile kernels for the tiles of
/// activation rows (`acts`, the last one maybe padded; results via a buffer as in
/// [`paired_rows`]), plain dot products for the rows no tile holds.
#[cfg(target_arch = "x86_64")]
fn k_tile_rows(w: &QMatrix<'_>, x: &QuantizedActs, acts: &super::matmul_k_avx512::KTileActs, rows: Range<usize>, out: SyncPtr) {
    use super::matmul_avx512::TILE;
    use super::matmul_k_avx512 as k;
    let kernel: k::KTileKernel = match (w.ty, super::has_vnni()) {
        (GgmlType::Q6K, true) => k::q6k_rows_tile_vnni,
        (GgmlType::Q6K, false) => k::q6k_rows_tile,
        (GgmlType::Q5K, true) => k::q5k_rows_tile_vnni,
        (GgmlType::Q5K, false) => k::q5k_rows_tile,
        (_, true) => k::q4k_rows_tile_vnni,
        (_, false) => k::q4k_rows_tile,
    };
    let rb = w.ty.row_bytes(w.cols);
    with_tile_buf(rows.len(), |buf| {
        for tile in 0..acts.n_tiles() {
            // SAFETY: the kernel's CPU features were detected; the rows have the acts' blocks.
            unsafe { kernel(&w.data[rows.start * rb..rows.end * rb], rb, acts, tile, buf) };
            // The last tile may be padded with zero rows: only the real ones are stored.
            store_tile(out, w.rows, &rows, tile * TILE, (x.n_rows - tile * TILE).min(TILE), buf);
        }
    });
    plain_rows(w, x, (acts.n_tiles() * TILE).min(x.n_rows), rows, out);
}

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: used only for disjoint writes (see `plain_rows`).
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}
