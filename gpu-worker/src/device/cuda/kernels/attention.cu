// Attention on the GPU over the KV mirror (stage B). The mirror is a pool of pages; a page
// holds `page_size` consecutive positions of one sequence for every layer the device holds:
// [layer][K, V][kv_head][position in page][head_dim], f16. A sequence's page table lists its
// pages in position order.
//
// kv_store writes rows' K and V into the pool. attn_partial is split-K ("flash decoding"):
// each block attends one item's positions [s0, s1) for up to ATT_HEADS query heads of one KV
// head's group, with an online softmax over tiles of ATT_TILE positions, and leaves the
// running max, the sum of exponentials and the unnormalised output; attn_merge combines an
// item's splits into the output and its log-sum-exp (natural log of the scaled scores' sum of
// exponentials, as the host kernels and the cpu-workers give it), at the output slot `dest`
// names. attn_prefill attends several rows of one sequence at once (a prefill chunk's rows,
// each over its causal prefix): a block takes up to PF_QUERIES query vectors (rows × the
// query heads of one KV head) and reads each tile of K and V into shared memory once for all
// of them, where attn_partial would read it once per row. kv_to_arena writes rows' K and V
// into the cpu-workers' arenas themselves, in host memory the GPU maps; arena_to_mirror reads
// them from there into the pool (what the mirror lacks of a context it attends).

#define ATT_THREADS 128
#define ATT_TILE 128
#define ATT_HEADS 4
#define ATT_MAX_HEAD_DIM 256
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_DIMS_PER_LANE (ATT_MAX_HEAD_DIM / 32)
#define NEG_INF (-__int_as_float(0x7f800000))

// Rows' f32 K and V (`[row][kv_dim]`) into the pool: row r at slot[r] (page * page_size +
// offset), layer `layer`; a negative slot skips the row.
extern "C" __global__ void kv_store(const float* k, const float* v, const int* slot, int n_rows, int kv_dim, int head_dim,
                                    u16* pool, long long page_elems, int layer, int page_size) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_rows * kv_dim) return;
    int r = (int)(i / kv_dim), e = (int)(i % kv_dim);
    int s = slot[r];
    if (s < 0) return;
    int kh = e / head_dim, d = e % head_dim;
    long long page = s / page_size;
    int p = s % page_size;
    long long base = page * page_elems + (long long)layer * 2 * kv_dim * page_size + ((long long)kh * page_size + p) * head_dim + d;
    pool[base] = f32_to_f16(k[i]);
    pool[base + (long long)kv_dim * page_size] = f32_to_f16(v[i]);
}

// Rows' f32 K and V (`[row][kv_dim]`) of `layer` into the cpu-workers' KV arenas in place: host
// memory registered with cuMemHostRegister and mapped for the GPU. Row r's runs follow each
// other strides[r] bytes apart, in the arena's [layer][K, V][kv_head] order, from rows[r], the
// device address of its slot in the first run: its K row of KV head h at rows[r] + (layer · 2 ·
// n_kv_head + h) · strides[r], its V row n_kv_head runs further. Stored as the host's
// KvArenas::write_token stores them: f16 rounded to nearest even (q8 = 0), or Q8_0 blocks of
// 32 (q8 = 1; head_dim a multiple of 32): the scale amax / 127 as f16 and the quants
// x · (127 / amax) rounded to even. Grid: (n_rows, n_kv_head, 2: K then V), one warp a block.
extern "C" __global__ void kv_to_arena(const float* __restrict__ k, const float* __restrict__ v, const u64* __restrict__ rows,
                                       const u64* __restrict__ strides, int n_kv_head, int head_dim, int layer, int q8) {
    int r = blockIdx.x, h = blockIdx.y, is_v = blockIdx.z, lane = threadIdx.x;
    const float* x = (is_v ? v : k) + ((size_t)r * n_kv_head + h) * head_dim;
    u8* dst = (u8*)(rows[r] + ((u64)(layer * 2 + is_v) * n_kv_head + h) * strides[r]);
    for (int i0 = 0; i0 < head_dim; i0 += WARP) {
        int i = i0 + lane;
        float val = i < head_dim ? x[i] : 0.0f;
        if (!q8) {
            if (i < head_dim) ((u16*)dst)[i] = f32_to_f16(val);
            continue;
        }
        float amax = warp_max(fabsf(val));
        float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        u8* block = dst + (i0 / 32) * 34;
        block[2 + lane] = (u8)(i8)(int)rintf(val * id);
        if (lane == 0) *(u16*)block = f32_to_f16(amax / 127.0f);
    }
}

