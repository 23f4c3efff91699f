//! Linear layers and the gated MLP over quantised weights, `down(act(gate(x)) ⊙ up(x))`: the
//! dense MLP of a layer and each routed expert of a mixture, the same code wherever it runs
//! (the CPU device, a cpu-worker serving expert jobs), so both compute the same bits.

use rayon::prelude::*;

use crate::dot::vec_dot_type;
use crate::matmul::{matmul, matmul_many, QMatrix, QuantizedActs};

/// The gate activation times up, in place in `gate` (`ops::silu_mul`, `ops::gelu_mul`).
pub type GateAct = fn(&mut [f32], &[f32]);

/// `x` (rows of `w.cols`) times `w`: rows of `w.rows`.
pub fn linear(w: &QMatrix<'_>, x: &[f32]) -> Vec<f32> {
    let acts = QuantizedActs::new(w.ty, x, w.cols);
    let mut out = vec![0f32; acts.n_rows * w.rows];
    matmul(w, &acts, &mut out);
    out
}

/// `x` times each of `ws` (same input width): the input quantised once and one parallel
/// loop for all when the weights share an activation type, else one [`linear`] each. Same
/// results either way.
pub fn linear_many<const N: usize>(ws: [&QMatrix<'_>; N], x: &[f32]) -> [Vec<f32>; N] {
    let act_ty = vec_dot_type(ws[0].ty);
    if ws.iter().any(|w| vec_dot_type(w.ty) != act_ty) {
        return ws.map(|w| linear(w, x));
    }
    let acts = QuantizedActs::new(ws[0].ty, x, ws[0].cols);
    let mut outs = ws.map(|w| vec![0f32; acts.n_rows * w.rows]);
    let mats: Vec<QMatrix<'_>> = ws.iter().map(|w| **w).collect();
    let mut views: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
    matmul_many(&mats, &acts, &mut views);
    outs
}

/// `down(act(gate(x)) * up(x))` of rows `x`.
pub fn gated_mlp([gate, up, down]: [&QMatrix<'_>; 3], act: GateAct, x: &[f32]) -> Vec<f32> {
    let [mut g, u] = linear_many([gate, up], x);
    g.par_chunks_mut(gate.rows).zip(u.par_chunks(up.rows)).for_each(|(g, u)| act(g, u));
    linear(down, &g)
}

/// An expert's output row times its router weight: what a row of a mixture adds up,
/// computed the same wherever the expert ran (the CPU device, a cpu-worker).
pub fn scaled(o: &[f32], w: f32) -> Vec<f32> {
    o.iter().map(|&v| v * w).collect()
}
