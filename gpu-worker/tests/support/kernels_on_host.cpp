// The CUDA kernels of attention.cu, ops.cu, matvec.cu and dequant.cu run on the host
// (cuda_on_host.h), launched as the CUDA device launches them (`device::cuda::mirror`,
// `device::cuda::launch`), for gpu-worker/tests/cuda_kernels_on_host.rs. stdin: a command and its inputs; stdout: the
// kernel's outputs.
//
//   1 attention: the K/V rows stored into a page pool (kv_store), then attn_prefill (or, when
//     asked, attn_prefill_mma64 or 128 on the emulated tensor cores) over the tiles given and
//     attn_partial and attn_merge over the single items given, as `KvMirror::launch` does;
//     out: every item's output rows and log-sum-exps.
//   2 argmax_rows; out: each row's index.
//   3 quantize_q8_1 and an mmvq kernel (decode-sized matrix-vector products); out: y, then
//     (when asked) y from mmq (the integer tensor cores), then (when asked) y again from
//     mmvq_*_group with the rows as three weights, then as two.
//   4 a hot expert's rows on the GPU: gather_rows of x, then scatter_add_scaled of an output
//     into y, as `GpuExperts::add_outputs` does; out: the gathered rows, then y.
//   5 kv_to_arena: rows' K and V of one layer into an arena (a byte buffer whose every byte
//     starts as 0xab), at slots given as offsets into it, as `host_map::store_in_place`
//     does; out: the arena's bytes.
//   6 dequant_f16_* of one quantised weight type: rows row0..row0 + rows to f16, launched as
//     `Launcher::dequant_f16` launches it; out: the f16 values.
//   7 the fused decode kernels against the ones they fuse, on the same rows: rms_norm_fused
//     (with and without the residual add, with Q8_1 units) against add_assign, rms_norm and
//     quantize_q8_1; silu_mul_q8 against silu_mul and quantize_q8_1; out: for each way, x
//     after the add, the normed rows, their units, then g and its units; then x and the
//     normed rows of rms_norm_fused without units.
//   8 rope on a batch's queries and keys in one launch; out: q, then k.
//   9 arena_to_mirror: rows of one layer read from an arena (its bytes given) at slots given
//     as offsets into it, into a page pool whose every value starts as 0xabab, as
//     `KvMirror::read_in_place` does; out: the pool.

#include "cuda_on_host.h"

#include <type_traits>

#include "types.cuh"
#include "common.cuh"
#include "quants.cuh"
#include "attention.cu"
#include "ops.cu"
#include "matvec.cu"
#include "dequant.cu"

