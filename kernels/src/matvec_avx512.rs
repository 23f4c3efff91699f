//! AVX-512 dot products of four weight rows with one activation row, for the weight types with
//! an AVX2 kernel of ggml's order (Q4_0 × Q8_0, Q4_1 × Q8_1, Q8_0 × Q8_0), bit-identical to
//! four calls of the AVX2 kernels
//! in `simd_x86` (ggml's arithmetic).
//!
//! Two weight rows share one 512-bit register: row A in lanes 0–7, row B in lanes 8–15, so
//! every lane does exactly what the AVX2 kernel's eight lanes do (per block: the integer sums
//! of four byte products, scaled by `d_w · d_a` and accumulated with one FMA); only the
//! instruction count halves. With AVX-512 VNNI one `vpdpbusd` replaces `maddubs` + `madd`
//! (the same integer sums: no product pair reaches `maddubs`' saturation for these types).

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

const Q4_0_BYTES: usize = 18;
const Q4_1_BYTES: usize = 20;
const Q8_1_BYTES: usize = 36;
const Q8_0_BYTES: usize = 34;

/// Weight bytes are prefetched this far ahead of the block being read, in each of the four
/// rows: a single sequential stream per row is not enough to keep DRAM busy from one core.
const PREFETCH_AHEAD: usize = 512;

/// Prefetches ahead of a four-row kernel's reads. When the rows lie back to back in memory (a
/// matrix's consecutive rows, as `matmul` passes them) the group is one sequential span and
/// is prefetched as one stream `LINEAR_AHEAD` bytes ahead of its first row's reads: with
/// short rows (the default model's 576 columns are 18 blocks) per-row distances land inside
/// rows already being read. A group longer than that distance is prefetched that far ahead of
/// its last row's reads instead (three rows further), or the front falls behind the later
/// rows' reads. Otherwise each row is prefetched `PREFETCH_AHEAD` ahead.
struct Prefetch {
    rows: [*const u8; 4],
    block_bytes: usize,
    /// Whether the rows lie back to back (one stream).
    contiguous: bool,
    /// How far past the first row's reads the stream is prefetched.
    ahead: usize,
}

/// How far ahead a contiguous group is prefetched. Measured on the model's 576-column rows
/// (`cargo bench -p duet-cpu-worker --bench kernels -- --only "matrix-vector Q"`): Q8_0
/// 17 GB/s with the per-row prefetch, 42 at 2 KiB, 44–46 at 4 KiB, 41–50 at 8 KiB, 37–46 at
/// 32 KiB; decode of the whole model was fastest at 8 KiB (235–274 tok/s against 212–221 at 2 KiB).
pub(super) const LINEAR_AHEAD: usize = 8192;

impl Prefetch {
    fn new(rows: [*const u8; 4], row_bytes: usize, block_bytes: usize) -> Self {
        let contiguous = (1..4).all(|i| rows[i] == rows[0].wrapping_add(i * row_bytes));
        // Measured (`--only "matrix-vector Q"`, 4096 columns, 5 interleaved pairs): Q8_0
        // 35.3–45.7 → 41.6–71.4 GB/s (the VM's bandwidth moved from 50 to 76 between them),
        // Q4_1 38.1–55.1 → 47.0–62.5; at 576 columns, where the group is short, 3 rows
        // further was 2–10 % slower, so short groups keep `LINEAR_AHEAD`.
        let ahead = if 4 * row_bytes > LINEAR_AHEAD { LINEAR_AHEAD + 3 * row_bytes } else { LINEAR_AHEAD };
        Prefetch { rows, block_bytes, contiguous, ahead }
    }

    /// Before reading block `b` of each row.
    #[inline(always)]
    unsafe fn at(&self, b: usize) {
        if self.contiguous {
            // The group's span advances four blocks per block read.
            let step = 4 * self.block_bytes;
            let p = self.rows[0].wrapping_add(self.ahead + b * step);
            _mm_prefetch::<_MM_HINT_T0>(p.cast());
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64).cast());
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(step - 1).cast());
        } else {
            for r in &self.rows {
                _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(b * self.block_bytes + PREFETCH_AHEAD).cast());
            }
        }
    }
}

/// Sum of products of unsigned bytes `u` and signed bytes `s`, four at a time, as 16 i32
/// (shared by the AVX-512 integer kernels).
#[inline(always)]
pub(super) unsafe fn dot_u8i8<const VNNI: bool>(u: __m512i, s: __m512i) -> __m512i {
    if VNNI {
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s)
    } else {
        _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1))
    }
}

