// Duet CUDA kernels: the element-wise and row-wise steps of a Llama layer, on f32 rows.

#define NORM_THREADS 256

// The block's sum of `sum` (a thread's share of a row's squares), in every thread.
__device__ __forceinline__ float norm_block_sum(float sum, float* partial) {
    sum = warp_sum(sum);
    int lane = threadIdx.x % WARP, wid = threadIdx.x / WARP;
    if (lane == 0) partial[wid] = sum;
    __syncthreads();
    sum = lane < NORM_THREADS / WARP ? partial[lane] : 0.0f;
    return warp_sum(sum);
}

// out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w, one block of NORM_THREADS per row.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out, int cols, float eps) {
    __shared__ float partial[NORM_THREADS / WARP];
    const float* xr = x + (size_t)blockIdx.x * cols;
    float* orow = out + (size_t)blockIdx.x * cols;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += NORM_THREADS) sum += xr[c] * xr[c];
    float scale = 1.0f / sqrtf(norm_block_sum(sum, partial) / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += NORM_THREADS) orow[c] = (xr[c] * scale) * w[c];
}

// rms_norm fused with what goes around it in a decode layer, bit for bit the separate kernels:
// with `y`, first x[r] += y[r] (the residual add before the norm; x written back); then the
// norm into `out`; with `q8`, the normed row also as Q8_1 units, as quantize_q8_1 makes them
// (cols a multiple of 32), for the matrix-vector products that follow. A thread takes the
// columns tid, tid + NORM_THREADS, ... in every loop, so it reads only what it wrote.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rms_norm_fused(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w, float* __restrict__ out, BlockQ8_1* __restrict__ q8,
               int cols, float eps) {
    __shared__ float partial[NORM_THREADS / WARP];
    float* xr = x + (size_t)blockIdx.x * cols;
    float* orow = out + (size_t)blockIdx.x * cols;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += NORM_THREADS) {
        float v = xr[c];
        if (y) {
            v += y[(size_t)blockIdx.x * cols + c];
            xr[c] = v;
        }
        sum += v * v;
    }
    float scale = 1.0f / sqrtf(norm_block_sum(sum, partial) / (float)cols + eps);
    if (!q8) {
        for (int c = threadIdx.x; c < cols; c += NORM_THREADS) orow[c] = (xr[c] * scale) * w[c];
        return;
    }
    // A warp per unit of 32 columns (unit u's lane l is column tid + NORM_THREADS * k).
    int lane = threadIdx.x % WARP, units = cols / WARP;
    for (int u = threadIdx.x / WARP; u < units; u += NORM_THREADS / WARP) {
        int c = u * WARP + lane;
        float v = (xr[c] * scale) * w[c];
        orow[c] = v;
        q8_1_unit(v, q8 + (size_t)blockIdx.x * units + u, lane);
    }
}

// RoPE in place on a row's queries and keys together: pairs (2i, 2i+1) (normal) or (i, i +
// n_rot/2) (NeoX, `neox` != 0), i < n_rot / 2, of every head of every row of q (n_q_heads a
// row) and of k (n_k_heads), rotated by the row's table ([row][n_rot / 2] of (cos, sin),
// computed on the host as the CPU device computes it). One thread per pair.
extern "C" __global__ void rope(float* __restrict__ q, float* __restrict__ k, const float* __restrict__ tables, int n_rows, int n_q_heads,
                                int n_k_heads, int head_dim, int n_rot, int neox) {
    int half = n_rot / 2, heads = n_q_heads + n_k_heads;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_rows * heads * half) return;
    int p = (int)(i % half);
    size_t rh = i / half;
    size_t row = rh / heads;
    int head = (int)(rh % heads);
    float c = tables[(row * half + p) * 2], s = tables[(row * half + p) * 2 + 1];
    float* h = head < n_q_heads ? q + (row * n_q_heads + head) * head_dim : k + (row * n_k_heads + (head - n_q_heads)) * head_dim;
    int a = neox ? p : 2 * p, b = neox ? p + half : 2 * p + 1;
    float x0 = h[a], x1 = h[b];
    h[a] = x0 * c - x1 * s;
    h[b] = x0 * s + x1 * c;
}

