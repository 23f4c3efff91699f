// Duet CUDA kernels: the GGUF block formats, read 32 elements ("a unit") at a time.
//
// Every quantised weight type is a sequence of units of 32 elements: a Q4_0/Q4_1/Q5_0/Q5_1/
// Q8_0 block is one unit, a Q4_K/Q5_K/Q6_K super-block of 256 is eight. `load_unit<T>` turns
// unit `u` of a row into 32 signed 8-bit quants packed four to an int (for __dp4a) and the
// factors that make them weights: element i is `sc0 * q_i + mn` for i < 16, `sc1 * q_i + mn`
// above (sc0 == sc1 but for Q6_K, whose scales cover 16 elements). The factors are computed
// exactly as ggml's dequantize_row_* computes them, so that `unit_value` is bit for bit the
// CPU's dequantisation (the twin tests check this).
//
// Activations for the matrix-vector kernels are Q8_1-like units: 32 int8 with their scale d
// and s = d * sum(q) (both f32 here; ggml keeps them as f16), so that a weight unit's dot
// product with them is d * (sc0 * sum0 + sc1 * sum1) + mn * s.

struct Unit {
    int q[8];
    float sc0, sc1, mn;
};

struct BlockQ8_1 {
    float d;
    float s;
    int qs[8];
};

// One unit of 32 activations, one a lane, to Q8_1 (the whole warp calls it): scale amax / 127,
// quants round(v / scale), s = scale * their sum.
__device__ __forceinline__ void q8_1_unit(float v, BlockQ8_1* __restrict__ out, int lane) {
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    int q = (int)roundf(v * id);
    int sum = warp_sum_int(q);
    ((i8*)out->qs)[lane] = (i8)q;
    if (lane == 0) {
        out->d = d;
        out->s = d * (float)sum;
    }
}

// Bytes of a block and elements per block, per weight type.
template <int T> struct Fmt;
template <> struct Fmt<T_Q4_0> { static const int bytes = 18, elems = 32; };
template <> struct Fmt<T_Q4_1> { static const int bytes = 20, elems = 32; };
template <> struct Fmt<T_Q5_0> { static const int bytes = 22, elems = 32; };
template <> struct Fmt<T_Q5_1> { static const int bytes = 24, elems = 32; };
template <> struct Fmt<T_Q8_0> { static const int bytes = 34, elems = 32; };
template <> struct Fmt<T_Q4_K> { static const int bytes = 144, elems = 256; };
template <> struct Fmt<T_Q5_K> { static const int bytes = 176, elems = 256; };
template <> struct Fmt<T_Q6_K> { static const int bytes = 210, elems = 256; };

// Subtracts `off` (< 128) from each of four bytes below 128, as signed bytes, without borrows.
__device__ __forceinline__ int sub_bytes(int v, int off) {
    return (int)((((u32)v | 0x80808080u) - (u32)off * 0x01010101u) ^ 0x80808080u);
}

// Bits 0..3 of `b` to bit 4 of bytes 0..3 (the fifth bit of Q5_0/Q5_1 quants).
__device__ __forceinline__ int spread4(u32 b) {
    return (int)(((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25));
}

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j of a Q4_K/Q5_K block.
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

template <int T> __device__ __forceinline__ void load_unit(const u8* row, int u, Unit& r);

template <> __device__ __forceinline__ void load_unit<T_Q4_0>(const u8* row, int u, Unit& r) {
    const u8* b = row + u * 18;
    float d = f16_to_f32(ld_u16(b, 0));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        int v = ld_int_b2(b + 2 + 4 * k);
        r.q[k] = sub_bytes(v & 0x0F0F0F0F, 8);
        r.q[k + 4] = sub_bytes((v >> 4) & 0x0F0F0F0F, 8);
    }
    r.sc0 = r.sc1 = d;
    r.mn = -0.0f;
}

template <> __device__ __forceinline__ void load_unit<T_Q4_1>(const u8* row, int u, Unit& r) {
    const u8* b = row + u * 20;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        int v = ld_int_b2(b + 4 + 4 * k);
        r.q[k] = v & 0x0F0F0F0F;
        r.q[k + 4] = (v >> 4) & 0x0F0F0F0F;
    }
    r.sc0 = r.sc1 = f16_to_f32(ld_u16(b, 0));
    r.mn = f16_to_f32(ld_u16(b, 2));
}

template <> __device__ __forceinline__ void load_unit<T_Q5_0>(const u8* row, int u, Unit& r) {
    const u8* b = row + u * 22;
    u32 qh = (u32)ld_int_b2(b + 2);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        int v = ld_int_b2(b + 6 + 4 * k);
        r.q[k] = sub_bytes((v & 0x0F0F0F0F) | spread4(qh >> (4 * k)), 16);
        r.q[k + 4] = sub_bytes(((v >> 4) & 0x0F0F0F0F) | spread4(qh >> (4 * k + 16)), 16);
    }
    r.sc0 = r.sc1 = f16_to_f32(ld_u16(b, 0));
    r.mn = -0.0f;
}

