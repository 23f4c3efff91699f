//! A float64 forward pass of a Llama model (RMSNorm, grouped-query attention with RoPE in
//! llama.cpp's normal pairing, SwiGLU), straight from the GGUF's dequantised weights: the
//! exact computation no device's rounding touches, for judging devices on models too big for
//! stored references (the CUDA device and the CPU device both against it). Checked against
//! the tiny models' numpy references (`tiny_llama_reference.rs`).

use std::path::Path;

use duet_kernels::ops::llama3_freq_factors;
use duet_kernels::quant::dequantize;
use duet_model::config::{LlamaConfig, RopeScaling};
use duet_model::gguf::GgufFile;
use rayon::prelude::*;

/// Logits of every position of `tokens` (row-major, `tokens.len() × n_vocab`), the
/// vocabulary size beside them.
pub fn logits(path: &Path, tokens: &[u32]) -> (Vec<f64>, usize) {
    let g = GgufFile::open(path).unwrap();
    let c = LlamaConfig::from_gguf(&g).unwrap();
    assert!(
        c.arch == "llama" && c.experts.is_none() && !c.rope_neox && c.embedding_scale == 1.0 && c.q_prescale == 1.0 && !c.post_norms,
        "the f64 forward computes plain Llama blocks only ({})",
        c.arch
    );
    let n = tokens.len();
    let (hd, n_rot) = (c.head_dim, c.n_rot);
    let (freq_scale, divisors) = match c.rope_scaling {
        RopeScaling::None => (1.0, vec![1.0; n_rot / 2]),
        RopeScaling::Linear { factor } => (1.0 / factor as f64, vec![1.0; n_rot / 2]),
        RopeScaling::FreqFactors => (1.0, vector(&g, "rope_freqs.weight")),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_context } => {
            (1.0, llama3_freq_factors(n_rot, c.rope_freq_base, factor, low_freq_factor, high_freq_factor, original_context).into_iter().map(f64::from).collect())
        }
        ref other => panic!("the f64 forward has no RoPE scaling {other:?}"),
    };
    let eps = c.rms_eps as f64;

    // The embedding rows of the tokens.
    let embd = g.tensor("token_embd.weight").unwrap();
    let row_bytes = embd.info.ty.row_bytes(c.n_embd);
    let mut x: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| {
            let mut row = vec![0f32; c.n_embd];
            dequantize(embd.info.ty, &embd.data[t as usize * row_bytes..][..row_bytes], &mut row).unwrap();
            row.into_iter().map(f64::from).collect()
        })
        .collect();

    for l in 0..c.n_layer {
        let w = |name: &str| format!("blk.{l}.{name}.weight");
        let h = rms_norm(&x, &vector(&g, &w("attn_norm")), eps);
        let (mut q, mut k, v) = (matmul(&g, &w("attn_q"), &h), matmul(&g, &w("attn_k"), &h), matmul(&g, &w("attn_v"), &h));
        for p in 0..n {
            rope(&mut q[p], hd, n_rot, p, c.rope_freq_base as f64, freq_scale, &divisors);
            rope(&mut k[p], hd, n_rot, p, c.rope_freq_base as f64, freq_scale, &divisors);
        }
        let attn = attention(&q, &k, &v, c.n_head, c.n_kv_head, hd);
        add(&mut x, &matmul(&g, &w("attn_output"), &attn));
        let h = rms_norm(&x, &vector(&g, &w("ffn_norm")), eps);
        let (gate, up) = (matmul(&g, &w("ffn_gate"), &h), matmul(&g, &w("ffn_up"), &h));
        let act: Vec<Vec<f64>> = gate.iter().zip(&up).map(|(g, u)| g.iter().zip(u).map(|(&a, &b)| a / (1.0 + (-a).exp()) * b).collect()).collect();
        add(&mut x, &matmul(&g, &w("ffn_down"), &act));
    }
    let h = rms_norm(&x, &vector(&g, "output_norm.weight"), eps);
    let head = if g.tensor_info("output.weight").is_some() { "output.weight" } else { "token_embd.weight" };
    let out = matmul(&g, head, &h);
    let n_vocab = out[0].len();
    (out.concat(), n_vocab)
}