static void attention() {
    int n_kv_head = read_one<int>(), head_dim = read_one<int>(), group = read_one<int>(), page_size = read_one<int>();
    int layers = read_one<int>(), layer = read_one<int>(), n_pages = read_one<int>(), n_rows = read_one<int>();
    int kv_dim = n_kv_head * head_dim, n_head = n_kv_head * group;
    auto k = read_vec<float>((size_t)n_rows * kv_dim);
    auto v = read_vec<float>((size_t)n_rows * kv_dim);
    auto slots = read_vec<int>(n_rows);
    auto pages = read_vec<int>(read_one<int>());
    int n_items = read_one<int>();
    auto items = read_vec<int>(4 * (size_t)n_items);
    int n_tiles = read_one<int>();
    auto tiles = read_vec<int>(3 * (size_t)n_tiles);
    auto singles = read_vec<int>(read_one<int>());
    auto q = read_vec<float>((size_t)read_one<int>() * n_head * head_dim);
    int n_split = read_one<int>();
    float scale = read_one<float>(), softcap = read_one<float>();
    int mma = read_one<int>();

    long long page_elems = (long long)layers * 2 * kv_dim * page_size;
    std::vector<u16> pool((size_t)n_pages * page_elems, 0xffff);  // NaN: a read of a slot never written shows
    unsigned elems = (unsigned)(n_rows * kv_dim);
    launch(dim3{(elems + 1023) / 1024}, dim3{1024}, [&] {
        kv_store(k.data(), v.data(), slots.data(), n_rows, kv_dim, head_dim, pool.data(), page_elems, layer, page_size);
    });
    // NaN where no kernel writes.
    std::vector<float> out((size_t)n_items * n_head * head_dim, NAN), lse((size_t)n_items * n_head, NAN);
    if (n_tiles > 0 && mma)
        launch(dim3{(unsigned)n_tiles, (unsigned)n_kv_head}, dim3{PFM_WARPS * WARP}, [&] {
            auto kernel = head_dim <= 64 ? attn_prefill_mma64 : attn_prefill_mma128;
            kernel(q.data(), pool.data(), page_elems, layer, pages.data(), items.data(), tiles.data(), n_kv_head, head_dim, group, page_size, scale,
                   softcap, out.data(), lse.data());
        });
    else if (n_tiles > 0)
        launch(dim3{(unsigned)n_tiles, (unsigned)n_kv_head}, dim3{ATT_THREADS}, [&] {
            attn_prefill(q.data(), pool.data(), page_elems, layer, pages.data(), items.data(), tiles.data(), n_kv_head, head_dim, group, page_size,
                         scale, softcap, out.data(), lse.data());
        });
    int m = (int)singles.size();
    if (m > 0) {
        std::vector<int> meta;
        for (int j : singles) meta.insert(meta.end(), items.begin() + 4 * j, items.begin() + 4 * j + 4);
        int hgroups = (group + ATT_HEADS - 1) / ATT_HEADS;
        size_t parts = (size_t)m * n_head * n_split;
        std::vector<float> pm(parts), pl(parts), po(parts * head_dim);
        launch(dim3{(unsigned)m, (unsigned)(n_kv_head * hgroups), (unsigned)n_split}, dim3{ATT_THREADS}, [&] {
            attn_partial(q.data(), pool.data(), page_elems, layer, pages.data(), meta.data(), n_kv_head, head_dim, group, page_size, n_split, scale,
                         softcap, pm.data(), pl.data(), po.data());
        });
        launch(dim3{(unsigned)(m * n_head)}, dim3{(unsigned)std::min(head_dim, 128)}, [&] {
            attn_merge(pm.data(), pl.data(), po.data(), n_split, head_dim, n_head, singles.data(), out.data(), lse.data());
        });
    }
    write_vec(out);
    write_vec(lse);
}

static void argmax() {
    int n = read_one<int>(), cols = read_one<int>();
    auto x = read_vec<float>((size_t)n * cols);
    std::vector<u32> out(n);
    launch(dim3{(unsigned)n}, dim3{ARGMAX_THREADS}, [&] { argmax_rows(x.data(), cols, out.data()); });
    write_vec(out);
}

// Calls `f` with the quantised weight type `ty` as a compile-time constant (the kernels'
// template argument); exits on any other type.
template <class F>
static void with_type(int ty, F f) {
    switch (ty) {
        case T_Q4_0: f(std::integral_constant<int, T_Q4_0>{}); break;
        case T_Q4_1: f(std::integral_constant<int, T_Q4_1>{}); break;
        case T_Q5_0: f(std::integral_constant<int, T_Q5_0>{}); break;
        case T_Q5_1: f(std::integral_constant<int, T_Q5_1>{}); break;
        case T_Q8_0: f(std::integral_constant<int, T_Q8_0>{}); break;
        case T_Q4_K: f(std::integral_constant<int, T_Q4_K>{}); break;
        case T_Q5_K: f(std::integral_constant<int, T_Q5_K>{}); break;
        case T_Q6_K: f(std::integral_constant<int, T_Q6_K>{}); break;
        default: exit(4);
    }
}