__device__ __forceinline__ float silu_times(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
}

// g = silu(g) * u, element-wise.
extern "C" __global__ void silu_mul(float* __restrict__ g, const float* __restrict__ u, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    g[i] = silu_times(g[i], u[i]);
}

// silu_mul, and g's units of 32 as Q8_1 (quantize_q8_1's), for the down projection's
// matrix-vector product. A warp per unit, SILU_Q8_WARPS warps a block.
#define SILU_Q8_WARPS 4
extern "C" __global__ void __launch_bounds__(WARP * SILU_Q8_WARPS)
silu_mul_q8(float* __restrict__ g, const float* __restrict__ u, BlockQ8_1* __restrict__ q8, int units) {
    int unit = blockIdx.x * SILU_Q8_WARPS + threadIdx.y;
    if (unit >= units) return;
    size_t i = (size_t)unit * WARP + threadIdx.x;
    float v = silu_times(g[i], u[i]);
    g[i] = v;
    q8_1_unit(v, q8 + unit, threadIdx.x);
}

// x += y, element-wise.
extern "C" __global__ void add_assign(float* __restrict__ x, const float* __restrict__ y, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// x[r] += bias for every row r of `cols` (Qwen 2's Q/K/V biases).
extern "C" __global__ void add_bias(float* __restrict__ x, const float* __restrict__ bias, size_t n, int cols) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % cols];
}

// f32 -> f16 (round to nearest even), element-wise: activations for cuBLAS.
extern "C" __global__ void to_f16(const float* __restrict__ x, u16* __restrict__ out, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_f16(x[i]);
}

// out[j] = x[rows[j]] for j < n: the rows whose logits are wanted.
extern "C" __global__ void gather_rows(const float* __restrict__ x, const u32* __restrict__ rows, int n, int cols,
                                       float* __restrict__ out) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * cols) return;
    size_t j = i / cols, c = i % cols;
    out[i] = x[(size_t)rows[j] * cols + c];
}

// y[rows[j]] += w[j] * src[j] for j < n (a routed expert's outputs into the rows routed to
// it, weighted; one expert a launch, so no two j name one row).
extern "C" __global__ void scatter_add_scaled(const float* __restrict__ src, const u32* __restrict__ rows,
                                              const float* __restrict__ w, int n, int cols, float* __restrict__ y) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n * cols) return;
    size_t j = i / cols, c = i % cols;
    y[(size_t)rows[j] * cols + c] += w[j] * src[i];
}

// The index of each row's largest value (`out[row]`), as the host's greedy sampler picks it:
// the first maximum, NaNs never chosen, and 0 when the row's first value is NaN or no value
// is above minus infinity. One block of ARGMAX_THREADS per row.
#define ARGMAX_THREADS 256
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int cols, u32* __restrict__ out) {
    __shared__ float sv[ARGMAX_THREADS];
    __shared__ int si[ARGMAX_THREADS];
    const float* row = x + (size_t)blockIdx.x * cols;
    const int t = threadIdx.x;
    float best = -__int_as_float(0x7f800000);
    int bi = cols;
    for (int i = t; i < cols; i += ARGMAX_THREADS) {
        float v = row[i];
        if (v > best) {
            best = v;
            bi = i;
        }
    }
    sv[t] = best;
    si[t] = bi;
    __syncthreads();
    for (int s = ARGMAX_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) {
            float v = sv[t + s];
            int i = si[t + s];
            if (v > sv[t] || (v == sv[t] && i < si[t])) {
                sv[t] = v;
                si[t] = i;
            }
        }
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = (row[0] != row[0] || si[0] == cols) ? 0u : (u32)si[0];
}
