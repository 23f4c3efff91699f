//! Each instruction set's product kernels called directly, against the scalar twins, bit for
//! bit (the integer sums are exact and the float epilogues the same): the interleaved layout's
//! kernels (AVX2 and AVX-512, through `matmul_many` and group by group, with the repacking's
//! inverse), the AVX2 and the AVX-512 block kernels, the AVX-512 tile kernels. Kernels this CPU
//! cannot run are skipped, saying so.

use duet_kernels::dot::{vec_dot_scalar, vec_dot_type};
use duet_kernels::interleaved::{self, Interleaved};
use duet_kernels::matmul::{matmul_many, QMatrix, QuantizedActs};
use duet_kernels::quant::{GgmlType, QK_K};
use duet_kernels::{self as kernels, Isa};
use half::f16;
use rand::rngs::StdRng;
use rand::SeedableRng;

mod common;
use common::{quantized, random_acts, random_weight_row, sizes, ROWS_PER_SIZE};

/// What an interleaved kernel must give, bit for bit: the scalar twin's dot product, but for
/// Q4_1 the ggml-order AVX2 row kernel's (`vec_dot` on AVX2 and AVX-512 machines), whose lanes
/// and separate sum of mins give llama.cpp's results; the scalar twin's order gives other
/// logits (the golden test catches it).
fn interleaved_twin(ty: GgmlType, cols: usize, w: &[u8], a: &[u8]) -> f32 {
    if ty == GgmlType::Q4_1 {
        kernels::vec_dot(ty, cols, w, a)
    } else {
        vec_dot_scalar(ty, cols, w, a)
    }
}

/// Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0 and Q5_1 matrices repacked into interleaved groups of sixteen rows give, bit for
/// bit, the scalar twin's dot product of every original row with every activation row, for
/// every batch size the kernels split differently (1–4 rows at a time, then the rest), beside
/// a matrix of the other type in ggml's layout in one `matmul_many` (as a Q4_K_M layer mixes
/// them). (Skipped where the kernels cannot run.)
#[test]
fn interleaved_equals_scalar_twin() {
    if !interleaved::available() {
        eprintln!("skipped: the interleaved kernels need AVX2 or AVX-512");
        return;
    }
    let mut rng = StdRng::seed_from_u64(0x5eed_0016);
    for (ty, beside) in [
        (GgmlType::Q4K, GgmlType::Q6K),
        (GgmlType::Q5K, GgmlType::Q6K),
        (GgmlType::Q6K, GgmlType::Q4K),
        (GgmlType::Q4_0, GgmlType::Q8_0),
        (GgmlType::Q5_0, GgmlType::Q4_0),
        (GgmlType::Q5_1, GgmlType::Q4_1),
        (GgmlType::Q4_1, GgmlType::Q5_1),
    ] {
        assert!(
            Interleaved::new(ty, 15, QK_K, &vec![0; 15 * ty.row_bytes(QK_K)]).is_none(),
            "rows must fill whole groups"
        );
        // Q4_0, Q5_0 and Q5_1 pack two blocks (64 columns) at a time.
        let narrow = if matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1) { 3 * 64 } else { QK_K };
        for (rows, cols) in [(16usize, narrow), (48, 3 * QK_K), (32, 7 * QK_K)] {
            let data: Vec<u8> = (0..rows)
                .flat_map(|_| random_weight_row(&mut rng, ty, cols))
                .collect();
            let packed = Interleaved::new(ty, rows, cols, &data).expect("whole groups");
            let plain = QMatrix::new(ty, rows, cols, &data);
            let bb = ty.row_bytes(packed.unit_cols());
            for r in 0..rows {
                for b in 0..cols / packed.unit_cols() {
                    assert_eq!(
                        packed.block(r, b),
                        &plain.row(r)[b * bb..(b + 1) * bb],
                        "{ty} row {r} block {b} round trip"
                    );
                }
            }
            let w = plain.with_interleaved(&packed);
            let other: Vec<u8> = (0..7)
                .flat_map(|_| random_weight_row(&mut rng, beside, cols))
                .collect();
            let w2 = QMatrix::new(beside, 7, cols, &other);
            for batch in [1usize, 2, 3, 4, 5, 7, 8, 17] {
                let x = random_acts(&mut rng, cols * batch);
                let acts = QuantizedActs::new(ty, &x, cols);
                let (mut out, mut out2) = (vec![f32::NAN; rows * batch], vec![f32::NAN; 7 * batch]);
                matmul_many(&[w, w2], &acts, &mut [&mut out, &mut out2]);
                for t in 0..batch {
                    for r in 0..rows {
                        let want = interleaved_twin(ty, cols, plain.row(r), acts.row(t));
                        let got = out[t * rows + r];
                        assert_eq!(got.to_bits(), want.to_bits(), "{ty} {rows}x{cols} batch {batch}: out[{t}][{r}] = {got:e}, twin {want:e}");
                    }
                    for r in 0..7 {
                        let want = kernels::vec_dot(beside, cols, w2.row(r), acts.row(t));
                        assert_eq!(
                            out2[t * 7 + r].to_bits(),
                            want.to_bits(),
                            "{beside} beside it: out[{t}][{r}]"
                        );
                    }
                }
            }
        }
    }
}