// Activation rows quantised to Q8_1 units (quantize_q8_1), then the quantised weight type's
// mmvq kernel, launched as `Launcher::linear` launches them for decode-sized batches; then
// its mmvq_*_group kernel over the same rows as three weights and as two.
static void matvec() {
    int ty = read_one<int>(), rows = read_one<int>(), cols = read_one<int>(), n_tok = read_one<int>(), extras = read_one<int>();
    // extras: 1 also mmq, 2 also the grouped launches (each slow to emulate).
    bool with_mmq = extras & 1, with_groups = extras & 2;
    auto w = read_vec<u8>((size_t)read_one<int>());
    auto x = read_vec<float>((size_t)n_tok * cols);
    int units = n_tok * cols / 32, row_units = cols / 32;
    std::vector<BlockQ8_1> q(units);
    std::vector<float> y((size_t)n_tok * rows, NAN);
    launch(dim3{(unsigned)(units + MV_WARPS - 1) / MV_WARPS}, dim3{32, MV_WARPS}, [&] { quantize_q8_1(x.data(), q.data(), units); });
    dim3 grid{(unsigned)(rows + MV_WARPS - 1) / MV_WARPS}, block{32, MV_WARPS};
    // In passes of MV_MAX_TOK activation rows, as the device launches them.
    auto run = [&](auto kernel) {
        for (int t0 = 0; t0 < n_tok; t0 += MV_MAX_TOK) {
            int nt = std::min(MV_MAX_TOK, n_tok - t0);
            launch(grid, block, [&] { kernel(w.data(), rows, row_units, q.data() + (size_t)t0 * row_units, nt, y.data() + (size_t)t0 * rows); });
        }
    };
    with_type(ty, [&](auto T) { run([](auto... a) { mmvq<decltype(T)::value>(a...); }); });
    write_vec(y);
    // With `with_mmq`, mmq on the emulated integer tensor cores (batches of 9..64 rows on
    // the device; the emulation's barriers make it slow to run here).
    // Batches of 9 rows or more split over the units, 8 a split (the last one part empty
    // where 8 does not divide them), and their partial sums added by mmq_reduce.
    std::vector<float> ym((size_t)n_tok * rows, NAN);
    int per_split = n_tok > 8 ? 8 : row_units, splits = (row_units + per_split - 1) / per_split;
    auto run_mmq = [&](auto kernel) {
        std::vector<float> part((size_t)splits * n_tok * rows, NAN);
        float* out = splits > 1 ? part.data() : ym.data();
        launch(dim3{(unsigned)(rows + MQ_ROWS - 1) / MQ_ROWS, (unsigned)splits}, dim3{MQ_WARPS * WARP},
               [&] { kernel(w.data(), rows, row_units, q.data(), n_tok, out, per_split); });
        int n = n_tok * rows;
        if (splits > 1) launch(dim3{(unsigned)(n + 127) / 128}, dim3{128}, [&] { mmq_reduce(part.data(), splits, n, ym.data()); });
    };
    if (with_mmq) with_type(ty, [&](auto T) { run_mmq([](auto... a) { mmq<decltype(T)::value>(a...); }); });
    if (with_mmq) write_vec(ym);
    // The same rows as three weights, then as two, in one launch of mmvq_*_group (as
    // `Launcher::linear_group` launches a layer's Q, K and V or its gate and up); each part's
    // outputs written back into y's layout. Splits off the warps' blocks of MV_WARPS rows.
    size_t row_bytes = w.size() / rows;
    if (with_groups) for (int parts : {3, 2}) {
        int r[3] = {rows / 3 + 1, parts == 3 ? rows / 3 - 2 : rows - rows / 3 - 1, 0};
        r[2] = rows - r[0] - r[1];
        std::vector<float> ys[3];
        for (int i = 0; i < 3; i++) ys[i].assign((size_t)n_tok * r[i], NAN);
        const u8* wp[3] = {w.data(), w.data() + row_bytes * r[0], w.data() + row_bytes * (r[0] + r[1])};
        dim3 g{(unsigned)(rows + MV_WARPS - 1) / MV_WARPS};
        auto run_group = [&](auto kernel) {
            for (int t0 = 0; t0 < n_tok; t0 += MV_MAX_TOK) {
                int nt = std::min(MV_MAX_TOK, n_tok - t0);
                launch(g, block, [&] {
                    kernel(wp[0], r[0], ys[0].data() + (size_t)t0 * r[0], wp[1], r[1], ys[1].data() + (size_t)t0 * r[1], parts == 3 ? wp[2] : nullptr,
                           parts == 3 ? r[2] : 0, parts == 3 ? ys[2].data() + (size_t)t0 * r[2] : nullptr, row_units, q.data() + (size_t)t0 * row_units, nt);
                });
            }
        };
        with_type(ty, [&](auto T) { run_group([](auto... a) { mmvq_group<decltype(T)::value>(a...); }); });
        // With two parts the third's rows were none of the launch's: the second's NaN stays
        // where the rows past r[0] + r[1] are (there are none: r[1] takes the rest).
        std::vector<float> yg((size_t)n_tok * rows, NAN);
        for (int t = 0; t < n_tok; t++)
            for (int i = 0, row0 = 0; i < (parts == 3 ? 3 : 2); row0 += r[i], i++)
                for (int j = 0; j < r[i]; j++) yg[(size_t)t * rows + row0 + j] = ys[i][(size_t)t * r[i] + j];
        write_vec(yg);
    }
}

