// Duet's CUDA C kernels run on the host, for tests on machines without a GPU: the kernel
// files compile as C++20 after this header, and `launch` runs a grid block by block, every
// thread of a block an OS thread. `__syncthreads` is a barrier of the block's threads,
// `__shfl_xor_sync` an exchange through a barrier of the warp's 32 (aborting unless all 32
// lanes are running, as a full-mask shuffle needs), `__shared__` arrays are statics (one
// block runs at a time; filled with NaN bytes before each), and the PTX conversions of
// common.cuh are replaced by the
// compiler's `_Float16` (IEEE round to nearest even, as `cvt.rn`). What this checks is the
// kernels' indexing, tiling, reductions and arithmetic order; the GPU twins
// (`device::cuda::twins`) still check them on a GPU, with its own rounding of `expf` and the
// like.

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define DUET_HOST 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
// One block at a time: the block's threads share one copy, in a section of its own that
// `launch` fills with 0xff bytes (NaN as floats) before each block, so that a kernel reading
// shared memory it did not write this block shows.
#define __shared__ static __attribute__((section("duet_shared")))
extern "C" char __start_duet_shared[], __stop_duet_shared[];

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

// CUDA's built-in vector type of a 16-byte load.
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

inline thread_local dim3 threadIdx;
inline dim3 blockIdx, blockDim, gridDim;

namespace host_cuda {
using Barrier = std::barrier<>;
inline std::unique_ptr<Barrier> block_barrier;
inline std::vector<std::unique_ptr<Barrier>> warp_barriers;
// Per warp, each lane's value in a shuffle.
inline std::vector<std::array<uint64_t, 32>> exchange;
// Per warp, its lanes still running: a full-mask shuffle with fewer than 32 is undefined on
// a GPU (here it would read stale values), so it aborts.
inline std::unique_ptr<std::atomic<int>[]> live;

// Per warp, each lane's mma fragments (a[4], b[2]).
inline std::vector<std::array<std::array<uint32_t, 6>, 32>> mma_exchange;

inline unsigned linear_thread() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
}  // namespace host_cuda

inline void __syncthreads() {
    host_cuda::block_barrier->arrive_and_wait();
}

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int off) {
    static_assert(sizeof(T) <= 8);
    unsigned t = host_cuda::linear_thread(), warp = t / 32, lane = t % 32;
    if (host_cuda::live[warp].load() != 32) {
        fprintf(stderr, "__shfl_xor_sync with %d live lanes in warp %u of block (%u, %u, %u)\n", host_cuda::live[warp].load(), warp, blockIdx.x,
                blockIdx.y, blockIdx.z);
        abort();
    }
    auto& ex = host_cuda::exchange[warp];
    std::memcpy(&ex[lane], &v, sizeof(T));
    host_cuda::warp_barriers[warp]->arrive_and_wait();
    T r;
    std::memcpy(&r, &ex[lane ^ (unsigned)off], sizeof(T));
    host_cuda::warp_barriers[warp]->arrive_and_wait();
    return r;
}

inline float host_f16_to_f32(uint16_t h);

// common.cuh's mma_16816 (PTX mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32): every lane of
// the warp hands in its fragments (laid out as the PTX ISA's figures for m16n8k16 say, and as
// common.cuh describes them), then each computes its four elements of d += A · B from all of
// them: the products exact, summed in f64 and rounded once (the tensor cores' order and
// rounding of the f32 sums are not IEEE's either; the tests bound the difference).
inline void host_mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    unsigned t = host_cuda::linear_thread(), warp = t / 32, lane = t % 32;
    if (host_cuda::live[warp].load() != 32) {
        fprintf(stderr, "mma with %d live lanes in warp %u\n", host_cuda::live[warp].load(), warp);
        abort();
    }
    auto& ex = host_cuda::mma_exchange[warp];
    for (int i = 0; i < 4; i++) ex[lane][i] = a[i];
    for (int i = 0; i < 2; i++) ex[lane][4 + i] = b[i];
    host_cuda::warp_barriers[warp]->arrive_and_wait();
    float A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; l++) {
        unsigned g = l / 4, q = l % 4;
        for (int r = 0; r < 4; r++) {
            unsigned row = g + 8 * (r % 2), col = 8 * (r / 2) + 2 * q;
            A[row][col] = host_f16_to_f32((uint16_t)(ex[l][r] & 0xffff));
            A[row][col + 1] = host_f16_to_f32((uint16_t)(ex[l][r] >> 16));
        }
        for (int r = 0; r < 2; r++) {
            unsigned k = 8 * r + 2 * q;
            B[k][g] = host_f16_to_f32((uint16_t)(ex[l][4 + r] & 0xffff));
            B[k + 1][g] = host_f16_to_f32((uint16_t)(ex[l][4 + r] >> 16));
        }
    }
    host_cuda::warp_barriers[warp]->arrive_and_wait();
    unsigned g = lane / 4, q = lane % 4;
    for (int e = 0; e < 4; e++) {
        unsigned row = g + 8 * (e / 2), col = 2 * q + e % 2;
        double acc = d[e];
        for (int k = 0; k < 16; k++) acc += (double)A[row][k] * (double)B[k][col];
        d[e] = (float)acc;
    }
}

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// common.cuh's mma_s8_16816 (PTX mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32): every lane
// hands in its fragments (A: a[0] row g, a[1] row g + 8, columns 4t..4t + 3; B: rows 4t..4t + 3
// of column g; four int8 to a word, the lowest k in the low byte), then each computes its four
// elements of d += A · B exactly (int32 sums).
inline void host_mma_s8_16816(int (&d)[4], const uint32_t (&a)[2], uint32_t b) {
    unsigned t = host_cuda::linear_thread(), warp = t / 32, lane = t % 32;
    if (host_cuda::live[warp].load() != 32) {
        fprintf(stderr, "mma with %d live lanes in warp %u\n", host_cuda::live[warp].load(), warp);
        abort();
    }
    auto& ex = host_cuda::mma_exchange[warp];
    ex[lane][0] = a[0];
    ex[lane][1] = a[1];
    ex[lane][4] = b;
    host_cuda::warp_barriers[warp]->arrive_and_wait();
    int A[16][16], B[16][8];
    auto byte = [](uint32_t w, int i) { return (int)(int8_t)(uint8_t)(w >> (8 * i)); };
    for (unsigned l = 0; l < 32; l++) {
        unsigned g = l / 4, q = l % 4;
        for (int i = 0; i < 4; i++) {
            A[g][4 * q + i] = byte(ex[l][0], i);
            A[g + 8][4 * q + i] = byte(ex[l][1], i);
            B[4 * q + i][g] = byte(ex[l][4], i);
        }
    }
    host_cuda::warp_barriers[warp]->arrive_and_wait();
    unsigned g = lane / 4, q = lane % 4;
    for (int e = 0; e < 4; e++) {
        unsigned row = g + 8 * (e / 2), col = 2 * q + e % 2;
        for (int k = 0; k < 16; k++) d[e] += A[row][k] * B[k][col];
    }
}