/// The interleaved kernels of each instruction set this CPU has (AVX2 on an AVX-512 machine
/// too, which `matmul_many` would not choose there), called directly on every group: bit for
/// bit the scalar twin for 1–4 activation rows at a time, on random rows and on rows whose
/// quant bytes are all at an extreme against activations at ±127 (where the AVX2 kernels'
/// 16-bit sums of byte products are largest).
#[test]
fn interleaved_kernels_of_each_isa_equal_scalar_twin() {
    #[cfg(target_arch = "x86_64")]
    {
        let isas: Vec<Isa> = [Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&i| match i {
                Isa::Avx512 => kernels::isa() == Isa::Avx512,
                _ => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"),
            })
            .collect();
        if isas.is_empty() {
            println!("SKIPPED: this CPU has neither AVX2 nor AVX-512; the interleaved kernels are not run");
            return;
        }
        let mut rng = StdRng::seed_from_u64(0x5eed_0017);
        for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1] {
            let (rows, cols) = (32, 5 * QK_K);
            let f16_fields = ty.f16_field_offsets();
            let extremes = [None, Some((0xFFu8, 127i8)), Some((0xFF, -127)), Some((0x00, -127)), Some((0x7F, 127)), Some((0x80, -127))];
            for extreme in extremes {
                let mut data: Vec<u8> = (0..rows).flat_map(|_| random_weight_row(&mut rng, ty, cols)).collect();
                let x: Vec<f32> = match extreme {
                    Some((wq, aq)) => {
                        for b in data.chunks_exact_mut(ty.block_bytes()) {
                            for (i, byte) in b.iter_mut().enumerate() {
                                if !f16_fields.iter().any(|&o| (o..o + 2).contains(&i)) {
                                    *byte = wq;
                                }
                            }
                        }
                        vec![aq as f32; 5 * cols]
                    }
                    None => random_acts(&mut rng, 5 * cols),
                };
                let packed = Interleaved::new(ty, rows, cols, &data).expect("whole groups");
                let plain = QMatrix::new(ty, rows, cols, &data);
                let acts = QuantizedActs::new(ty, &x, cols);
                let group_acts = interleaved::GroupActs::new(acts.ty, (0..acts.n_rows).map(|t| acts.row(t)).collect());
                // AVX-512 takes Q4_1 in ggml's layout (`interleaved::packs`).
                for &isa in isas.iter().filter(|&&i| !(ty == GgmlType::Q4_1 && i == Isa::Avx512)) {
                    let mut out = vec![f32::NAN; rows * acts.n_rows];
                    // SAFETY: `out` holds a row of `rows` floats per activation row; the
                    // instruction set was detected above.
                    unsafe { interleaved::matmul_groups_with(isa, &packed, 0..rows / interleaved::GROUP_ROWS, &group_acts, out.as_mut_ptr(), rows) };
                    for t in 0..acts.n_rows {
                        for r in 0..rows {
                            let want = interleaved_twin(ty, cols, plain.row(r), acts.row(t));
                            let got = out[t * rows + r];
                            assert_eq!(got.to_bits(), want.to_bits(), "{isa:?} {ty} {extreme:?}: out[{t}][{r}] = {got:e}, twin {want:e}");
                        }
                    }
                }
            }
        }
    }
}


