// Duet CUDA kernels: matrix-vector products for decode-sized batches (1..16 rows a launch; mmq
// below for 9..64 on the integer tensor cores), on the
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

// Quantised weights times a batch of 9..MQ_TOK activation rows on the integer tensor cores
// (sm_80 and later), where the matrix-vector kernels would read the weights once per pass of
// MV_MAX_TOK rows and cuBLAS needs them dequantised to f16 on every product: y[t][row] = the
// same sum as mmvq's, its units' int8 products from mma_s8_16816 instead of __dp4a (the scheme
// of llama.cpp's mmq.cu, written anew on the unit loaders). A block takes MQ_ROWS weight rows
// (16 a warp) and every activation row; per stage of MQ_UNITS units its threads decode the
// weights' units (quants and scales) and copy the activations' Q8_1 units into shared
// memory, then each warp multiplies its 16 rows' units with every 8 activation rows, the two
// halves of a unit apart (their scales differ: Q6_K's sub-blocks are 16 values), scaling and
// summing in f32: d_a (sc0 · Σ lo + sc1 · Σ hi) + mn · s_a, as unit_dot does. Grid:
// ceil(rows / MQ_ROWS) x splits blocks of MQ_WARPS * WARP threads; n_tok <= MQ_TOK. Split
// over the units (so that a narrow weight still fills the GPU: a 2 048-row one makes 32
// blocks), block y takes units_per_split units from y · units_per_split and, with more than
// one split, writes its partial sums to y + blockIdx.y · n_tok · rows, which mmq_reduce then
// adds up in split order.
#define MQ_WARPS 4
#define MQ_ROWS (16 * MQ_WARPS)
#define MQ_TOK 64
#define MQ_UNITS 4
// A unit's 8 words of quants, padded by one so that the 8 rows (or tokens) a fragment reads
// spread over the banks.
#define MQ_STRIDE 9