// common.cuh's ldmatrix_x4_trans (PTX ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16): every
// lane hands in its row's address (lanes 8i..8i + 7: matrix i's rows 0..7), then each takes
// elements (2 (lane % 4), lane / 4) and (2 (lane % 4) + 1, lane / 4) of each matrix.
inline void host_ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* row) {
    unsigned t = host_cuda::linear_thread(), warp = t / 32, lane = t % 32;
    if (host_cuda::live[warp].load() != 32) {
        fprintf(stderr, "ldmatrix with %d live lanes in warp %u\n", host_cuda::live[warp].load(), warp);
        abort();
    }
    if ((uintptr_t)row % 16 != 0) {
        fprintf(stderr, "ldmatrix: lane %u's row is not 16-byte aligned\n", lane);
        abort();
    }
    auto& ex = host_cuda::exchange[warp];
    ex[lane] = (uint64_t)(uintptr_t)row;
    host_cuda::warp_barriers[warp]->arrive_and_wait();
    for (int i = 0; i < 4; i++) {
        const uint16_t* r0 = (const uint16_t*)(uintptr_t)ex[8 * i + 2 * (lane % 4)];
        const uint16_t* r1 = (const uint16_t*)(uintptr_t)ex[8 * i + 2 * (lane % 4) + 1];
        r[i] = (uint32_t)r0[lane / 4] | ((uint32_t)r1[lane / 4] << 16);
    }
    host_cuda::warp_barriers[warp]->arrive_and_wait();
}

inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
inline float __fmul_rn(float a, float b) {
    return a * b;
}
inline float __fadd_rn(float a, float b) {
    return a + b;
}
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
}
inline int min(int a, int b) {
    return a < b ? a : b;
}
inline int max(int a, int b) {
    return a > b ? a : b;
}
inline long long min(long long a, long long b) {
    return a < b ? a : b;
}
inline long long max(long long a, long long b) {
    return a > b ? a : b;
}

// common.cuh's f16 conversions, for DUET_HOST.
inline float host_f16_to_f32(uint16_t h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (float)x;
}
inline uint16_t host_f32_to_f16(float f) {
    _Float16 x = (_Float16)f;
    uint16_t h;
    std::memcpy(&h, &x, 2);
    return h;
}

// Runs `body` (a call of one kernel) as a grid of `grid` blocks of `block` threads.
template <class F>
void launch(dim3 grid, dim3 block, F body) {
    unsigned n = block.x * block.y * block.z;
    unsigned warps = (n + 31) / 32;
    gridDim = grid;
    blockDim = block;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = dim3{x, y, z};
                memset(__start_duet_shared, 0xff, (size_t)(__stop_duet_shared - __start_duet_shared));
                host_cuda::block_barrier = std::make_unique<host_cuda::Barrier>(n);
                host_cuda::warp_barriers.clear();
                for (unsigned w = 0; w < warps; ++w)
                    host_cuda::warp_barriers.push_back(std::make_unique<host_cuda::Barrier>(std::min(32u, n - 32 * w)));
                host_cuda::exchange.assign(warps, {});
                host_cuda::mma_exchange.assign(warps, {});
                host_cuda::live = std::make_unique<std::atomic<int>[]>(warps);
                for (unsigned w = 0; w < warps; ++w) host_cuda::live[w] = (int)std::min(32u, n - 32 * w);
                std::vector<std::thread> threads;
                threads.reserve(n);
                for (unsigned t = 0; t < n; ++t)
                    threads.emplace_back([&, t] {
                        threadIdx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                        body();
                        // A thread that has returned no longer holds the others back.
                        host_cuda::live[t / 32]--;
                        host_cuda::warp_barriers[t / 32]->arrive_and_drop();
                        host_cuda::block_barrier->arrive_and_drop();
                    });
                for (auto& th : threads) th.join();
            }
}

// Reading and writing the harnesses' binary streams (little-endian, as the tests write them).
template <class T>
T read_one(FILE* f = stdin) {
    T v;
    if (fread(&v, sizeof(T), 1, f) != 1) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
    return v;
}

template <class T>
std::vector<T> read_vec(size_t n, FILE* f = stdin) {
    std::vector<T> v(n);
    if (n && fread(v.data(), sizeof(T), n, f) != n) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
    return v;
}

template <class T>
void write_vec(const std::vector<T>& v, FILE* f = stdout) {
    fwrite(v.data(), sizeof(T), v.size(), f);
}
