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

// d += A · B on the integer tensor cores, for the whole warp (PTX
// mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32; sm_80 and later: its callers are launched
// only there). Four int8 to a word, the lowest k in the low byte; with g = lane / 4, t = lane %
// 4: A (16 x 16) a[0] = row g, a[1] = row g + 8, each of columns 4t..4t + 3; B (16 x 8) b = rows
// 4t..4t + 3 of column g; d (16 x 8) as mma_16816's.
#ifdef DUET_HOST
__device__ __forceinline__ void mma_s8_16816(int (&d)[4], const u32 (&a)[2], u32 b) {
    host_mma_s8_16816(d, a, b);
}
#else
__device__ __forceinline__ void mma_s8_16816(int (&d)[4], const u32 (&a)[2], u32 b) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b));
#else
    __trap();
#endif
}
#endif

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: four 8 x 8 matrices of f16 from shared
// memory, each transposed into the warp's registers. Lanes 8i..8i + 7 give the addresses of
// matrix i's rows (16 bytes each, 16-byte aligned); lane l receives in r[i] matrix i's elements
// (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4): where the rows are positions and the columns
// dimensions, the B fragment (k = positions) of an mma over them.
//
// cp_async16 copies 16 bytes from global to shared memory without passing through registers
// (cp.async.cg, sm_80 and later; a plain copy before); cp_async_commit closes a group of such
// copies, cp_async_wait<N> waits until at most N groups are still in flight (then a
// __syncthreads makes the copies visible to the block).
#ifdef DUET_HOST
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const u16* row) {
    host_ldmatrix_x4_trans(r, row);
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    memcpy(dst, src, 16);
}
__device__ __forceinline__ void cp_async_commit() {}
template <int N>
__device__ __forceinline__ void cp_async_wait() {}
#else
__device__ __forceinline__ unsigned shared_address(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const u16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(dst)), "l"(src));
#else
    *(uint4*)dst = *(const uint4*)src;
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    // The memory clobber keeps the compiler from moving shared-memory reads above the wait
    // should a later edit drop the __syncthreads that follows it.
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}
#endif