/// The AVX-512 block kernels of the types without a ggml-order AVX2 kernel (Q4_K, Q5_K, Q6_K,
/// Q5_0, Q5_1; with and without VNNI, where the CPU has them) against the scalar twins, bit for
/// bit: the integer sums are exact and the float epilogue is the same.
#[test]
fn avx512_block_kernels_equal_scalar_twins_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    {
        use duet_kernels::blockdot_avx512 as k;
        if kernels::isa() < Isa::Avx512 {
            println!("SKIPPED: this CPU (or DUET_ISA) has no AVX-512; the block kernels are not run");
            return;
        }
        type Dot = unsafe fn(&[u8], &[u8]) -> f32;
        let kernels_of = |ty: GgmlType| -> [(&str, Dot); 2] {
            match ty {
                GgmlType::Q4K => [("plain", k::dot_q4k_q8k), ("vnni", k::dot_q4k_q8k_vnni)],
                GgmlType::Q5K => [("plain", k::dot_q5k_q8k), ("vnni", k::dot_q5k_q8k_vnni)],
                GgmlType::Q6K => [("plain", k::dot_q6k_q8k), ("vnni", k::dot_q6k_q8k_vnni)],
                GgmlType::Q5_0 => [("plain", k::dot_q5_0_q8_0), ("vnni", k::dot_q5_0_q8_0_vnni)],
                _ => [("plain", k::dot_q5_1_q8_1), ("vnni", k::dot_q5_1_q8_1_vnni)],
            }
        };
        let mut rng = StdRng::seed_from_u64(0x5eed_0006);
        for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::Q5_0, GgmlType::Q5_1] {
            for n in sizes(ty).into_iter().chain([ty.block_size() * 17]) {
                for _ in 0..ROWS_PER_SIZE {
                    let w = random_weight_row(&mut rng, ty, n);
                    let a = quantized(vec_dot_type(ty), &random_acts(&mut rng, n));
                    let twin = vec_dot_scalar(ty, n, &w, &a);
                    let mut fast = vec![("dispatch", kernels::vec_dot(ty, n, &w, &a))];
                    for (name, f) in kernels_of(ty) {
                        if name == "vnni" && !kernels::has_vnni() {
                            continue;
                        }
                        // SAFETY: AVX-512 detected above, VNNI checked before its variants.
                        fast.push((name, unsafe { f(&w, &a) }));
                    }
                    for (name, v) in fast {
                        assert_eq!(v.to_bits(), twin.to_bits(), "{ty} n={n} {name}: {v} vs scalar {twin}");
                    }
                }
            }
        }
    }
}