// Rows of `layer` from the cpu-workers' arenas (host memory the GPU maps) into the pool, row r
// read where kv_to_arena writes it (rows[r]: its slot in the first run; its runs strides[r]
// bytes apart) and stored at slot[r] (page * page_size + offset) as kv_store stores the host's
// widened rows: an f16 arena's values as they are, a Q8_0 arena's as f16(d · q), d widened to
// f32 (the host's widen_q8_0 and kv_store's rounding). Grid: (n_rows, n_kv_head, 2: K then V),
// one warp a block.
extern "C" __global__ void arena_to_mirror(const u64* __restrict__ rows, const u64* __restrict__ strides, const int* __restrict__ slot,
                                           int n_kv_head, int head_dim, int layer, int q8, u16* pool, long long page_elems, int page_size) {
    int r = blockIdx.x, h = blockIdx.y, is_v = blockIdx.z, lane = threadIdx.x;
    const u8* src = (const u8*)(rows[r] + ((u64)(layer * 2 + is_v) * n_kv_head + h) * strides[r]);
    int s = slot[r];
    long long page = s / page_size;
    int p = s % page_size;
    long long kv_dim = (long long)n_kv_head * head_dim;
    u16* dst = pool + page * page_elems + (long long)layer * 2 * kv_dim * page_size + is_v * kv_dim * page_size + ((long long)h * page_size + p) * head_dim;
    for (int i = lane; i < head_dim; i += WARP) {
        if (!q8) {
            dst[i] = ((const u16*)src)[i];
            continue;
        }
        const u8* block = src + (i / 32) * 34;
        dst[i] = f32_to_f16((float)(i8)block[2 + i % 32] * f16_to_f32(ld_u16(block, 0)));
    }
}

// The block-wide maximum (max = 1) or sum (max = 0) of each head's value `x[h]`, for `nh`
// heads; every thread gets the results. `red` holds ATT_HEADS * ATT_THREADS / WARP floats.
__device__ __forceinline__ void block_reduce(float* x, int nh, int max, float* red) {
    int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int warps = ATT_THREADS / WARP;
    for (int h = 0; h < ATT_HEADS; h++) {
        if (h >= nh) break;
        float v = max ? warp_max(x[h]) : warp_sum(x[h]);
        if (lane == 0) red[h * warps + warp] = v;
    }
    __syncthreads();
    for (int h = 0; h < ATT_HEADS; h++) {
        if (h >= nh) break;
        float v = red[h * warps];
        for (int w = 1; w < warps; w++) v = max ? fmaxf(v, red[h * warps + w]) : v + red[h * warps + w];
        x[h] = v;
    }
    __syncthreads();
}

