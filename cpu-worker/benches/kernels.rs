//! Kernel benchmark: the machine's read bandwidth (a STREAM-like sum in the same run, before
//! and after the kernels), the
//! cpu-worker's decode attention over f16 and q8_0 caches (GB/s of KV read, and its fraction of that bandwidth) at
//! contexts 1K/4K/16K × batches 1/8/32, and the quantised matrix-vector product of every
//! weight type (GB/s of weights), and an OLMoE-shaped layer's routed experts at 16 sessions.
//! One table on stdout.
//!
//! `cargo bench -p duet-cpu-worker --bench kernels [-- --threads N] [--quick] [--only WHAT]`

use std::time::{Duration, Instant};

use duet_kernels::interleaved::{self, Interleaved};
use duet_kernels::matmul::{matmul, matmul_many, QMatrix, QuantizedActs};
use duet_kernels::quant::GgmlType;
use duet_kv::{ArenaLayout, BlockId, KvDtype};
use duet_kv::shm::job::{AttnJob, SeqJob};
use duet_cpu_worker::serve::attend_job;
use half::f16;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

/// Attention shapes of the decode rows: query heads, KV heads, head size.
#[derive(Clone, Copy)]
struct AttnBench {
    n_head: u32,
    n_kv_head: u32,
    head_dim: u32,
}

/// SmolLM2-135M's (9 query heads, 3 KV heads of 64), Llama-3.2-1B's (32 and 8 of 64),
/// Llama-3.1-8B's (32 and 8 of 128) and OLMoE's (16 and 16 of 128: each K/V row read feeds
/// one query). The 1B and 8B shapes differ only in the head size: a position's bytes grow
/// with it, its scores and softmax weights do not (docs/kernels.md, "The simulator's CPU
/// attention").
const ATTENTION_SHAPES: [AttnBench; 4] = [
    AttnBench { n_head: 9, n_kv_head: 3, head_dim: 64 },
    AttnBench { n_head: 32, n_kv_head: 8, head_dim: 64 },
    AttnBench { n_head: 32, n_kv_head: 8, head_dim: 128 },
    AttnBench { n_head: 16, n_kv_head: 16, head_dim: 128 },
];
const BLOCK: u32 = duet_kv::layout::DEFAULT_BLOCK_SIZE;

struct Args {
    threads: usize,
    quick: bool,
    /// Only the rows whose "what" contains this (e.g. `attention`, `Q4_1`).
    only: Option<String>,
}

fn args() -> Args {
    let mut a = Args { threads: 2, quick: false, only: None };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--threads" => a.threads = it.next().and_then(|v| v.parse().ok()).expect("--threads N"),
            "--quick" => a.quick = true,
            "--only" => a.only = it.next(),
            _ => {} // cargo bench passes --bench
        }
    }
    a
}

