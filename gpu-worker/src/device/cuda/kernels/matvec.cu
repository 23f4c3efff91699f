// Duet CUDA kernels: matrix-vector products for decode-sized batches (1..16 rows a launch), on the
// weights as the GGUF file stores them. Activations are first quantised to Q8_1-like units
// (`quantize_q8_1`); each warp then computes one output row for every activation row, its
// lanes striding over the row's units and summing 4-byte dot products with __dp4a (the scheme
// of llama.cpp's mmvq.cu, written anew for these unit loaders). Float weights (F32, F16,
// BF16) take `mv_*` on the f32 activations instead.

#define MV_WARPS 4
#define MV_MAX_TOK 16

// y[t][row] = the warp's sum of acc[t], for t < n_tok (lane 0 writes).
__device__ __forceinline__ void store_row_sums(float (&acc)[MV_MAX_TOK], int n_tok, int lane, float* __restrict__ y, int rows, int row) {
#pragma unroll
    for (int t = 0; t < MV_MAX_TOK; ++t) {
        if (t < n_tok) {
            float s = warp_sum(acc[t]);
            if (lane == 0) y[(size_t)t * rows + row] = s;
        }
    }
}

// x: [units][32] f32 (rows of a multiple of 32 elements, back to back) -> out: one BlockQ8_1
// per unit. One warp per unit.
extern "C" __global__ void __launch_bounds__(WARP * MV_WARPS)
quantize_q8_1(const float* __restrict__ x, BlockQ8_1* __restrict__ out, int units) {
    int unit = blockIdx.x * MV_WARPS + threadIdx.y;
    if (unit >= units) return;
    q8_1_unit(x[(size_t)unit * WARP + threadIdx.x], out + unit, threadIdx.x);
}

// y[t][row] = dot(weight row `row`, activation row t) for t < n_tok: quantised weights.
// `a` holds n_tok rows of n_units BlockQ8_1 each. One warp a row.
template <int T>
__device__ __forceinline__ void mmvq_row(const u8* __restrict__ w, int rows, int row, int n_units, const BlockQ8_1* __restrict__ a, int n_tok,
                                         float* __restrict__ y) {
    int lane = threadIdx.x;
    size_t row_bytes = (size_t)(n_units * WARP / Fmt<T>::elems) * Fmt<T>::bytes;
    const u8* wr = w + (size_t)row * row_bytes;
    float acc[MV_MAX_TOK];
#pragma unroll
    for (int t = 0; t < MV_MAX_TOK; ++t) acc[t] = 0.0f;
    for (int u = lane; u < n_units; u += WARP) {
        Unit r;
        load_unit<T>(wr, u, r);
#pragma unroll
        for (int t = 0; t < MV_MAX_TOK; ++t)
            if (t < n_tok) acc[t] += unit_dot(r, a[(size_t)t * n_units + u]);
    }
    store_row_sums(acc, n_tok, lane, y, rows, row);
}

// mmvq_row for every row of one weight. Grid: ceil(rows / MV_WARPS) blocks of (32, MV_WARPS)
// threads.
template <int T>
__device__ __forceinline__ void mmvq(const u8* __restrict__ w, int rows, int n_units, const BlockQ8_1* __restrict__ a, int n_tok,
                                     float* __restrict__ y) {
    int row = blockIdx.x * MV_WARPS + threadIdx.y;
    if (row < rows) mmvq_row<T>(w, rows, row, n_units, a, n_tok, y);
}

// The same for up to three weights of one type and width over the same activations, in one
// launch (a layer's Q, K and V, or its gate and up): the warps take the rows of w0, then of
// w1, then of w2 (rows 0: no such weight), each writing its own y. Grid: ceil((rows0 + rows1 +
// rows2) / MV_WARPS) blocks of (32, MV_WARPS) threads.
template <int T>
__device__ __forceinline__ void mmvq_group(const u8* __restrict__ w0, int rows0, float* __restrict__ y0, const u8* __restrict__ w1, int rows1,
                                           float* __restrict__ y1, const u8* __restrict__ w2, int rows2, float* __restrict__ y2, int n_units,
                                           const BlockQ8_1* __restrict__ a, int n_tok) {
    int row = blockIdx.x * MV_WARPS + threadIdx.y;
    if (row < rows0) {
        mmvq_row<T>(w0, rows0, row, n_units, a, n_tok, y0);
    } else if (row - rows0 < rows1) {
        mmvq_row<T>(w1, rows1, row - rows0, n_units, a, n_tok, y1);
    } else if (row - rows0 - rows1 < rows2) {
        mmvq_row<T>(w2, rows2, row - rows0 - rows1, n_units, a, n_tok, y2);
    }
}

#define MMVQ(name, T)                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP * MV_WARPS)                                              \
    name(const u8* w, int rows, int n_units, const BlockQ8_1* a, int n_tok, float* y) {                        \
        mmvq<T>(w, rows, n_units, a, n_tok, y);                                                                \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WARP * MV_WARPS)                                              \
    name##_group(const u8* w0, int rows0, float* y0, const u8* w1, int rows1, float* y1, const u8* w2, int rows2, \
                 float* y2, int n_units, const BlockQ8_1* a, int n_tok) {                                      \
        mmvq_group<T>(w0, rows0, y0, w1, rows1, y1, w2, rows2, y2, n_units, a, n_tok);                          \
    }
MMVQ(mmvq_q4_0, T_Q4_0)
MMVQ(mmvq_q4_1, T_Q4_1)
MMVQ(mmvq_q5_0, T_Q5_0)
MMVQ(mmvq_q5_1, T_Q5_1)
MMVQ(mmvq_q8_0, T_Q8_0)
MMVQ(mmvq_q4_k, T_Q4_K)
MMVQ(mmvq_q5_k, T_Q5_K)
MMVQ(mmvq_q6_k, T_Q6_K)

// y[t][row] = dot(weight row `row`, x row t) for float weights and f32 activations.
template <int T>
__device__ __forceinline__ void mv_float(const u8* __restrict__ w, int rows, int cols, const float* __restrict__ x, int n_tok,
                                         float* __restrict__ y) {
    int row = blockIdx.x * MV_WARPS + threadIdx.y;
    if (row >= rows) return;
    int lane = threadIdx.x;
    const u8* wr = w + (size_t)row * cols * (T == T_F32 ? 4 : 2);
    float acc[MV_MAX_TOK];
#pragma unroll
    for (int t = 0; t < MV_MAX_TOK; ++t) acc[t] = 0.0f;
    for (int c = lane; c < cols; c += WARP) {
        float wv = load_float<T>(wr, c);
#pragma unroll
        for (int t = 0; t < MV_MAX_TOK; ++t)
            if (t < n_tok) acc[t] += wv * x[(size_t)t * cols + c];
    }
    store_row_sums(acc, n_tok, lane, y, rows, row);
}

#define MV_FLOAT(name, T)                                                                                      \
    extern "C" __global__ void __launch_bounds__(WARP * MV_WARPS)                                              \
    name(const u8* w, int rows, int cols, const float* x, int n_tok, float* y) {                               \
        mv_float<T>(w, rows, cols, x, n_tok, y);                                                               \
    }
MV_FLOAT(mv_f32, T_F32)
MV_FLOAT(mv_f16, T_F16)
MV_FLOAT(mv_bf16, T_BF16)
