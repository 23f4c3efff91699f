// Duet CUDA kernels: shared device helpers. NVRTC compiles these with no headers at all, so
// the f16/bf16 conversions (PTX cvt; the host's under DUET_HOST, where tests run the kernels
// on the CPU) and the warp reductions are defined here. Every kernel
// file is compiled as types.cuh + common.cuh + quants.cuh + the file (see kernels.rs).

#define FULL_MASK 0xffffffffu

#ifdef DUET_HOST
// The kernels run on the host in tests (gpu-worker/tests/support/cuda_on_host.h).
__device__ __forceinline__ float f16_to_f32(u16 h) {
    return host_f16_to_f32(h);
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    return host_f32_to_f16(f);
}
#else
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// ggml's GGML_BF16_TO_FP32: a plain shift (no quieting of signalling NaNs).
__device__ __forceinline__ float bf16_to_f32(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}

// A little-endian u16 at byte offset `off` (2-aligned) of `p`.
__device__ __forceinline__ u16 ld_u16(const u8* p, int off) {
    return *(const u16*)(p + off);
}

// Four bytes at a 2-aligned address as one int (every GGUF block and field is 2-aligned).
__device__ __forceinline__ int ld_int_b2(const u8* p) {
    const u16* h = (const u16*)p;
    return (int)((u32)h[0] | ((u32)h[1] << 16));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = WARP / 2; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int off = WARP / 2; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int off = WARP / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, off));
    return v;
}

// Two floats as one word of two f16 (`lo` in the low half), an mma fragment's register.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    return (u32)f32_to_f16(lo) | ((u32)f32_to_f16(hi) << 16);
}

// d += A · B on the tensor cores, for the whole warp (PTX mma.sync.aligned.m16n8k16.row.col,
// f16 inputs, f32 sums; sm_80 and later: its callers are launched only there). Each lane holds
// the PTX ISA's fragments, with g = lane / 4 and t = lane % 4 and two f16 to a word (the lower
// column or row in the low half): A (16 x 16) a[0..3] = row g, row g + 8, row g, row g + 8 of
// columns 2t, 2t + 1 (a[0], a[1]) and 8 + 2t, 9 + 2t (a[2], a[3]); B (16 x 8) b[0] = rows 2t,
// 2t + 1 and b[1] = rows 8 + 2t, 9 + 2t of column g; d (16 x 8) = (g, 2t), (g, 2t + 1), (g + 8,
// 2t), (g + 8, 2t + 1).
#ifdef DUET_HOST
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    host_mma_16816(d, a, b);
}
#else
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
}
#endif
