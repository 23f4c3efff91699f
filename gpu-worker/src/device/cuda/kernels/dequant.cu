// Duet CUDA kernels: weights to floats. `dequant_f16_*` turns whole weight rows into f16 for
// cuBLAS (prefill-sized batches); `get_rows_*` gathers token embeddings as f32. Both produce
// exactly the CPU's dequantised values (before the f16 rounding of the first).

// Rows `row0..row0 + rows` of a quantised weight (n_units per row) -> f16 [rows][n_units*32].
// A thread decodes a unit (DQ_UNITS consecutive units a block) into shared memory, and the block
// then writes its units' 64-byte runs out together, a word a thread: every store of a warp
// lands in 128 contiguous bytes, where a thread writing its own unit spread each store over
// 32 lines.
#define DQ_UNITS 128
// Words of a unit in shared memory, padded to 17 so that a warp's 32 units meet 32 banks.
#define DQ_STRIDE 17
template <int T>
__device__ __forceinline__ void dequant_f16(const u8* __restrict__ w, int row0, int rows, int n_units, u16* __restrict__ out) {
    __shared__ u32 stage[DQ_UNITS * DQ_STRIDE];
    size_t unit0 = (size_t)blockIdx.x * DQ_UNITS, total = (size_t)rows * n_units;
    size_t i = unit0 + threadIdx.x;
    if (i < total) {
        int row = (int)(i / n_units), u = (int)(i % n_units);
        size_t row_bytes = (size_t)(n_units * WARP / Fmt<T>::elems) * Fmt<T>::bytes;
        Unit r;
        load_unit<T>(w + (size_t)(row0 + row) * row_bytes, u, r);
#pragma unroll
        for (int e = 0; e < WARP / 2; ++e) stage[threadIdx.x * DQ_STRIDE + e] = pack_f16x2(unit_value(r, 2 * e), unit_value(r, 2 * e + 1));
    }
    __syncthreads();
    int here = total - unit0 < DQ_UNITS ? (int)(total - unit0) : DQ_UNITS;
    u32* o = (u32*)(out + unit0 * WARP);
    for (int k = threadIdx.x; k < here * (WARP / 2); k += DQ_UNITS) o[k] = stage[(k / (WARP / 2)) * DQ_STRIDE + k % (WARP / 2)];
}

// Embedding rows of `tokens` (n_tok of them) -> f32 [n_tok][n_units*32]. One thread per unit.
template <int T>
__device__ __forceinline__ void get_rows(const u8* __restrict__ w, int n_units, const u32* __restrict__ tokens, int n_tok,
                                         float* __restrict__ out) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_tok * n_units) return;
    int t = (int)(i / n_units), u = (int)(i % n_units);
    size_t row_bytes = (size_t)(n_units * WARP / Fmt<T>::elems) * Fmt<T>::bytes;
    Unit r;
    load_unit<T>(w + (size_t)tokens[t] * row_bytes, u, r);
    float* o = out + i * WARP;
#pragma unroll
    for (int e = 0; e < WARP; ++e) o[e] = unit_value(r, e);
}

#define DEQUANT(suffix, T)                                                                                     \
    extern "C" __global__ void dequant_f16_##suffix(const u8* w, int row0, int rows, int n_units, u16* out) {  \
        dequant_f16<T>(w, row0, rows, n_units, out);                                                           \
    }                                                                                                          \
    extern "C" __global__ void get_rows_##suffix(const u8* w, int n_units, const u32* tokens, int n_tok, float* out) { \
        get_rows<T>(w, n_units, tokens, n_tok, out);                                                           \
    }
DEQUANT(q4_0, T_Q4_0)
DEQUANT(q4_1, T_Q4_1)
DEQUANT(q5_0, T_Q5_0)
DEQUANT(q5_1, T_Q5_1)
DEQUANT(q8_0, T_Q8_0)
DEQUANT(q4_k, T_Q4_K)
DEQUANT(q5_k, T_Q5_K)
DEQUANT(q6_k, T_Q6_K)

// Float weights: one thread per element.
__device__ __forceinline__ float float_at(int ty, const u8* base, size_t i) {
    if (ty == T_F32) return ((const float*)base)[i];
    u16 h = ((const u16*)base)[i];
    return ty == T_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

// Rows `row0..row0 + rows` of an F32/F16/BF16 weight (`ty`) -> f16 [rows][cols].
extern "C" __global__ void dequant_f16_float(int ty, const u8* __restrict__ w, int row0, int rows, int cols, u16* __restrict__ out) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * cols) return;
    const u8* base = w + (size_t)row0 * cols * (ty == T_F32 ? 4 : 2);
    out[i] = ty == T_F16 ? ((const u16*)base)[i] : f32_to_f16(float_at(ty, base, i));
}

// Embedding rows of `tokens` of an F32/F16/BF16 weight (`ty`) -> f32 [n_tok][cols].
extern "C" __global__ void get_rows_float(int ty, const u8* __restrict__ w, int cols, const u32* __restrict__ tokens, int n_tok,
                                          float* __restrict__ out) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_tok * cols) return;
    size_t t = i / cols, c = i % cols;
    out[i] = float_at(ty, w + (size_t)tokens[t] * cols * (ty == T_F32 ? 4 : 2), c);
}