/// The AVX2 block kernels (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, F32, F16, BF16: what a CPU without AVX-512 runs)
/// against the scalar twins, bit for bit, on any CPU with AVX2 (an AVX-512 one too, whose
/// dispatch takes its own kernels): the integer sums are exact and the float epilogue is the same.
#[test]
fn avx2_block_kernels_equal_scalar_twins_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    {
        use duet_kernels::blockdot_avx2 as k;
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")) {
            println!("SKIPPED: this CPU has no AVX2; the AVX2 block kernels are not run");
            return;
        }
        type Dot = unsafe fn(&[u8], &[u8]) -> f32;
        type DotX4 = unsafe fn(&[u8], [&[u8]; 4]) -> [f32; 4];
        let kernels: [(GgmlType, Dot); 8] = [
            (GgmlType::Q4K, k::dot_q4k_q8k),
            (GgmlType::Q5K, k::dot_q5k_q8k),
            (GgmlType::Q6K, k::dot_q6k_q8k),
            (GgmlType::Q5_0, k::dot_q5_0_q8_0),
            (GgmlType::Q5_1, k::dot_q5_1_q8_1),
            (GgmlType::F32, k::dot_f32_f32),
            (GgmlType::F16, k::dot_f16_f16),
            (GgmlType::BF16, k::dot_bf16_bf16),
        ];
        let mut rng = StdRng::seed_from_u64(0x5eed_0016);
        for (ty, f) in kernels {
            for n in sizes(ty).into_iter().chain([ty.block_size() * 17]) {
                for _ in 0..ROWS_PER_SIZE {
                    let w = random_weight_row(&mut rng, ty, n);
                    let a = quantized(vec_dot_type(ty), &random_acts(&mut rng, n));
                    let twin = vec_dot_scalar(ty, n, &w, &a);
                    // SAFETY: AVX2, FMA and F16C detected above; whole blocks of the same count.
                    let v = unsafe { f(&w, &a) };
                    assert_eq!(v.to_bits(), twin.to_bits(), "{ty} n={n}: {v} vs scalar {twin}");
                }
                // The four-activation-row kernels of the k-quants: each row as the twin.
                let four: Option<DotX4> = match ty {
                    GgmlType::Q4K => Some(k::dot_q4k_q8k_x4),
                    GgmlType::Q5K => Some(k::dot_q5k_q8k_x4),
                    GgmlType::Q6K => Some(k::dot_q6k_q8k_x4),
                    _ => None,
                };
                if let Some(four) = four {
                    let w = random_weight_row(&mut rng, ty, n);
                    let acts: Vec<Vec<u8>> = (0..4).map(|_| quantized(vec_dot_type(ty), &random_acts(&mut rng, n))).collect();
                    let rows = [acts[0].as_slice(), &acts[1], &acts[2], &acts[3]];
                    // SAFETY: as above.
                    let got = unsafe { four(&w, rows) };
                    for (r, a) in rows.iter().enumerate() {
                        let twin = vec_dot_scalar(ty, n, &w, a);
                        assert_eq!(got[r].to_bits(), twin.to_bits(), "{ty} n={n} four rows, row {r}: {} vs scalar {twin}", got[r]);
                    }
                }
            }
            if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
                continue;
            }
            // Every quant at its extremes, every activation at ±127: saturation and signs.
            let n = ty.block_size() * 3;
            for (wq, aq) in [(0x00u8, 127i8), (0xFF, 127), (0x00, -127), (0xFF, -127), (0x80, -127), (0x7F, 127), (0x0F, -127)] {
                let mut w = random_weight_row(&mut rng, ty, n);
                let f16_fields = ty.f16_field_offsets();
                for b in w.chunks_exact_mut(ty.block_bytes()) {
                    for (i, byte) in b.iter_mut().enumerate() {
                        if !f16_fields.iter().any(|&o| (o..o + 2).contains(&i)) {
                            *byte = wq;
                        }
                    }
                }
                let a = quantized(vec_dot_type(ty), &vec![aq as f32; n]);
                let twin = vec_dot_scalar(ty, n, &w, &a);
                // SAFETY: as above.
                let v = unsafe { f(&w, &a) };
                assert_eq!(v.to_bits(), twin.to_bits(), "{ty} weight bytes {wq:#04x}, activations {aq}: {v} vs scalar {twin}");
            }
        }
    }
}