// items: per item (row of q, start, end, offset of its page table in `pages`).
// Grid: x items, y n_kv_head * head groups, z splits. Partials: [item][n_head][split] (m, l)
// and [item][n_head][split][head_dim] (o).
extern "C" __global__ void attn_partial(const float* q, const u16* pool, long long page_elems, int layer, const int* pages,
                                        const int* items, int n_kv_head, int head_dim, int group, int page_size, int n_split,
                                        float scale, float softcap, float* part_m, float* part_l, float* part_o) {
    __shared__ float qs[ATT_HEADS][ATT_MAX_HEAD_DIM];
    __shared__ float os[ATT_HEADS][ATT_MAX_HEAD_DIM];
    __shared__ float sc[ATT_HEADS][ATT_TILE];
    __shared__ long long krow[ATT_TILE];
    __shared__ float corr[ATT_HEADS];
    __shared__ float red[ATT_HEADS * ATT_THREADS / WARP];

    const int it = blockIdx.x;
    const int hgroups = (group + ATT_HEADS - 1) / ATT_HEADS;
    const int kh = blockIdx.y / hgroups, hg = blockIdx.y % hgroups;
    const int h0 = kh * group + hg * ATT_HEADS;
    const int nh = min(ATT_HEADS, group - hg * ATT_HEADS);
    const int n_head = n_kv_head * group;
    const int row = items[4 * it], start = items[4 * it + 1], end = items[4 * it + 2], toff = items[4 * it + 3];
    const int chunk = (end - start + n_split - 1) / n_split;
    const int s0 = start + blockIdx.z * chunk, s1 = min(end, s0 + chunk);
    const int kv_dim = n_kv_head * head_dim;
    const long long layer_off = (long long)layer * 2 * kv_dim * page_size + (long long)kh * page_size * head_dim;
    const long long v_off = (long long)kv_dim * page_size;
    // Every K row starts on 16 bytes: the pool does, and each row's offset in halves is a
    // multiple of 8 when the head's and the page's are.
    const bool k_in_16 = head_dim % 8 == 0 && page_elems % 8 == 0;

    for (int i = threadIdx.x; i < nh * head_dim; i += ATT_THREADS) {
        int h = i / head_dim, d = i % head_dim;
        qs[h][d] = q[((long long)row * n_head + h0 + h) * head_dim + d];
    }
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int dpl = (head_dim + WARP - 1) / WARP;
    // This warp's unnormalised output: head h, dimension lane + WARP * j.
    float acc_o[ATT_HEADS][ATT_DIMS_PER_LANE];
#pragma unroll
    for (int h = 0; h < ATT_HEADS; h++) {
#pragma unroll
        for (int j = 0; j < ATT_DIMS_PER_LANE; j++) acc_o[h][j] = 0.0f;
    }
    float m[ATT_HEADS], l[ATT_HEADS];
    for (int h = 0; h < ATT_HEADS; h++) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
    }
    for (int t0 = s0; t0 < s1; t0 += ATT_TILE) {
        const int nt = min(ATT_TILE, s1 - t0);
        __syncthreads();
        if (threadIdx.x < nt) {
            int pos = t0 + threadIdx.x;
            krow[threadIdx.x] = (long long)pages[toff + pos / page_size] * page_elems + layer_off + (long long)(pos % page_size) * head_dim;
        }
        __syncthreads();
        // Scores: one position per thread, for every head of the block. Each thread reads its
        // own K row, so a warp's load touches 32 rows: 16 bytes a load (where every row starts
        // on 16 bytes) instead of 4, a quarter of the loads; the same sums in the same order.
        float x[ATT_HEADS];
        if (threadIdx.x < nt) {
            float acc[ATT_HEADS] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (k_in_16) {
                const uint4* kr = (const uint4*)(pool + krow[threadIdx.x]);
#pragma unroll 2
                for (int d8 = 0; d8 < head_dim / 8; d8++) {
                    uint4 eight = kr[d8];
                    u32 words[4] = {eight.x, eight.y, eight.z, eight.w};
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        float k0 = f16_to_f32((u16)(words[i] & 0xffff)), k1 = f16_to_f32((u16)(words[i] >> 16));
                        int d = 8 * d8 + 2 * i;
                        for (int h = 0; h < ATT_HEADS; h++) {
                            if (h < nh) acc[h] += qs[h][d] * k0 + qs[h][d + 1] * k1;
                        }
                    }
                }
            } else {
                const u32* kr = (const u32*)(pool + krow[threadIdx.x]);
#pragma unroll 8
                for (int d2 = 0; d2 < head_dim / 2; d2++) {
                    u32 two = kr[d2];
                    float k0 = f16_to_f32((u16)(two & 0xffff)), k1 = f16_to_f32((u16)(two >> 16));
                    for (int h = 0; h < ATT_HEADS; h++) {
                        if (h < nh) acc[h] += qs[h][2 * d2] * k0 + qs[h][2 * d2 + 1] * k1;
                    }
                }
            }
            for (int h = 0; h < ATT_HEADS; h++) {
                float s = acc[h] * scale;
                if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                x[h] = s;
            }
        } else {
            for (int h = 0; h < ATT_HEADS; h++) x[h] = NEG_INF;
        }
        float mx[ATT_HEADS];
        for (int h = 0; h < ATT_HEADS; h++) mx[h] = x[h];
        block_reduce(mx, nh, 1, red);
        float p[ATT_HEADS];
        for (int h = 0; h < ATT_HEADS; h++) {
            if (h >= nh) break;
            float m_new = fmaxf(m[h], mx[h]);
            p[h] = threadIdx.x < nt ? expf(x[h] - m_new) : 0.0f;
            if (threadIdx.x < nt) sc[h][threadIdx.x] = p[h];
            float c = expf(m[h] - m_new);
            if (threadIdx.x == 0) corr[h] = c;
            l[h] *= c;
            m[h] = m_new;
        }
        block_reduce(p, nh, 0, red);
        for (int h = 0; h < ATT_HEADS; h++) {
            if (h < nh) l[h] += p[h];
        }
        // Values: warp w sums the tile's positions w, w + ATT_WARPS, ..., lane l dimensions l,
        // l + WARP, ... (a V row read by the warp in runs of 64 bytes), so that a thread waits
        // on a load once per ATT_WARPS positions, several in flight, not once per position.