/// `hsum_ps` of the AVX2 kernels on each 8-lane half: (lo4 + hi4), then (0 + 2, 1 + 3), then
/// the two added.
#[inline(always)]
unsafe fn hsum_halves(v: __m512) -> [f32; 2] {
    [hsum8(_mm512_castps512_ps256(v)), hsum8(_mm512_extractf32x8_ps::<1>(v))]
}

/// The AVX2 kernels' `hsum_ps` of eight lanes (shared by the AVX-512 kernels).
#[inline(always)]
pub(super) unsafe fn hsum8(x: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// 32 bytes at `p` in lanes 0–31, 32 bytes at `q` in lanes 32–63.
#[inline(always)]
unsafe fn bytes_pair(p: *const u8, q: *const u8) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(_mm256_loadu_si256(p.cast())), _mm256_loadu_si256(q.cast()))
}

/// Two 16-byte nibble arrays as 64 bytes: A's low nibbles, A's high nibbles, B's low, B's high.
#[inline(always)]
unsafe fn nibbles_pair(a: *const u8, b: *const u8) -> __m512i {
    let ab = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(_mm_loadu_si128(a.cast())), _mm_loadu_si128(b.cast()));
    let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ab), _mm256_srli_epi16::<4>(ab));
    // [A, B, A>>4, B>>4] → [A, A>>4, B, B>>4]
    let ordered = _mm512_shuffle_i64x2::<0b11_01_10_00>(both, both);
    _mm512_and_si512(ordered, _mm512_set1_epi8(0x0F))
}

/// Lanes 0–7 = `v[0]`, lanes 8–15 = `v[2]`.
#[inline(always)]
unsafe fn spread_0_2(v: __m128) -> __m512 {
    let idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v))
}

/// Two f16 pairs (4 bytes at `a`, 4 bytes at `b`) widened: `[a0, a1, b0, b1]`.
#[inline(always)]
unsafe fn f16_pairs(a: *const u8, b: *const u8) -> __m128 {
    let x = _mm_insert_epi32::<1>(_mm_cvtsi32_si128((a as *const i32).read_unaligned()), (b as *const i32).read_unaligned());
    _mm_cvtph_ps(x)
}

#[inline(always)]
unsafe fn q4_1_r4_body<const VNNI: bool>(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    let nb = a.len() / Q8_1_BYTES;
    debug_assert!(w.iter().all(|r| r.len() == nb * Q4_1_BYTES));
    let (w0, w1, w2, w3) = (w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr());
    let y = a.as_ptr();
    let mut acc01 = _mm512_setzero_ps();
    let mut acc23 = _mm512_setzero_ps();
    // Lanes 1 and 3 carry the rows' running sums of m·s (lanes 0 and 2 are unused).
    let mut summs01 = _mm_setzero_ps();
    let mut summs23 = _mm_setzero_ps();
    let prefetch = Prefetch::new([w0, w1, w2, w3], nb * Q4_1_BYTES, Q4_1_BYTES);
    for b in 0..nb {
        let o = b * Q4_1_BYTES;
        prefetch.at(b);
        let yb = y.add(b * Q8_1_BYTES);
        // [d_a, s_a, d_a, s_a]
        let ds = _mm_cvtph_ps(_mm_set1_epi32((yb as *const i32).read_unaligned()));
        let qy = _mm512_broadcast_i64x4(_mm256_loadu_si256(yb.add(4).cast()));
        // [d_w · d_a, m_w · s_a] for two rows.
        let p01 = _mm_mul_ps(f16_pairs(w0.add(o), w1.add(o)), ds);
        let p23 = _mm_mul_ps(f16_pairs(w2.add(o), w3.add(o)), ds);
        summs01 = _mm_add_ps(summs01, p01);
        summs23 = _mm_add_ps(summs23, p23);
        let x01 = _mm512_cvtepi32_ps(dot_u8i8::<VNNI>(nibbles_pair(w0.add(o + 4), w1.add(o + 4)), qy));
        let x23 = _mm512_cvtepi32_ps(dot_u8i8::<VNNI>(nibbles_pair(w2.add(o + 4), w3.add(o + 4)), qy));
        acc01 = _mm512_fmadd_ps(spread_0_2(p01), x01, acc01);
        acc23 = _mm512_fmadd_ps(spread_0_2(p23), x23, acc23);
    }
    let ([r0, r1], [r2, r3]) = (hsum_halves(acc01), hsum_halves(acc23));
    let (mut s01, mut s23) = ([0f32; 4], [0f32; 4]);
    _mm_storeu_ps(s01.as_mut_ptr(), summs01);
    _mm_storeu_ps(s23.as_mut_ptr(), summs23);
    [r0 + s01[1], r1 + s01[3], r2 + s23[1], r3 + s23[3]]
}

