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
// exponentials, as the host kernels and the cpu-workers give it). A prefill row is an item
// whose range is its causal prefix.

#define ATT_THREADS 128
#define ATT_TILE 128
#define ATT_HEADS 4
#define ATT_MAX_HEAD_DIM 256
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

    for (int i = threadIdx.x; i < nh * head_dim; i += ATT_THREADS) {
        int h = i / head_dim, d = i % head_dim;
        qs[h][d] = q[((long long)row * n_head + h0 + h) * head_dim + d];
        os[h][d] = 0.0f;
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
        // Scores: one position per thread, for every head of the block.
        float x[ATT_HEADS];
        if (threadIdx.x < nt) {
            const u32* kr = (const u32*)(pool + krow[threadIdx.x]);
            float acc[ATT_HEADS] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int d2 = 0; d2 < head_dim / 2; d2++) {
                u32 two = kr[d2];
                float k0 = f16_to_f32((u16)(two & 0xffff)), k1 = f16_to_f32((u16)(two >> 16));
                for (int h = 0; h < ATT_HEADS; h++) {
                    if (h < nh) acc[h] += qs[h][2 * d2] * k0 + qs[h][2 * d2 + 1] * k1;
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
        // Values: each thread owns output elements (head, d) and sums the tile's positions.
        for (int i = threadIdx.x; i < nh * head_dim; i += ATT_THREADS) {
            int h = i / head_dim, d = i % head_dim;
            float acc = os[h][d] * corr[h];
            for (int t = 0; t < nt; t++) acc += sc[h][t] * f16_to_f32(pool[krow[t] + v_off + d]);
            os[h][d] = acc;
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
                                      float* out, float* lse) {
    const long long ih = blockIdx.x;
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
        out[ih * head_dim + d] = total > 0.0f ? acc / total : 0.0f;
    }
    if (threadIdx.x == 0) lse[ih] = total > 0.0f ? mmax + logf(total) : NEG_INF;
}