static void expert_rows() {
    int total = read_one<int>(), cols = read_one<int>(), n = read_one<int>();
    auto rows = read_vec<u32>((size_t)n);
    auto w = read_vec<float>((size_t)n);
    auto x = read_vec<float>((size_t)total * cols);
    auto y = read_vec<float>((size_t)total * cols);
    auto src = read_vec<float>((size_t)n * cols);
    std::vector<float> xs((size_t)n * cols, NAN);
    // Blocks of 128 threads (the device's are 1024: these kernels index by the global thread).
    dim3 grid{(unsigned)((n * cols + 127) / 128)}, block{128};
    launch(grid, block, [&] { gather_rows(x.data(), rows.data(), n, cols, xs.data()); });
    launch(grid, block, [&] { scatter_add_scaled(src.data(), rows.data(), w.data(), n, cols, y.data()); });
    write_vec(xs);
    write_vec(y);
}

static void arena_rows() {
    int n_rows = read_one<int>(), n_kv_head = read_one<int>(), head_dim = read_one<int>(), layer = read_one<int>(), q8 = read_one<int>();
    size_t arena_bytes = (size_t)read_one<int>();
    auto offsets = read_vec<u64>((size_t)n_rows);
    auto strides = read_vec<u64>((size_t)n_rows);
    auto k = read_vec<float>((size_t)n_rows * n_kv_head * head_dim);
    auto v = read_vec<float>((size_t)n_rows * n_kv_head * head_dim);
    std::vector<u8> arena(arena_bytes, 0xab);
    // The kernel takes addresses: here the host's own.
    std::vector<u64> rows(offsets.size());
    for (size_t r = 0; r < rows.size(); r++) rows[r] = (u64)(arena.data() + offsets[r]);
    launch(dim3{(unsigned)n_rows, (unsigned)n_kv_head, 2}, dim3{32}, [&] {
        kv_to_arena(k.data(), v.data(), rows.data(), strides.data(), n_kv_head, head_dim, layer, q8);
    });
    write_vec(arena);
}

static void mirror_rows() {
    int n_rows = read_one<int>(), n_kv_head = read_one<int>(), head_dim = read_one<int>(), layers = read_one<int>(), layer = read_one<int>();
    int q8 = read_one<int>(), n_pages = read_one<int>(), page_size = read_one<int>();
    auto arena = read_vec<u8>((size_t)read_one<int>());
    auto offsets = read_vec<u64>((size_t)n_rows);
    auto strides = read_vec<u64>((size_t)n_rows);
    auto slots = read_vec<int>((size_t)n_rows);
    long long page_elems = (long long)layers * 2 * n_kv_head * head_dim * page_size;
    std::vector<u16> pool((size_t)n_pages * page_elems, 0xabab);
    std::vector<u64> rows(offsets.size());
    for (size_t r = 0; r < rows.size(); r++) rows[r] = (u64)(arena.data() + offsets[r]);
    launch(dim3{(unsigned)n_rows, (unsigned)n_kv_head, 2}, dim3{32}, [&] {
        arena_to_mirror(rows.data(), strides.data(), slots.data(), n_kv_head, head_dim, layer, q8, pool.data(), page_elems, page_size);
    });
    write_vec(pool);
}