/// Four rows of a weight type with signed quants and one f16 scale per block of 32 (Q4_0:
/// nibbles − 8, `Q4 = true`; Q8_0: bytes) · one Q8_0 activation row, ggml's way: |x| · sign(y, x).
#[inline(always)]
unsafe fn signed_r4_body<const Q4: bool, const VNNI: bool>(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    let bb = if Q4 { Q4_0_BYTES } else { Q8_0_BYTES };
    let nb = a.len() / Q8_0_BYTES;
    debug_assert!(w.iter().all(|r| r.len() == nb * bb));
    let (w0, w1, w2, w3) = (w[0].as_ptr(), w[1].as_ptr(), w[2].as_ptr(), w[3].as_ptr());
    let y = a.as_ptr();
    let mut acc01 = _mm512_setzero_ps();
    let mut acc23 = _mm512_setzero_ps();
    let quants = |p: *const u8, q: *const u8| {
        if Q4 {
            _mm512_sub_epi8(nibbles_pair(p, q), _mm512_set1_epi8(8))
        } else {
            bytes_pair(p, q)
        }
    };
    let prefetch = Prefetch::new([w0, w1, w2, w3], nb * bb, bb);
    for b in 0..nb {
        let o = b * bb;
        prefetch.at(b);
        let yb = y.add(b * Q8_0_BYTES);
        let dy = _mm_cvtph_ps(_mm_set1_epi16((yb as *const i16).read_unaligned()));
        let qy = _mm512_broadcast_i64x4(_mm256_loadu_si256(yb.add(2).cast()));
        // [d_w0, _, d_w1, _] · d_a: the f16 pair loads pick up quant bytes in lanes 1 and 3.
        let d01 = _mm_mul_ps(f16_pairs(w0.add(o), w1.add(o)), dy);
        let d23 = _mm_mul_ps(f16_pairs(w2.add(o), w3.add(o)), dy);
        let (x01, x23) = (quants(w0.add(o + 2), w1.add(o + 2)), quants(w2.add(o + 2), w3.add(o + 2)));
        let s01 = dot_u8i8::<VNNI>(_mm512_abs_epi8(x01), _mm512_mask_sub_epi8(qy, _mm512_movepi8_mask(x01), _mm512_setzero_si512(), qy));
        let s23 = dot_u8i8::<VNNI>(_mm512_abs_epi8(x23), _mm512_mask_sub_epi8(qy, _mm512_movepi8_mask(x23), _mm512_setzero_si512(), qy));
        acc01 = _mm512_fmadd_ps(spread_0_2(d01), _mm512_cvtepi32_ps(s01), acc01);
        acc23 = _mm512_fmadd_ps(spread_0_2(d23), _mm512_cvtepi32_ps(s23), acc23);
    }
    let ([r0, r1], [r2, r3]) = (hsum_halves(acc01), hsum_halves(acc23));
    [r0, r1, r2, r3]
}

#[inline(always)]
unsafe fn q4_0_r4_body<const VNNI: bool>(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    signed_r4_body::<true, VNNI>(w, a)
}

#[inline(always)]
unsafe fn q8_0_r4_body<const VNNI: bool>(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
    signed_r4_body::<false, VNNI>(w, a)
}

macro_rules! r4_fn {
    ($name:ident, $body:ident, $vnni:expr, $features:literal, $doc:literal) => {
        #[doc = $doc]
        ///
        /// # Safety
        /// The CPU features named in `target_feature`; every row whole blocks of the same count.
        #[target_feature(enable = $features)]
        pub unsafe fn $name(w: [&[u8]; 4], a: &[u8]) -> [f32; 4] {
            $body::<$vnni>(w, a)
        }
    };
}

r4_fn!(dot_q4_1_q8_1_r4, q4_1_r4_body, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Four Q4_1 weight rows · one Q8_1 activation row, each as `simd_x86::dot_q4_1_q8_1`.");
r4_fn!(dot_q4_1_q8_1_r4_vnni, q4_1_r4_body, true, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "[`dot_q4_1_q8_1_r4`] with `vpdpbusd`.");
r4_fn!(dot_q4_0_q8_0_r4, q4_0_r4_body, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Four Q4_0 weight rows · one Q8_0 activation row, each as `simd_x86::dot_q4_0_q8_0`.");
r4_fn!(dot_q4_0_q8_0_r4_vnni, q4_0_r4_body, true, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "[`dot_q4_0_q8_0_r4`] with `vpdpbusd`.");
r4_fn!(dot_q8_0_q8_0_r4, q8_0_r4_body, false, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", "Four Q8_0 weight rows · one Q8_0 activation row, each as `simd_x86::dot_q8_0_q8_0`.");
r4_fn!(dot_q8_0_q8_0_r4_vnni, q8_0_r4_body, true, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", "[`dot_q8_0_q8_0_r4`] with `vpdpbusd`.");