template <> __device__ __forceinline__ void load_unit<T_Q5_1>(const u8* row, int u, Unit& r) {
    const u8* b = row + u * 24;
    u32 qh = (u32)ld_int_b2(b + 4);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        int v = ld_int_b2(b + 8 + 4 * k);
        r.q[k] = (v & 0x0F0F0F0F) | spread4(qh >> (4 * k));
        r.q[k + 4] = ((v >> 4) & 0x0F0F0F0F) | spread4(qh >> (4 * k + 16));
    }
    r.sc0 = r.sc1 = f16_to_f32(ld_u16(b, 0));
    r.mn = f16_to_f32(ld_u16(b, 2));
}

template <> __device__ __forceinline__ void load_unit<T_Q8_0>(const u8* row, int u, Unit& r) {
    const u8* b = row + u * 34;
#pragma unroll
    for (int k = 0; k < 8; ++k) r.q[k] = ld_int_b2(b + 2 + 4 * k);
    r.sc0 = r.sc1 = f16_to_f32(ld_u16(b, 0));
    r.mn = -0.0f;
}

template <> __device__ __forceinline__ void load_unit<T_Q4_K>(const u8* row, int u, Unit& r) {
    const u8* b = row + (u >> 3) * 144;
    int s = u & 7;
    const u8* qs = b + 16 + 32 * (s >> 1);
    int shift = 4 * (s & 1);
#pragma unroll
    for (int k = 0; k < 8; ++k) r.q[k] = (ld_int_b2(qs + 4 * k) >> shift) & 0x0F0F0F0F;
    int sc, m;
    scale_min_k4(s, b + 4, sc, m);
    r.sc0 = r.sc1 = f16_to_f32(ld_u16(b, 0)) * (float)sc;
    r.mn = -(f16_to_f32(ld_u16(b, 2)) * (float)m);
}

template <> __device__ __forceinline__ void load_unit<T_Q5_K>(const u8* row, int u, Unit& r) {
    const u8* b = row + (u >> 3) * 176;
    int s = u & 7;
    const u8* qh = b + 16;
    const u8* qs = b + 48 + 32 * (s >> 1);
    int shift = 4 * (s & 1);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        int lo = (ld_int_b2(qs + 4 * k) >> shift) & 0x0F0F0F0F;
        int hi = ((ld_int_b2(qh + 4 * k) >> s) & 0x01010101) << 4;
        r.q[k] = lo | hi;
    }
    int sc, m;
    scale_min_k4(s, b + 4, sc, m);
    r.sc0 = r.sc1 = f16_to_f32(ld_u16(b, 0)) * (float)sc;
    r.mn = -(f16_to_f32(ld_u16(b, 2)) * (float)m);
}

template <> __device__ __forceinline__ void load_unit<T_Q6_K>(const u8* row, int u, Unit& r) {
    const u8* b = row + (u >> 3) * 210;
    int s = u & 7, h = s >> 2, kq = s & 3;
    const u8* ql = b + 64 * h + 32 * (kq & 1);
    const u8* qh = b + 128 + 32 * h;
    int nshift = 4 * (kq >> 1), hshift = 2 * kq;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        int lo = (ld_int_b2(ql + 4 * k) >> nshift) & 0x0F0F0F0F;
        int hi = ((ld_int_b2(qh + 4 * k) >> hshift) & 0x03030303) << 4;
        r.q[k] = sub_bytes(lo | hi, 32);
    }
    const i8* scales = (const i8*)(b + 192);
    float d = f16_to_f32(ld_u16(b, 208));
    r.sc0 = d * (float)scales[8 * h + 2 * kq];
    r.sc1 = d * (float)scales[8 * h + 2 * kq + 1];
    r.mn = -0.0f;
}

// Element i (0..31) of a loaded unit as a weight, rounded as ggml's dequantisation rounds it
// (no fused multiply-add: ggml's C multiplies, then adds; types without a min have mn = -0,
// which leaves every product as it is, signed zeros included).
__device__ __forceinline__ float unit_value(const Unit& r, int i) {
    int q = (int)(i8)(r.q[i >> 2] >> (8 * (i & 3)));
    return __fadd_rn(__fmul_rn(i < 16 ? r.sc0 : r.sc1, (float)q), r.mn);
}

// The dot product of a weight unit with an activation unit.
__device__ __forceinline__ float unit_dot(const Unit& r, const BlockQ8_1& a) {
    int s0 = 0, s1 = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) s0 = __dp4a(r.q[k], a.qs[k], s0);
#pragma unroll
    for (int k = 4; k < 8; ++k) s1 = __dp4a(r.q[k], a.qs[k], s1);
    return a.d * (r.sc0 * (float)s0 + r.sc1 * (float)s1) + r.mn * a.s;
}

// Element c of a row of a float weight type.
template <int T> __device__ __forceinline__ float load_float(const u8* row, int c);
template <> __device__ __forceinline__ float load_float<T_F32>(const u8* row, int c) { return ((const float*)row)[c]; }
template <> __device__ __forceinline__ float load_float<T_F16>(const u8* row, int c) { return f16_to_f32(((const u16*)row)[c]); }
template <> __device__ __forceinline__ float load_float<T_BF16>(const u8* row, int c) { return bf16_to_f32(((const u16*)row)[c]); }