/// The AVX-512 tile kernels, with and without VNNI (whichever this CPU runs), on full tiles
/// (the lane-major kernel) and partial ones (the paired kernel), against `vec_dot`, bit for bit.
#[test]
fn tile_kernels_equal_vec_dot_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    {
        use duet_kernels::matmul_avx512::{self as m, PairedActs, TILE};
        if kernels::isa() != Isa::Avx512 {
            println!("SKIPPED: this CPU has no AVX-512");
            return;
        }
        let mut rng = StdRng::seed_from_u64(0x5eed_0011);
        for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            for cols in [32usize, 96, 576] {
                for batch in [3usize, 16, 21, 32] {
                    let w: Vec<u8> = (0..3).flat_map(|_| random_weight_row(&mut rng, ty, cols)).collect();
                    let x = random_acts(&mut rng, cols * batch);
                    let acts = QuantizedActs::new(ty, &x, cols);
                    let nb = cols / 32;
                    // SAFETY: AVX-512 was detected; the data is `batch` rows of `nb` blocks.
                    let paired = unsafe { PairedActs::new(acts.ty, &acts.data, batch, nb) };
                    type Kernel = m::RowsTileKernel;
                    let mut kernels_here: Vec<(&str, Kernel)> = match ty {
                        GgmlType::Q4_0 => vec![("q4_0 plain", m::q4_0_rows_tile)],
                        GgmlType::Q4_1 => vec![("q4_1 plain", m::q4_1_rows_tile)],
                        _ => vec![("q8_0 plain", m::q8_0_rows_tile)],
                    };
                    if kernels::has_vnni() {
                        kernels_here.push(match ty {
                            GgmlType::Q4_0 => ("q4_0 vnni", m::q4_0_rows_tile_vnni),
                            GgmlType::Q4_1 => ("q4_1 vnni", m::q4_1_rows_tile_vnni),
                            _ => ("q8_0 vnni", m::q8_0_rows_tile_vnni),
                        });
                    }
                    for (name, kernel) in kernels_here {
                        for tile in 0..paired.n_tiles() {
                            let rows = (batch - tile * TILE).min(TILE);
                            let mut got = [[0f32; TILE]; 3];
                            // SAFETY: as above; `w` is three rows of `nb` blocks.
                            unsafe { kernel(&w, w.len() / 3, &paired, tile, rows, &mut got) };
                            for (r, got_r) in got.iter().enumerate() {
                                let w_r = &w[r * w.len() / 3..(r + 1) * w.len() / 3];
                                for (i, g) in got_r.iter().take(rows).enumerate() {
                                    let want = kernels::vec_dot(ty, cols, w_r, acts.row(tile * TILE + i));
                                    assert_eq!(g.to_bits(), want.to_bits(), "{name} cols {cols} batch {batch} weight row {r} row {}: {g:e} vs {want:e}", tile * TILE + i);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The AVX-512 Q4_K, Q5_K and Q6_K tile kernels, with and without VNNI (whichever this CPU runs), against
/// `vec_dot`, bit for bit: one and three blocks per row, whole tiles and padded ones, a
/// weight row whose blocks are each −0.
#[test]
fn k_quant_tile_kernels_equal_vec_dot_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    {
        use duet_kernels::matmul_avx512::TILE;
        use duet_kernels::matmul_k_avx512::{self as k, KTileActs};
        if kernels::isa() != Isa::Avx512 {
            println!("SKIPPED: this CPU has no AVX-512");
            return;
        }
        let mut rng = StdRng::seed_from_u64(0x5eed_0012);
        for (ty, d_at) in [(GgmlType::Q4K, 0), (GgmlType::Q5K, 0), (GgmlType::Q6K, 208)] {
            for cols in [256usize, 768] {
                for batch in [7usize, 16, 35, 40] {
                    let mut w: Vec<u8> = (0..3).flat_map(|_| random_weight_row(&mut rng, ty, cols)).collect();
                    // Row 2 all zero but a negative scale: each block's value is −0, and the row's
                    // sum −0 only if the blocks are summed from −0 as the twin's `sum()` does.
                    let rb = w.len() / 3;
                    w[2 * rb..].fill(0);
                    for blk in w[2 * rb..].chunks_exact_mut(ty.block_bytes()) {
                        blk[d_at..d_at + 2].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
                    }
                    let x = random_acts(&mut rng, cols * batch);
                    let acts = QuantizedActs::new(ty, &x, cols);
                    // SAFETY: AVX-512 was detected; the data is `batch` rows of `cols / 256` blocks.
                    let tiles = unsafe { KTileActs::new(&acts.data, batch, cols / 256) };
                    assert_eq!(tiles.n_tiles(), batch / TILE + usize::from(batch % TILE >= k::MIN_PARTIAL));
                    let mut kernels_here: Vec<(&str, k::KTileKernel)> = match ty {
                        GgmlType::Q4K => vec![("q4_k plain", k::q4k_rows_tile)],
                        GgmlType::Q5K => vec![("q5_k plain", k::q5k_rows_tile)],
                        _ => vec![("q6_k plain", k::q6k_rows_tile)],
                    };
                    if kernels::has_vnni() {
                        kernels_here.push(match ty {
                            GgmlType::Q4K => ("q4_k vnni", k::q4k_rows_tile_vnni),
                            GgmlType::Q5K => ("q5_k vnni", k::q5k_rows_tile_vnni),
                            _ => ("q6_k vnni", k::q6k_rows_tile_vnni),
                        });
                    }
                    for (name, kernel) in kernels_here {
                        for tile in 0..tiles.n_tiles() {
                            let mut got = [[0f32; TILE]; 3];
                            // SAFETY: as above; `w` is three rows of the acts' block count.
                            unsafe { kernel(&w, rb, &tiles, tile, &mut got) };
                            for (r, got_r) in got.iter().enumerate() {
                                // A padded tile's lanes past the batch are not compared.
                                for (i, g) in got_r.iter().enumerate().take(batch - tile * TILE) {
                                    let want = kernels::vec_dot(ty, cols, &w[r * rb..(r + 1) * rb], acts.row(tile * TILE + i));
                                    assert_eq!(g.to_bits(), want.to_bits(), "{name} cols {cols} batch {batch} weight row {r} row {}: {g:e} vs {want:e}", tile * TILE + i);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