/// Best time of `f` over `reps` runs after one warm-up.
fn best(reps: usize, mut f: impl FnMut()) -> Duration {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

/// GB/s of each of 9 passes (after an untimed one) of a parallel sum over 1 GiB of f32 (512
/// MiB with --quick). This machine's (a VM's) bandwidth varies between passes by up to 1.7×:
/// the kernels' fractions are of its best pass (what it can do at its best, as each kernel row
/// is its best run); a rate averaged over seconds, as batch-1 decode's tok/s in
/// `scripts/bench.py`, is also set against the median pass.
fn read_bandwidth_passes(quick: bool) -> Vec<f64> {
    let n = if quick { 128 << 20 } else { 256 << 20 };
    let data: Vec<f32> = (0..n).into_par_iter().map(|i| (i % 7) as f32).collect();
    let sum = || {
        let s: f32 = data.par_chunks(1 << 16).map(sum_lanes).sum();
        std::hint::black_box(s);
    };
    sum();
    (0..9)
        .map(|_| {
            let t = Instant::now();
            sum();
            (n * 4) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .collect()
}

/// The largest of `v` (GB/s).
fn fastest(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

/// Sum of `c` in 32 independent lanes (the adds vectorise and never wait on each other, so
/// the loop is bound by memory), with the widest vectors this CPU has, and the data prefetched
/// 8 KiB ahead as the matrix-vector kernels do (without it the sum read 20–40 % slower than
/// those kernels: a bandwidth it is not a fair fraction of).
fn sum_lanes(c: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was detected.
        return unsafe { sum_lanes_avx512(c) };
    }
    sum_lanes_body(c, |_| {})
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_lanes_avx512(c: &[f32]) -> f32 {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    sum_lanes_body(c, |p| {
        // A prefetch never faults, wherever it points.
        let ahead = p.wrapping_add(2048).cast::<i8>();
        _mm_prefetch::<_MM_HINT_T0>(ahead);
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
    })
}

#[inline(always)]
fn sum_lanes_body(c: &[f32], prefetch: impl Fn(*const f32)) -> f32 {
    let mut acc = [0f32; 32];
    for block in c.chunks_exact(32) {
        prefetch(block.as_ptr());
        for (a, &x) in acc.iter_mut().zip(block) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>()
}

/// Layers of the benchmark arena: each timed run attends the next, so that the KV it reads
/// is not still in the cache from the run before (64 MiB at least is cycled through).
fn layers_for(bytes_per_layer: usize) -> u32 {
    (64usize << 20).div_ceil(bytes_per_layer).clamp(2, 64) as u32
}

/// GB/s of KV read by one layer's attention job: `batch` sequences of `context` positions, the
/// cache in `dtype` (f16 or q8_0; the bytes read are the type's).
fn attention(shape: AttnBench, dtype: KvDtype, batch: usize, context: usize, rng: &mut rand::rngs::StdRng) -> f64 {
    let AttnBench { n_head, n_kv_head, head_dim } = shape;
    let blocks_per_seq = context.div_ceil(BLOCK as usize);
    let row = dtype.row_bytes(head_dim as usize).expect("heads of whole blocks");
    let bytes = batch * context * n_kv_head as usize * row * 2;
    let n_layer = layers_for(bytes);
    let layout = ArenaLayout {
        n_layer,
        n_kv_head,
        head_dim,
        block_size: BLOCK,
        dtype,
        n_blocks: (batch * blocks_per_seq) as u32,
    };
    let total = layout.total_bytes().expect("layout");
    // Small finite f16 values everywhere: a Q8_0 block's scale (at an even offset) is one.
    let mut arena = vec![f16::ZERO; total / 2];
    arena.par_chunks_mut(4096).enumerate().for_each(|(i, c)| {
        for (j, x) in c.iter_mut().enumerate() {
            *x = f16::from_f32((((i * 4096 + j) * 2654435761) % 1000) as f32 / 1000.0 - 0.5);
        }
    });
    let seqs = (0..batch)
        .map(|s| SeqJob {
            start: 0,
            end: context as u32,
            n_ctx: context as u32,
            first_pos: 0,
            blocks: (0..blocks_per_seq).map(|b| BlockId((s * blocks_per_seq + b) as u32)).collect(),
            q: (0..n_head * head_dim).map(|_| rng.random_range(-1.0..1.0)).collect(),
        })
        .collect();
    let mut job = AttnJob { layer: 0, n_head, n_kv_head, head_dim, kv_padding: 32, softcap: None, seqs };
    let t = best(5, || {
        job.layer = (job.layer + 1) % n_layer;
        std::hint::black_box(attend_job(&job, arena.as_slice(), &layout));
    });
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// G multiply-adds/s of one layer's causal attention of `n_tok` prompt tokens after `pos0`
/// cached positions (f16 K/V, the dispatched kernels), the best of 3 runs.
fn prompt_attention(shape: AttnBench, pos0: usize, n_tok: usize, rng: &mut rand::rngs::StdRng) -> f64 {
    use duet_kernels::attention::{AttnShape, KvHead, KvRows};
    let AttnBench { n_head, n_kv_head, head_dim } = shape;
    let (n_head, n_kv, hd) = (n_head as usize, n_kv_head as usize, head_dim as usize);
    let n_ctx = pos0 + n_tok;
    let rows: Vec<(Vec<f16>, Vec<f16>)> = (0..n_kv)
        .map(|_| {
            let mut row = || (0..n_ctx * hd).map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0))).collect::<Vec<f16>>();
            (row(), row())
        })
        .collect();
    let kv: Vec<KvHead<'_>> = rows.iter().map(|(k, v)| KvHead { k: KvRows::F16(k), v: KvRows::F16(v) }).collect();
    let attn = AttnShape { n_head, n_kv_head: n_kv, head_dim: hd, softcap: None };
    let q: Vec<f32> = (0..n_tok * n_head * hd).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut out = vec![0f32; q.len()];
    let t = best(3, || duet_kernels::causal::causal_attention(&q, &kv, attn, pos0, &mut out));
    let positions: usize = (0..n_tok).map(|t| pos0 + t + 1).sum();
    (2 * positions * n_head * hd) as f64 / t.as_secs_f64() / 1e9
}

/// GB/s of weights streamed by one matrix-vector product with `cols` columns and as many
/// rows as make `mib` MiB (256: well past the last-level cache; 8: held in L3, the kernel's
/// compute ceiling, which must stay well above the DRAM's read bandwidth).
/// With `interleave`, a matrix of a packed type is also repacked into interleaved groups (as
/// the CPU device does at load) and multiplied through them.
fn matvec(ty: GgmlType, cols: usize, mib: usize, interleave: bool, rng: &mut rand::rngs::StdRng) -> f64 {
    let rows = (mib << 20) / ty.row_bytes(cols);
    let bytes = ty.row_bytes(cols) * rows;
    let mut data = vec![0u8; bytes];
    rng.fill(data.as_mut_slice());
    if matches!(ty, GgmlType::F16 | GgmlType::BF16 | GgmlType::F32) {
        // Random bytes would hold NaNs and subnormals: small finite values instead.
        data.iter_mut().skip(1).step_by(2).for_each(|b| *b &= 0x3b);
    }
    let rows = rows / 16 * 16;
    let bytes = ty.row_bytes(cols) * rows;
    let data = &data[..bytes];
    let packed = interleave
        .then(|| Interleaved::new(ty, rows, cols, data).expect("a packed type, whole groups"));
    let mut w = QMatrix::new(ty, rows, cols, data);
    if let Some(p) = &packed {
        w = w.with_interleaved(p);
    }
    let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
    let acts = QuantizedActs::new(ty, &x, cols);
    let mut out = vec![0f32; rows];
    let t = best(if mib <= 32 { 50 } else { 5 }, || matmul(&w, &acts, &mut out));
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// A random Q4_K matrix (finite f16 scales: the exponent's top bits of d and dmin cleared)
/// and its interleaved copy.
fn random_q4_k(rows: usize, cols: usize, rng: &mut rand::rngs::StdRng) -> (Vec<u8>, Interleaved) {
    let ty = GgmlType::Q4K;
    let mut data = vec![0u8; rows * ty.row_bytes(cols)];
    rng.fill(data.as_mut_slice());
    for block in data.chunks_exact_mut(ty.block_bytes()) {
        block[1] &= 0x3b;
        block[3] &= 0x3b;
    }
    let packed = Interleaved::new(ty, rows, cols, &data).expect("whole groups");
    (data, packed)
}

/// GB/s of the products of 16 Llama-3.2-1B-shaped layers (Q/K/V together, O, gate and up
/// together, down; all Q4_K interleaved) with one activation row, and of a parallel sum over
/// the same number of bytes, timed alternately: the best of 7 of each. The products run
/// inside the pool, as a gpu-worker's step does: from the main thread each would be injected
/// into the pool and its end would wake the main thread, which measured 75–84 % of the sum
/// against 88–95 % inside (2026-11-30, alternating).
fn layer_stack(rng: &mut rand::rngs::StdRng) -> (f64, f64) {
    let (width, ffn, kv) = (2048usize, 8192usize, 512usize);
    let shapes = [(width, width), (kv, width), (kv, width), (width, width), (ffn, width), (ffn, width), (width, ffn)];
    let ty = GgmlType::Q4K;
    let layers: Vec<Vec<(Vec<u8>, Interleaved)>> = (0..16)
        .map(|_| {
            shapes
                .iter()
                .map(|&(rows, cols)| random_q4_k(rows, cols, rng))
                .collect()
        })
        .collect();
    let bytes: usize = layers.iter().flatten().map(|(d, _)| d.len()).sum();
    let acts = |cols: usize| {
        let x: Vec<f32> = (0..cols).map(|i| ((i * 7919) % 200) as f32 / 100.0 - 1.0).collect();
        QuantizedActs::new(ty, &x, cols)
    };
    let (x_width, x_ffn) = (acts(width), acts(ffn));
    let mut outs: Vec<Vec<f32>> = shapes.iter().map(|&(rows, _)| vec![0f32; rows]).collect();
    let mut pass = || {
        rayon::scope(|_| {
            for layer in &layers {
                let m: Vec<QMatrix<'_>> = layer.iter().zip(shapes).map(|((d, p), (r, c))| QMatrix::new(ty, r, c, d).with_interleaved(p)).collect();
                let [q, k, v, o, gate, up, down] = &mut outs[..] else { unreachable!() };
                matmul_many(&m[0..3], &x_width, &mut [q.as_mut_slice(), k.as_mut_slice(), v.as_mut_slice()]);
                matmul(&m[3], &x_width, o);
                matmul_many(&m[4..6], &x_width, &mut [gate.as_mut_slice(), up.as_mut_slice()]);
                matmul(&m[6], &x_ffn, down);
            }
        })
    };
    pass();
    against_a_sum(bytes, 7, |_| pass())
}

/// GB/s of `work(i)` for passes `i` in `0..passes` reading `bytes`, and of a plain parallel
/// f32 sum over as many bytes, timed alternately (this VM's bandwidth drifts between
/// phases): the best pass of each. The caller warms `work` up first.
fn against_a_sum(bytes: usize, passes: usize, mut work: impl FnMut(usize)) -> (f64, f64) {
    let plain: Vec<f32> = vec![0.5; bytes / 4];
    let sum = || {
        let s: f32 = plain.par_chunks(1 << 16).map(sum_lanes).sum();
        std::hint::black_box(s);
    };
    let (mut best_work, mut best_sum) = (Duration::MAX, Duration::MAX);
    for i in 0..passes {
        let t = Instant::now();
        work(i);
        best_work = best_work.min(t.elapsed());
        let t = Instant::now();
        sum();
        best_sum = best_sum.min(t.elapsed());
    }
    let gbs = |t: Duration| bytes as f64 / t.as_secs_f64() / 1e9;
    (gbs(best_work), gbs(best_sum))
}

/// GB/s of the routed experts of one OLMoE-1B-7B-shaped layer at `tokens` sessions, as a
/// cpu-worker's expert job computes them (`duet_cpu_worker::experts::compute`): 64 experts of
/// SiLU-gated MLPs (width 2048, FFN 1024, Q4_K interleaved), each token routed to 8 (the
/// same random routing every pass; at 16 tokens ~56 distinct experts, 1–6 rows each). GB/s of
/// the distinct experts' bytes, against a plain sum over as many bytes timed alternately with
/// it. Four layers in turn, so that no pass finds its experts in cache.
fn expert_layer(tokens: usize, rng: &mut rand::rngs::StdRng) -> (f64, f64) {
    let (width, ffn, n_expert, top_k, layers) = (2048usize, 1024usize, 64usize, 8usize, 4usize);
    let ty = GgmlType::Q4K;
    // An expert's gate, up and down matrices: (bytes, interleaved copy, rows, columns) each.
    type Expert = [(Vec<u8>, Interleaved, usize, usize); 3];
    let matrix = |rows: usize, cols: usize, rng: &mut rand::rngs::StdRng| {
        let (data, packed) = random_q4_k(rows, cols, rng);
        (data, packed, rows, cols)
    };
    let experts: Vec<Vec<Expert>> =
        (0..layers).map(|_| (0..n_expert).map(|_| [matrix(ffn, width, rng), matrix(ffn, width, rng), matrix(width, ffn, rng)]).collect()).collect();
    // Each token's experts: top_k distinct ones.
    let mut routed: Vec<Vec<usize>> = vec![Vec::new(); n_expert];
    for t in 0..tokens {
        let mut chosen = Vec::new();
        while chosen.len() < top_k {
            let e = rng.random_range(0..n_expert);
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        chosen.into_iter().for_each(|e| routed[e].push(t));
    }
    let used: Vec<usize> = (0..n_expert).filter(|&e| !routed[e].is_empty()).collect();
    let x: Vec<f32> = (0..tokens * width).map(|i| ((i * 7919) % 200) as f32 / 100.0 - 1.0).collect();
    let silu: duet_kernels::mlp::GateAct = |g, u| g.iter_mut().zip(u).for_each(|(g, &u)| *g = *g / (1.0 + (-*g).exp()) * u);
    let one_layer = |l: usize| {
        let outs: Vec<Vec<f32>> = used
            .par_iter()
            .map(|&e| {
                let xs: Vec<f32> = routed[e].iter().flat_map(|&t| x[t * width..(t + 1) * width].iter().copied()).collect();
                let m: Vec<QMatrix<'_>> = experts[l][e].iter().map(|(d, p, r, c)| QMatrix::new(ty, *r, *c, d).with_interleaved(p)).collect();
                duet_kernels::mlp::gated_mlp([&m[0], &m[1], &m[2]], silu, &xs)
            })
            .collect();
        std::hint::black_box(outs);
    };
    let bytes: usize = used.iter().map(|&e| experts[0][e].iter().map(|(d, ..)| d.len()).sum::<usize>()).sum();
    (0..layers).for_each(one_layer);
    against_a_sum(bytes, 12, |i| one_layer(i % layers))
}

/// GB/s of f32 activations `quantize` turns into `ty` blocks: 512 rows of 2048, row by row on
/// one thread (as a product quantises its input).
fn quantize_rows(ty: GgmlType, quantize: fn(GgmlType, &[f32], &mut [u8]), rng: &mut rand::rngs::StdRng) -> f64 {
    let (rows, cols) = (512usize, 2048usize);
    let x: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut out = vec![0u8; ty.row_bytes(cols) * rows];
    let t = best(9, || {
        for (x, o) in x.chunks_exact(cols).zip(out.chunks_exact_mut(ty.row_bytes(cols))) {
            quantize(ty, x, o);
        }
    });
    (rows * cols * 4) as f64 / t.as_secs_f64() / 1e9
}

/// Multiply-accumulates per second (G) of one matrix product of `batch` activation rows with
/// a `cols`-column matrix of 64 MiB (a batched decode step's tiles, or a prefill chunk's).
fn matmul_rows(
    ty: GgmlType,
    cols: usize,
    batch: usize,
    interleave: bool,
    rng: &mut rand::rngs::StdRng,
) -> f64 {
    let rows = (64usize << 20) / ty.row_bytes(cols) / 16 * 16;
    let mut data = vec![0u8; ty.row_bytes(cols) * rows];
    rng.fill(data.as_mut_slice());
    let packed = interleave
        .then(|| Interleaved::new(ty, rows, cols, &data).expect("a packed type, whole groups"));
    let mut w = QMatrix::new(ty, rows, cols, &data);
    if let Some(p) = &packed {
        w = w.with_interleaved(p);
    }
    let x: Vec<f32> = (0..cols * batch)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let acts = QuantizedActs::new(ty, &x, cols);
    let mut out = vec![0f32; rows * batch];
    let t = best(5, || matmul(&w, &acts, &mut out));
    (rows * cols * batch) as f64 / t.as_secs_f64() / 1e9
}

fn main() {
    let a = args();
    rayon::ThreadPoolBuilder::new().num_threads(a.threads).build_global().expect("thread pool");
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    println!("Duet kernel benchmark: {} threads, kernels {:?}", a.threads, duet_kernels::isa());
    // Bandwidth before and after the kernels (this VM's drifts between phases): the fractions
    // are of the better of the two.
    let passes_before = read_bandwidth_passes(a.quick);
    let wanted = |what: &str| a.only.as_deref().is_none_or(|o| what.contains(o));
    let mut rows: Vec<(String, String, f64)> = Vec::new();
    let contexts: &[usize] = if a.quick { &[1024, 4096] } else { &[1024, 4096, 16384] };
    for dtype in [KvDtype::F16, KvDtype::Q8_0] {
        for shape in ATTENTION_SHAPES {
            let what = format!("decode attention, one layer, {dtype} KV, {}/{} heads of {}", shape.n_head, shape.n_kv_head, shape.head_dim);
            for &ctx in contexts.iter().filter(|_| wanted(&what)) {
                for &batch in &[1usize, 8, 32] {
                    let g = attention(shape, dtype, batch, ctx, &mut rng);
                    rows.push((what.clone(), format!("context {ctx} × batch {batch}"), g));
                }
            }
        }
    }
    let cols = 4096;
    for ty in GgmlType::WEIGHT_TYPES {
        if wanted(&format!("matrix-vector {ty}")) {
            rows.push((
                format!("matrix-vector {ty}"),
                format!("256 MiB, {cols} columns"),
                matvec(ty, cols, 256, false, &mut rng),
            ));
        }
    }
    for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::Q5_0, GgmlType::Q5_1] {
        let what = format!("matrix-vector {ty} interleaved");
        if wanted(&what) && interleaved::available() {
            rows.push((
                what,
                format!("256 MiB, {cols} columns"),
                matvec(ty, cols, 256, true, &mut rng),
            ));
        }
    }
    // A decode step's products in order, as a 1B model streams them at batch 1: many
    // matrices of a few MiB, each a parallel job, against a plain sum over as many bytes
    // timed alternately with it (the VM's bandwidth drifts within seconds).
    let what = "matrix-vector Q4_K interleaved, a 1B model's layers in order";
    if wanted(what) && interleaved::available() {
        let (stack, sum) = layer_stack(&mut rng);
        rows.push((what.into(), "16 layers of width 2048, FFN 8192".into(), stack));
        rows.push(("read bandwidth, timed alternately with the row above".into(), "as many bytes".into(), sum));
    }
    for (tokens, what, shape) in [
        (1, "an OLMoE layer's routed experts, batch 1", "8 of 64 experts, 1 row each"),
        (16, "an OLMoE layer's routed experts, 16 sessions", "~56 of 64 experts, 1–6 rows each"),
    ] {
        if wanted(what) && interleaved::available() {
            let (experts, sum) = expert_layer(tokens, &mut rng);
            rows.push((what.into(), shape.into(), experts));
            rows.push(("read bandwidth, timed alternately with the row above".into(), "as many bytes".into(), sum));
        }
    }
    // The same in cache: how far the kernels' compute outruns the DRAM.
    for ty in [GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        for interleave in [false, true] {
            let what = format!("matrix-vector {ty}{}", if interleave { " interleaved" } else { "" });
            let packs = interleaved::packs(ty) && interleaved::available();
            if wanted(&what) && (packs || !interleave) {
                rows.push((what, format!("8 MiB (in L3), {cols} columns"), matvec(ty, cols, 8, interleave, &mut rng)));
            }
        }
    }
    // The default model's rows are short (576 columns: 18 blocks), which the per-row overhead
    // and the prefetch distance feel more than 4096-column rows do.
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
        if wanted(&format!("matrix-vector {ty}")) {
            rows.push((
                format!("matrix-vector {ty}"),
                "256 MiB, 576 columns (SmolLM2's width)".into(),
                matvec(ty, 576, 256, false, &mut rng),
            ));
        }
    }
    // Activation quantisation (every product's input), GB/s of f32 read: the dispatched kernel
    // and its scalar twin.
    for ty in [GgmlType::Q8_0, GgmlType::Q8K] {
        for (name, f) in [("", duet_kernels::dot::quantize_row as fn(GgmlType, &[f32], &mut [u8])), (", scalar twin", duet_kernels::dot::quantize_row_scalar)] {
            let what = format!("activation quantisation to {ty}{name}");
            if wanted(&what) {
                rows.push((what, "512 rows of 2048 (in L2/L3)".into(), quantize_rows(ty, f, &mut rng)));
            }
        }
    }
    let mut macs = Vec::new();
    // SmolLM2's width, and a 7–8B model's (where a tile's activations outgrow L1).
    for cols in [576usize, 4096] {
        // Batched decode (8, 16, 64 sessions) and a prefill chunk (512 tokens) at the wide shape.
        let batches: &[usize] = if cols == 4096 { &[8, 16, 64, 512] } else { &[8, 16] };
        for &batch in batches {
            // The k-quants (blocks of 256) at the wide shape only.
            let k_quants = if cols % 256 == 0 { vec![GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] } else { vec![] };
            for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0].into_iter().chain(k_quants) {
                if wanted(&format!("matrix × {batch} rows {ty}")) {
                    macs.push((
                        format!("matrix × {batch} rows {ty}"),
                        format!("64 MiB, {cols} columns"),
                        matmul_rows(ty, cols, batch, false, &mut rng),
                    ));
                }
                let what = format!("matrix × {batch} rows {ty} interleaved");
                if interleaved::packs(ty)
                    && wanted(&what)
                    && interleaved::available()
                {
                    macs.push((
                        what,
                        format!("64 MiB, {cols} columns"),
                        matmul_rows(ty, cols, batch, true, &mut rng),
                    ));
                }
            }
        }
    }
    // A prompt chunk's attention over its cached prefix (prefill at depth), per KV head each
    // query group over every token's causal prefix: multiply-adds of Q·K and of V·weights.
    for (shape, model) in [(ATTENTION_SHAPES[0], "SmolLM2"), (ATTENTION_SHAPES[1], "Llama-3.2-1B"), (ATTENTION_SHAPES[2], "Llama-3.1-8B")] {
        let what = format!("prompt attention, f16 KV, {}/{} heads of {} ({model})", shape.n_head, shape.n_kv_head, shape.head_dim);
        if wanted(&what) {
            macs.push((what, "512 tokens after 1536 cached".into(), prompt_attention(shape, 1536, 512, &mut rng)));
        }
    }
    // Merging a split decode step's partial attention results (the gpu-worker's share and a
    // cpu-worker's, per head), one thread: µs per layer of 64 split rows.
    let what = "merging split attention results (µs per layer, one thread)";
    let merge = wanted(what).then(|| (what, "64 rows × 32 heads of 64, 2 parts each", merge_layer(64, 32, 64, &mut rng)));
    let passes_after = read_bandwidth_passes(a.quick);
    let (bw_before, bw_after) = (fastest(&passes_before), fastest(&passes_after));
    let bw = bw_before.max(bw_after);
    let mut passes = [passes_before, passes_after].concat();
    passes.sort_by(f64::total_cmp);
    let bw_median = passes[passes.len() / 2];
    let mib = if a.quick { 512 } else { 1024 };
    println!("| what | shape | GB/s | of read bandwidth |");
    println!("|---|---|---:|---:|");
    println!("| read bandwidth (parallel f32 sum), the better of before and after | {mib} MiB | {bw:.1} | 100% |");
    println!("| read bandwidth before the kernels | {mib} MiB | {bw_before:.1} | {:.0}% |", 100.0 * bw_before / bw);
    println!("| read bandwidth after the kernels | {mib} MiB | {bw_after:.1} | {:.0}% |", 100.0 * bw_after / bw);
    println!("| read bandwidth, the median pass of before and after | {mib} MiB | {bw_median:.1} | {:.0}% |", 100.0 * bw_median / bw);
    for (what, shape, g) in rows {
        println!("| {what} | {shape} | {g:.1} | {:.0}% |", 100.0 * g / bw);
    }
    for (what, shape, g) in macs {
        println!("| {what} (G multiply-adds/s) | {shape} | {g:.1} | |");
    }
    if let Some((what, shape, us)) = merge {
        println!("| {what} | {shape} | {us:.1} | |");
    }
}

/// µs to merge one layer's `rows` split rows of `n_head` heads of `hd` from two partial
/// results each (`duet_kernels::decode_batch::merge_heads`, as the gpu-worker merges its own
/// share with a cpu-worker's), on one thread: the best of 50 layers.
fn merge_layer(rows: usize, n_head: usize, hd: usize, rng: &mut rand::rngs::StdRng) -> f64 {
    let part = |rng: &mut rand::rngs::StdRng| -> duet_kernels::decode_batch::Partial {
        ((0..n_head * hd).map(|_| rng.random_range(-1.0f32..1.0)).collect(), (0..n_head).map(|_| rng.random_range(-4.0f32..4.0)).collect())
    };
    let split: Vec<Vec<duet_kernels::decode_batch::Partial>> = (0..rows).map(|_| vec![part(rng), part(rng)]).collect();
    let mut out = vec![0f32; rows * n_head * hd];
    let t = best(50, || {
        for (parts, o) in split.iter().zip(out.chunks_exact_mut(n_head * hd)) {
            duet_kernels::decode_batch::merge_heads(parts, o, None);
        }
        std::hint::black_box(&out);
    });
    t.as_secs_f64() * 1e6
}