static void fused() {
    int rows = read_one<int>(), cols = read_one<int>(), add = read_one<int>();
    float eps = read_one<float>();
    auto x = read_vec<float>((size_t)rows * cols);
    auto y = read_vec<float>((size_t)rows * cols);
    auto w = read_vec<float>((size_t)cols);
    auto g = read_vec<float>((size_t)rows * cols);
    auto u = read_vec<float>((size_t)rows * cols);
    int units = rows * cols / 32;
    size_t n = (size_t)rows * cols;
    dim3 q8_grid{(unsigned)(units + MV_WARPS - 1) / MV_WARPS}, q8_block{32, MV_WARPS};
    // The separate kernels.
    auto x1 = x;
    std::vector<float> out1(n, NAN), g1 = g;
    std::vector<BlockQ8_1> q1(units), qg1(units);
    if (add) launch(dim3{(unsigned)((n + 255) / 256)}, dim3{256}, [&] { add_assign(x1.data(), y.data(), n); });
    launch(dim3{(unsigned)rows}, dim3{NORM_THREADS}, [&] { rms_norm(x1.data(), w.data(), out1.data(), cols, eps); });
    launch(q8_grid, q8_block, [&] { quantize_q8_1(out1.data(), q1.data(), units); });
    launch(dim3{(unsigned)((n + 255) / 256)}, dim3{256}, [&] { silu_mul(g1.data(), u.data(), n); });
    launch(q8_grid, q8_block, [&] { quantize_q8_1(g1.data(), qg1.data(), units); });
    // The fused ones.
    auto x2 = x;
    std::vector<float> out2(n, NAN), g2 = g;
    std::vector<BlockQ8_1> q2(units), qg2(units);
    launch(dim3{(unsigned)rows}, dim3{NORM_THREADS}, [&] { rms_norm_fused(x2.data(), add ? y.data() : nullptr, w.data(), out2.data(), q2.data(), cols, eps); });
    launch(dim3{(unsigned)(units + SILU_Q8_WARPS - 1) / SILU_Q8_WARPS}, dim3{32, SILU_Q8_WARPS}, [&] { silu_mul_q8(g2.data(), u.data(), qg2.data(), units); });
    // rms_norm_fused without units (prefill batches, mixtures' layers).
    auto x3 = x;
    std::vector<float> out3(n, NAN);
    launch(dim3{(unsigned)rows}, dim3{NORM_THREADS}, [&] { rms_norm_fused(x3.data(), add ? y.data() : nullptr, w.data(), out3.data(), nullptr, cols, eps); });
    for (auto* way : {&x1, &out1}) write_vec(*way);
    write_vec(q1);
    write_vec(g1);
    write_vec(qg1);
    for (auto* way : {&x2, &out2}) write_vec(*way);
    write_vec(q2);
    write_vec(g2);
    write_vec(qg2);
    write_vec(x3);
    write_vec(out3);
}

static void rope_qk() {
    int rows = read_one<int>(), q_heads = read_one<int>(), k_heads = read_one<int>(), head_dim = read_one<int>(), n_rot = read_one<int>(),
        neox = read_one<int>();
    auto q = read_vec<float>((size_t)rows * q_heads * head_dim);
    auto k = read_vec<float>((size_t)rows * k_heads * head_dim);
    auto tables = read_vec<float>((size_t)rows * n_rot);
    size_t n = (size_t)rows * (q_heads + k_heads) * (n_rot / 2);
    launch(dim3{(unsigned)((n + 255) / 256)}, dim3{256}, [&] { rope(q.data(), k.data(), tables.data(), rows, q_heads, k_heads, head_dim, n_rot, neox); });
    write_vec(q);
    write_vec(k);
}

static void dequant() {
    int ty = read_one<int>(), cols = read_one<int>(), row0 = read_one<int>(), rows = read_one<int>();
    auto w = read_vec<u8>((size_t)read_one<int>());
    int units = cols / 32;
    std::vector<u16> out((size_t)rows * cols, 0xffff);  // NaN where no thread writes
    dim3 grid{(unsigned)(((size_t)rows * units + DQ_UNITS - 1) / DQ_UNITS)}, block{DQ_UNITS};
    auto run = [&](auto kernel) { launch(grid, block, [&] { kernel(w.data(), row0, rows, units, out.data()); }); };
    switch (ty) {
        case T_Q4_0: run(dequant_f16_q4_0); break;
        case T_Q4_1: run(dequant_f16_q4_1); break;
        case T_Q5_0: run(dequant_f16_q5_0); break;
        case T_Q5_1: run(dequant_f16_q5_1); break;
        case T_Q8_0: run(dequant_f16_q8_0); break;
        case T_Q4_K: run(dequant_f16_q4_k); break;
        case T_Q5_K: run(dequant_f16_q5_k); break;
        case T_Q6_K: run(dequant_f16_q6_k); break;
        default: exit(4);
    }
    write_vec(out);
}

int main() {
    switch (read_one<int>()) {
        case 1: attention(); break;
        case 2: argmax(); break;
        case 3: matvec(); break;
        case 4: expert_rows(); break;
        case 5: arena_rows(); break;
        case 6: dequant(); break;
        case 7: fused(); break;
        case 8: rope_qk(); break;
        case 9: mirror_rows(); break;
        default: return 3;
    }
    return 0;
}