#pragma unroll
        for (int h = 0; h < ATT_HEADS; h++) {
            float c = h < nh ? corr[h] : 0.0f;
#pragma unroll
            for (int j = 0; j < ATT_DIMS_PER_LANE; j++) acc_o[h][j] *= c;
        }
#pragma unroll 4
        for (int t = warp; t < nt; t += ATT_WARPS) {
            const u16* vr = pool + krow[t] + v_off;
            float v[ATT_DIMS_PER_LANE];
#pragma unroll
            for (int j = 0; j < ATT_DIMS_PER_LANE; j++) {
                int d = lane + WARP * j;
                v[j] = j < dpl && d < head_dim ? f16_to_f32(vr[d]) : 0.0f;
            }
#pragma unroll
            for (int h = 0; h < ATT_HEADS; h++) {
                float p = h < nh ? sc[h][t] : 0.0f;
#pragma unroll
                for (int j = 0; j < ATT_DIMS_PER_LANE; j++) {
                    if (j < dpl) acc_o[h][j] += p * v[j];
                }
            }
        }
    }
    // The warps' sums into os, one warp after another.
    for (int w = 0; w < ATT_WARPS; w++) {
        __syncthreads();
        if (warp == w) {
#pragma unroll
            for (int h = 0; h < ATT_HEADS; h++) {
#pragma unroll
                for (int j = 0; j < ATT_DIMS_PER_LANE; j++) {
                    int d = lane + WARP * j;
                    if (h < nh && j < dpl && d < head_dim) os[h][d] = (w == 0 ? 0.0f : os[h][d]) + acc_o[h][j];
                }
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nh * head_dim; i += ATT_THREADS) {
        int h = i / head_dim, d = i % head_dim;
        long long at = ((long long)it * n_head + h0 + h) * n_split + blockIdx.z;
        part_o[at * head_dim + d] = os[h][d];
        if (d == 0) {
            part_m[at] = m[h];
            part_l[at] = l[h];
        }
    }
}

// An item's splits merged, one block per (item, head): the output (zeros where nothing was
// attended) and the log-sum-exp (minus infinity there).
extern "C" __global__ void attn_merge(const float* part_m, const float* part_l, const float* part_o, int n_split, int head_dim,
                                      int n_head, const int* dest, float* out, float* lse) {
    const long long ih = blockIdx.x;
    // The output slot of item ih / n_head (dest[item]), head ih % n_head.
    const long long oh = (long long)dest[ih / n_head] * n_head + ih % n_head;
    float mmax = NEG_INF;
    for (int s = 0; s < n_split; s++) mmax = fmaxf(mmax, part_m[ih * n_split + s]);
    float total = 0.0f;
    for (int s = 0; s < n_split; s++) {
        float ps = part_l[ih * n_split + s];
        if (ps > 0.0f) total += ps * expf(part_m[ih * n_split + s] - mmax);
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < n_split; s++) {
            if (part_l[ih * n_split + s] > 0.0f) acc += part_o[(ih * n_split + s) * head_dim + d] * expf(part_m[ih * n_split + s] - mmax);
        }
        out[oh * head_dim + d] = total > 0.0f ? acc / total : 0.0f;
    }
    if (threadIdx.x == 0) lse[oh] = total > 0.0f ? mmax + logf(total) : NEG_INF;
}

#define PF_QUERIES 32
// Floats of Q (PF_QUERIES * head_dim at most), and halves of a K or V tile, in shared memory.
#define PF_ELEMS 4096
#define PF_TILE 32