template <int T>
__device__ __forceinline__ void mmq(const u8* __restrict__ w, int rows, int n_units, const BlockQ8_1* __restrict__ a, int n_tok,
                                    float* __restrict__ y, int units_per_split) {
    __shared__ int wq[MQ_UNITS * MQ_ROWS * MQ_STRIDE];
    __shared__ float wsc[MQ_UNITS * MQ_ROWS * 3];
    __shared__ int aq[MQ_UNITS * MQ_TOK * MQ_STRIDE];
    __shared__ float ads[MQ_UNITS * MQ_TOK * 2];
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP, g = lane / 4, t4 = lane % 4;
    const int row0 = blockIdx.x * MQ_ROWS, r0 = warp * 16;
    const size_t row_bytes = (size_t)(n_units * WARP / Fmt<T>::elems) * Fmt<T>::bytes;
    const int n_tiles = (n_tok + 7) / 8;
    const int u_begin = blockIdx.y * units_per_split, u_end = min(n_units, u_begin + units_per_split);
    y += (size_t)blockIdx.y * n_tok * rows;
    float acc[MQ_TOK / 8][4];
#pragma unroll
    for (int n = 0; n < MQ_TOK / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

    for (int u0 = u_begin; u0 < u_end; u0 += MQ_UNITS) {
        __syncthreads();
        // The weights' units of the stage, a (row, unit) a thread, a row's units on neighbouring
        // threads (whose reads then meet); past the matrix, zeros.
        for (int i = tid; i < MQ_UNITS * MQ_ROWS; i += MQ_WARPS * WARP) {
            const int uu = i % MQ_UNITS, r = i / MQ_UNITS, u = u0 + uu, row = row0 + r;
            int* q = wq + (uu * MQ_ROWS + r) * MQ_STRIDE;
            float* sc = wsc + (uu * MQ_ROWS + r) * 3;
            if (u < u_end && row < rows) {
                Unit un;
                load_unit<T>(w + (size_t)row * row_bytes, u, un);
#pragma unroll
                for (int k = 0; k < 8; k++) q[k] = un.q[k];
                sc[0] = un.sc0;
                sc[1] = un.sc1;
                sc[2] = un.mn;
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) q[k] = 0;
                sc[0] = sc[1] = sc[2] = 0.0f;
            }
        }
        // The activations' units of the stage; past the batch, zeros.
        for (int i = tid; i < MQ_UNITS * MQ_TOK; i += MQ_WARPS * WARP) {
            const int uu = i % MQ_UNITS, t = i / MQ_UNITS, u = u0 + uu;
            int* q = aq + (uu * MQ_TOK + t) * MQ_STRIDE;
            float* ds = ads + (uu * MQ_TOK + t) * 2;
            if (u < u_end && t < n_tok) {
                const BlockQ8_1* b = a + (size_t)t * n_units + u;
#pragma unroll
                for (int k = 0; k < 8; k++) q[k] = b->qs[k];
                ds[0] = b->d;
                ds[1] = b->s;
            } else {
#pragma unroll
                for (int k = 0; k < 8; k++) q[k] = 0;
                ds[0] = ds[1] = 0.0f;
            }
        }
        __syncthreads();
        if (row0 + r0 >= rows) continue;
        for (int uu = 0; uu < MQ_UNITS && u0 + uu < u_end; uu++) {
            const int* wr = wq + (uu * MQ_ROWS + r0) * MQ_STRIDE;
            const float* sr = wsc + (uu * MQ_ROWS + r0) * 3;
            // Rows g and g + 8 of the warp: the unit's first half (words 0..3), then its second.
            const u32 a_lo[2] = {(u32)wr[g * MQ_STRIDE + t4], (u32)wr[(g + 8) * MQ_STRIDE + t4]};
            const u32 a_hi[2] = {(u32)wr[g * MQ_STRIDE + 4 + t4], (u32)wr[(g + 8) * MQ_STRIDE + 4 + t4]};
            const float sc0[2] = {sr[g * 3], sr[(g + 8) * 3]}, sc1[2] = {sr[g * 3 + 1], sr[(g + 8) * 3 + 1]};
            const float mn[2] = {sr[g * 3 + 2], sr[(g + 8) * 3 + 2]};
#pragma unroll
            for (int n = 0; n < MQ_TOK / 8; n++) {
                if (n >= n_tiles) break;
                const int* ar = aq + (uu * MQ_TOK + 8 * n + g) * MQ_STRIDE;
                int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                mma_s8_16816(lo, a_lo, (u32)ar[t4]);
                mma_s8_16816(hi, a_hi, (u32)ar[4 + t4]);
                // d's elements: (row g, tokens 2t, 2t + 1), then (row g + 8, the same).
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float* ds = ads + (uu * MQ_TOK + 8 * n + 2 * t4 + e % 2) * 2;
                    acc[n][e] += ds[0] * (sc0[e / 2] * (float)lo[e] + sc1[e / 2] * (float)hi[e]) + mn[e / 2] * ds[1];
                }
            }
        }
    }
#pragma unroll
    for (int n = 0; n < MQ_TOK / 8; n++) {
        if (n >= n_tiles) break;
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int t = 8 * n + 2 * t4 + e % 2, row = row0 + r0 + g + 8 * (e / 2);
            if (t < n_tok && row < rows) y[(size_t)t * rows + row] = acc[n][e];
        }
    }
}

#define MMQ(name, T)                                                                                           \
    extern "C" __global__ void __launch_bounds__(WARP * MQ_WARPS)                                              \
    name(const u8* w, int rows, int n_units, const BlockQ8_1* a, int n_tok, float* y, int units_per_split) {   \
        mmq<T>(w, rows, n_units, a, n_tok, y, units_per_split);                                                \
    }
MMQ(mmq_q4_0, T_Q4_0)
MMQ(mmq_q4_1, T_Q4_1)
MMQ(mmq_q5_0, T_Q5_0)
MMQ(mmq_q5_1, T_Q5_1)
MMQ(mmq_q8_0, T_Q8_0)
MMQ(mmq_q4_k, T_Q4_K)
MMQ(mmq_q5_k, T_Q5_K)
MMQ(mmq_q6_k, T_Q6_K)

// y[i] = the sum of mmq's partial sums part[s · n + i] over its splits, in split order (the
// same bits every run).
extern "C" __global__ void mmq_reduce(const float* __restrict__ part, int splits, int n, float* __restrict__ y) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = 0.0f;
    for (int k = 0; k < splits; k++) s += part[(size_t)k * n + i];
    y[i] = s;
}

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