/// A one-dimensional tensor (a norm's weight, RoPE divisors) as f64.
fn vector(g: &GgufFile, name: &str) -> Vec<f64> {
    let t = g.tensor(name).unwrap();
    let mut v = vec![0f32; t.info.n_elements() as usize];
    dequantize(t.info.ty, t.data, &mut v).unwrap();
    v.into_iter().map(f64::from).collect()
}

/// `W x` for every row of `x`: the weight dequantised a row at a time, rows in parallel.
fn matmul(g: &GgufFile, name: &str, x: &[Vec<f64>]) -> Vec<Vec<f64>> {
    let t = g.tensor(name).unwrap();
    let (cols, rows) = (t.info.dims[0] as usize, t.info.dims[1] as usize);
    assert!(x.iter().all(|r| r.len() == cols), "{name}: {cols} columns");
    let row_bytes = t.info.ty.row_bytes(cols);
    // out_t[r][p]: output r of position p.
    let out_t: Vec<Vec<f64>> = (0..rows)
        .into_par_iter()
        .map_init(
            || vec![0f32; cols],
            |buf, r| {
                dequantize(t.info.ty, &t.data[r * row_bytes..][..row_bytes], buf).unwrap();
                x.iter().map(|xp| buf.iter().zip(xp).map(|(&w, &v)| w as f64 * v).sum()).collect()
            },
        )
        .collect();
    (0..x.len()).map(|p| out_t.iter().map(|o| o[p]).collect()).collect()
}

fn rms_norm(x: &[Vec<f64>], w: &[f64], eps: f64) -> Vec<Vec<f64>> {
    x.iter()
        .map(|r| {
            let s = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / r.len() as f64 + eps).sqrt();
            r.iter().zip(w).map(|(v, w)| v * s * w).collect()
        })
        .collect()
}

/// llama.cpp's normal RoPE on each head of `x`: pairs (2i, 2i+1) of the first `n_rot`
/// dimensions turned by `pos · freq_scale · base^(-2i/n_rot) / divisor_i`.
fn rope(x: &mut [f64], hd: usize, n_rot: usize, pos: usize, base: f64, freq_scale: f64, divisors: &[f64]) {
    for head in x.chunks_exact_mut(hd) {
        for i in 0..n_rot / 2 {
            let theta = pos as f64 * freq_scale * base.powf(-2.0 * i as f64 / n_rot as f64) / divisors[i];
            let (s, c) = theta.sin_cos();
            let (a, b) = (head[2 * i], head[2 * i + 1]);
            head[2 * i] = a * c - b * s;
            head[2 * i + 1] = a * s + b * c;
        }
    }
}

/// Causal softmax attention, query head `h` reading key/value head `h / (n_head / n_kv_head)`.
fn attention(q: &[Vec<f64>], k: &[Vec<f64>], v: &[Vec<f64>], n_head: usize, n_kv_head: usize, hd: usize) -> Vec<Vec<f64>> {
    let group = n_head / n_kv_head;
    let scale = 1.0 / (hd as f64).sqrt();
    (0..q.len())
        .map(|p| {
            let mut out = vec![0.0; n_head * hd];
            for h in 0..n_head {
                let kh = h / group;
                let qh = &q[p][h * hd..][..hd];
                let scores: Vec<f64> = (0..=p).map(|j| qh.iter().zip(&k[j][kh * hd..][..hd]).map(|(a, b)| a * b).sum::<f64>() * scale).collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for (o, vv) in out[h * hd..][..hd].iter_mut().zip(&v[j][kh * hd..][..hd]) {
                        *o += ej / sum * vv;
                    }
                }
            }
            out
        })
        .collect()
}

fn add(x: &mut [Vec<f64>], y: &[Vec<f64>]) {
    for (a, b) in x.iter_mut().zip(y) {
        for (u, v) in a.iter_mut().zip(b) {
            *u += v;
        }
    }
}