// Prefill attention. tiles: per tile (first item, items, offset of the sequence's page table
// in `pages`); the items (as attn_partial's: row of q, start, end, -) of a tile are rows of
// one sequence, items * group <= PF_QUERIES and items * group * head_dim <= PF_ELEMS. Grid: x
// tiles, y n_kv_head; ATT_THREADS threads. Writes item j's output and log-sum-exp at slot j.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
attn_prefill(const float* q, const u16* pool, long long page_elems, int layer, const int* pages, const int* items, const int* tiles,
             int n_kv_head, int head_dim, int group, int page_size, float scale, float softcap, float* out, float* lse) {
    __shared__ float qs[PF_ELEMS];
    // K rows padded by one word, so that the lanes reading one column of a tile's rows meet
    // no bank twice.
    __shared__ u16 ks[PF_TILE * (ATT_MAX_HEAD_DIM + 2)];
    __shared__ u16 vs[PF_ELEMS];
    __shared__ float sc[PF_QUERIES * PF_TILE];
    __shared__ float ms[PF_QUERIES], ls[PF_QUERIES], cs[PF_QUERIES];
    __shared__ int lo[PF_QUERIES], hi[PF_QUERIES];

    const int tile = blockIdx.x, kh = blockIdx.y;
    const int j0 = tiles[3 * tile], nr = tiles[3 * tile + 1], toff = tiles[3 * tile + 2];
    const int nq = nr * group, n_head = n_kv_head * group, kv_dim = n_kv_head * head_dim;
    const int kt = min(PF_TILE, PF_ELEMS / head_dim), kstride = head_dim + 2, half = head_dim / 2;
    const long long layer_off = (long long)layer * 2 * kv_dim * page_size + (long long)kh * page_size * head_dim;
    const long long v_off = (long long)kv_dim * page_size;
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;

    // Query vector i: row i / group of the tile, head kh * group + i % group.
    for (int i = tid; i < nq * head_dim; i += ATT_THREADS) {
        int qi = i / head_dim, d = i % head_dim;
        int row = items[4 * (j0 + qi / group)];
        qs[i] = q[((long long)row * n_head + kh * group + qi % group) * head_dim + d];
    }
    if (tid < nr) {
        lo[tid] = items[4 * (j0 + tid) + 1];
        hi[tid] = items[4 * (j0 + tid) + 2];
    }
    if (tid < nq) {
        ms[tid] = NEG_INF;
        ls[tid] = 0.0f;
    }
    __syncthreads();
    int t_begin = lo[0], t_end = hi[0];
    for (int r = 1; r < nr; r++) {
        t_begin = min(t_begin, lo[r]);
        t_end = max(t_end, hi[r]);
    }
    // Each thread's output elements: e = tid + ATT_THREADS * j.
    const int own = (nq * head_dim + ATT_THREADS - 1) / ATT_THREADS;
    float o[PF_ELEMS / ATT_THREADS];
#pragma unroll
    for (int j = 0; j < PF_ELEMS / ATT_THREADS; j++) o[j] = 0.0f;

    for (int t0 = t_begin; t0 < t_end; t0 += kt) {
        const int nt = min(kt, t_end - t0);
        __syncthreads();
        for (int i = tid; i < nt * half; i += ATT_THREADS) {
            int t = i / half, d2 = i % half, pos = t0 + t;
            long long at = (long long)pages[toff + pos / page_size] * page_elems + layer_off + (long long)(pos % page_size) * head_dim;
            u32 k2 = ((const u32*)(pool + at))[d2], v2 = ((const u32*)(pool + at + v_off))[d2];
            ks[t * kstride + 2 * d2] = (u16)(k2 & 0xffff);
            ks[t * kstride + 2 * d2 + 1] = (u16)(k2 >> 16);
            vs[t * head_dim + 2 * d2] = (u16)(v2 & 0xffff);
            vs[t * head_dim + 2 * d2 + 1] = (u16)(v2 >> 16);
        }
        __syncthreads();
        // Scores; positions outside a row's range (past it: causality; before it: a sliding
        // window) count as minus infinity.
        for (int i = tid; i < nq * PF_TILE; i += ATT_THREADS) {
            int qi = i / PF_TILE, t = i % PF_TILE, r = qi / group, pos = t0 + t;
            float s = NEG_INF;
            if (t < nt && pos >= lo[r] && pos < hi[r]) {
                float acc = 0.0f;
                const float* qv = qs + qi * head_dim;
                const u16* kr = ks + t * kstride;
                for (int d = 0; d < head_dim; d++) acc += qv[d] * f16_to_f32(kr[d]);
                s = acc * scale;
                if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            }
            sc[i] = s;
        }
        __syncthreads();
        // The online softmax, a warp per query vector, a lane per position.
        for (int qi = warp; qi < nq; qi += ATT_THREADS / WARP) {
            float x = sc[qi * PF_TILE + lane];
            float m_old = ms[qi], m_new = fmaxf(m_old, warp_max(x));
            float p = x == NEG_INF ? 0.0f : expf(x - m_new);
            sc[qi * PF_TILE + lane] = p;
            float sum = warp_sum(p);
            if (lane == 0) {
                float c = m_new == NEG_INF ? 1.0f : expf(m_old - m_new);
                ls[qi] = ls[qi] * c + sum;
                ms[qi] = m_new;
                cs[qi] = c;
            }
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < PF_ELEMS / ATT_THREADS; j++) {
            int e = tid + ATT_THREADS * j;
            if (j < own && e < nq * head_dim) {
                int qi = e / head_dim, d = e % head_dim;
                float acc = o[j] * cs[qi];
                for (int t = 0; t < nt; t++) acc += sc[qi * PF_TILE + t] * f16_to_f32(vs[t * head_dim + d]);
                o[j] = acc;
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < PF_ELEMS / ATT_THREADS; j++) {
        int e = tid + ATT_THREADS * j;
        if (j < own && e < nq * head_dim) {
            int qi = e / head_dim, d = e % head_dim;
            long long oh = (long long)(j0 + qi / group) * n_head + kh * group + qi % group;
            float l = ls[qi];
            out[oh * head_dim + d] = l > 0.0f ? o[j] / l : 0.0f;
            if (d == 0) lse[oh] = l > 0.0f ? ms[qi] + logf(l) : NEG_INF;
        }
    }
}

// Prefill attention on the tensor cores (sm_80 and later: mma_16816, f16 inputs, f32 sums),
// for attn_prefill's tiles and with its outputs, a tile taking up to PFM_QUERIES query vectors
// (rows x the query heads of one KV head, in attn_prefill's order): each of the block's
// PFM_WARPS warps takes 16 of them, rounded to f16 and kept in its registers as mma A
// fragments. K and V come through shared memory in stages of PFM_KT positions, row-major as
// the pool holds them, two stages in flight: while the warps work on one, the next one's rows
// are on their way (cp.async, 16 bytes a copy). Scores, the online softmax (in base 2) and the
// output stay in the fragments' registers: the scores' d fragments are the probabilities' A
// fragments, rounded to f16, and V's B fragments come transposed from shared memory by
// ldmatrix. A warp skips the stages its rows attend nothing of (past a causal prefix, before a
// sliding window). The tiles of the longest prefixes start first. Heads of a multiple of 16
// values: attn_prefill_mma64 for up to 64, attn_prefill_mma128 for up to 128 (else
// attn_prefill). Grid: x tiles, y n_kv_head; PFM_WARPS * WARP threads.
#define PFM_QUERIES 64
#define PFM_WARPS (PFM_QUERIES / 16)
#define PFM_KT 32
#define PFM_LOG2E 1.4426950408889634f
#define PFM_LN2 0.6931471805599453f

// A shared row's halves: the head's values padded by 8, so that the 8 rows a fragment (or an
// ldmatrix phase) reads start 4 banks apart and its lanes meet 32 different banks.
#define PFM_ROW(maxd) ((maxd) + 8)
// Halves of one stage: PFM_KT rows of K, then PFM_KT of V.
#define PFM_STAGE(maxd) (2 * PFM_KT * PFM_ROW(maxd))

// Copies K and V of positions t0 .. t0 + nt of the tile's sequence into a stage; rows past nt
// are zeros (their scores are masked, and 0 x garbage could be NaN).
template <int MAXD>
__device__ __forceinline__ void pfm_load(u16* stage, const u16* pool, const int* pages, int toff, long long page_elems, long long layer_off,
                                         long long v_off, int t0, int nt, int head_dim, int page_size) {
    const int rc = head_dim / 8, per = PFM_KT * rc;  // 16-byte pieces of a row, of a stage's K
    for (int i = threadIdx.x; i < 2 * per; i += PFM_WARPS * WARP) {
        const int which = i >= per, j = i - which * per, t = j / rc, c = j - t * rc;
        u16* dst = stage + (which * PFM_KT + t) * PFM_ROW(MAXD) + 8 * c;
        if (t < nt) {
            const int pos = t0 + t;
            const long long at =
                (long long)pages[toff + pos / page_size] * page_elems + layer_off + (long long)(pos % page_size) * head_dim + 8 * c + (which ? v_off : 0);
            cp_async16(dst, pool + at);
        } else {
            uint4 zero;
            zero.x = zero.y = zero.z = zero.w = 0;
            *(uint4*)dst = zero;
        }
    }
}

template <int MAXD>
__device__ __forceinline__ void attn_prefill_mma_body(u16* kv_s, int* lo, int* hi, const float* q, const u16* pool, long long page_elems, int layer,
                                                      const int* pages, const int* items, const int* tiles, int n_kv_head, int head_dim, int group,
                                                      int page_size, float scale, float softcap, float* out, float* lse) {
    const int tile = gridDim.x - 1 - blockIdx.x, kh = blockIdx.y;
    const int j0 = tiles[3 * tile], nr = tiles[3 * tile + 1], toff = tiles[3 * tile + 2];
    const int nq = nr * group, n_head = n_kv_head * group, kv_dim = n_kv_head * head_dim;
    const int kchunks = head_dim / 16, dtiles = head_dim / 8;
    const long long layer_off = (long long)layer * 2 * kv_dim * page_size + (long long)kh * page_size * head_dim;
    const long long v_off = (long long)kv_dim * page_size;
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP, g = lane / 4, t4 = lane % 4;
    const int q0 = warp * 16;
    const bool active = q0 < nq;

    if (tid < nr) {
        lo[tid] = items[4 * (j0 + tid) + 1];
        hi[tid] = items[4 * (j0 + tid) + 2];
    }
    // The warp's query vectors q0 + g and q0 + g + 8 as A fragments, 16 dimensions a chunk.
    u32 qa[MAXD / 16][4];
#pragma unroll
    for (int c = 0; c < MAXD / 16; c++) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int qi = q0 + g + 8 * (r % 2), d = 16 * c + 8 * (r / 2) + 2 * t4;
            float x0 = 0.0f, x1 = 0.0f;
            if (c < kchunks && qi < nq) {
                int row = items[4 * (j0 + qi / group)];
                const float* qv = q + ((long long)row * n_head + kh * group + qi % group) * head_dim + d;
                // Scaled before rounding to f16 (as llama.cpp's fattn-mma does): the same
                // relative precision, and a query past f16's range by up to the scale's
                // inverse (√head_dim) stays finite instead of turning the row into NaN.
                x0 = qv[0] * scale;
                x1 = qv[1] * scale;
            }
            qa[c][r] = pack_f16x2(x0, x1);
        }
    }
    __syncthreads();
    int t_begin = lo[0], t_end = hi[0];
    for (int r = 1; r < nr; r++) {
        t_begin = min(t_begin, lo[r]);
        t_end = max(t_end, hi[r]);
    }
    // The positions the warp's rows attend, and each of this lane's two query vectors.
    int w_lo = t_end, w_hi = t_begin;
    if (active) {
        for (int r = q0 / group; r <= min(q0 + 15, nq - 1) / group; r++) {
            w_lo = min(w_lo, lo[r]);
            w_hi = max(w_hi, hi[r]);
        }
    }
    int r_lo[2], r_hi[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int qi = q0 + g + 8 * i;
        r_lo[i] = qi < nq ? lo[qi / group] : 0;
        r_hi[i] = qi < nq ? hi[qi / group] : 0;
    }
    float o[MAXD / 8][4];
#pragma unroll
    for (int n = 0; n < MAXD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    // Running max (base 2) and sum of each of the lane's two query vectors.
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    if (t_begin < t_end) pfm_load<MAXD>(kv_s, pool, pages, toff, page_elems, layer_off, v_off, t_begin, min(PFM_KT, t_end - t_begin), head_dim, page_size);
    cp_async_commit();
    for (int it = 0, t0 = t_begin; t0 < t_end; it++, t0 += PFM_KT) {
        // The next stage's copies go out before this one is waited for.
        if (t0 + PFM_KT < t_end)
            pfm_load<MAXD>(kv_s + ((it + 1) & 1) * PFM_STAGE(MAXD), pool, pages, toff, page_elems, layer_off, v_off, t0 + PFM_KT,
                           min(PFM_KT, t_end - t0 - PFM_KT), head_dim, page_size);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const u16* ks = kv_s + (it & 1) * PFM_STAGE(MAXD);
        const u16* vs = ks + PFM_KT * PFM_ROW(MAXD);
        if (active && t0 < w_hi && t0 + PFM_KT > w_lo) {
            // Scores of the warp's 16 query vectors over the stage's positions: PFM_KT / 8 d fragments.
            float s[PFM_KT / 8][4];
#pragma unroll
            for (int n = 0; n < PFM_KT / 8; n++) {
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
                const u32* kr = (const u32*)(ks + (n * 8 + g) * PFM_ROW(MAXD)) + t4;
#pragma unroll
                for (int c = 0; c < MAXD / 16; c++) {
                    if (c >= kchunks) break;
                    const u32 b[2] = {kr[8 * c], kr[8 * c + 4]};
                    mma_16816(s[n], qa[c], b);
                }
            }
            // Scaled, capped, in base 2, and minus infinity outside each vector's range; then the
            // online softmax of each of the lane's two vectors (a row's PFM_KT scores lie in the 4
            // lanes of its group: 2 in each of their PFM_KT / 8 fragments).
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float mx = NEG_INF;
#pragma unroll
                for (int n = 0; n < PFM_KT / 8; n++)
#pragma unroll
                    for (int e = 2 * i; e < 2 * i + 2; e++) {
                        int pos = t0 + n * 8 + 2 * t4 + e % 2;
                        float x = s[n][e];
                        if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
                        x *= PFM_LOG2E;
                        if (pos < r_lo[i] || pos >= r_hi[i]) x = NEG_INF;
                        s[n][e] = x;
                        mx = fmaxf(mx, x);
                    }
                mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
                float m_new = fmaxf(m[i], mx), sum = 0.0f;
#pragma unroll
                for (int n = 0; n < PFM_KT / 8; n++)
#pragma unroll
                    for (int e = 2 * i; e < 2 * i + 2; e++) {
                        float p = s[n][e] == NEG_INF ? 0.0f : exp2f(s[n][e] - m_new);
                        s[n][e] = p;
                        sum += p;
                    }
                sum += __shfl_xor_sync(FULL_MASK, sum, 1);
                sum += __shfl_xor_sync(FULL_MASK, sum, 2);
                float c = m_new == NEG_INF ? 1.0f : exp2f(m[i] - m_new);
                l[i] = l[i] * c + sum;
                m[i] = m_new;
#pragma unroll
                for (int n = 0; n < MAXD / 8; n++) {
                    o[n][2 * i] *= c;
                    o[n][2 * i + 1] *= c;
                }
            }
            // o += P · V, 16 positions a step: P's A fragment from two score fragments; V's B
            // fragments of two 8-dimension tiles from one ldmatrix (matrices: positions 0-7 and
            // 8-15 of dimensions n, then of n + 1).
#pragma unroll
            for (int kc = 0; kc < PFM_KT / 16; kc++) {
                const u32 pa[4] = {pack_f16x2(s[2 * kc][0], s[2 * kc][1]), pack_f16x2(s[2 * kc][2], s[2 * kc][3]),
                                   pack_f16x2(s[2 * kc + 1][0], s[2 * kc + 1][1]), pack_f16x2(s[2 * kc + 1][2], s[2 * kc + 1][3])};
                const u16* vrow = vs + (16 * kc + (lane & 8) + (lane & 7)) * PFM_ROW(MAXD) + 8 * (lane >> 4);
#pragma unroll
                for (int n = 0; n < MAXD / 8; n += 2) {
                    if (n >= dtiles) break;
                    u32 b4[4];
                    ldmatrix_x4_trans(b4, vrow + 8 * n);
                    const u32 b0[2] = {b4[0], b4[1]}, b1[2] = {b4[2], b4[3]};
                    mma_16816(o[n], pa, b0);
                    mma_16816(o[n + 1], pa, b1);
                }
            }
        }
        // Every warp is done with this stage before the next iteration's copies overwrite it.
        __syncthreads();
    }
    if (!active) return;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int qi = q0 + g + 8 * i;
        if (qi >= nq) continue;
        long long oh = (long long)(j0 + qi / group) * n_head + kh * group + qi % group;
#pragma unroll
        for (int n = 0; n < MAXD / 8; n++) {
            if (n >= dtiles) break;
            int d = n * 8 + 2 * t4;
            out[oh * head_dim + d] = l[i] > 0.0f ? o[n][2 * i] / l[i] : 0.0f;
            out[oh * head_dim + d + 1] = l[i] > 0.0f ? o[n][2 * i + 1] / l[i] : 0.0f;
        }
        if (t4 == 0) lse[oh] = l[i] > 0.0f ? m[i] * PFM_LN2 + logf(l[i]) : NEG_INF;
    }
}

// The two entry points: one body, its fragments sized for heads of up to 64 or 128 values
// (registers, and shared memory: two stages of 2 x 32 rows, 18 or 34 KiB).
#define PFM_ENTRY(name, maxd)                                                                                             \
    extern "C" __global__ void __launch_bounds__(PFM_WARPS * WARP)                                                        \
    name(const float* q, const u16* pool, long long page_elems, int layer, const int* pages, const int* items, const int* tiles, \
         int n_kv_head, int head_dim, int group, int page_size, float scale, float softcap, float* out, float* lse) {     \
        __shared__ uint4 kv_s[2 * PFM_STAGE(maxd) / 8];                                                                   \
        __shared__ int lo[PFM_QUERIES], hi[PFM_QUERIES];                                                                  \
        attn_prefill_mma_body<maxd>((u16*)kv_s, lo, hi, q, pool, page_elems, layer, pages, items, tiles, n_kv_head, head_dim, group, \
                                    page_size, scale, softcap, out, lse);                                                 \
    }
PFM_ENTRY(attn_prefill_mma64, 64)
PFM_ENTRY(attn_prefill_mma128, 128)
