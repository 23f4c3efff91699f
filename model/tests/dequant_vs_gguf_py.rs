//! Duet's dequantisation against an independent implementation: gguf-py's, bit for bit.
//!
//! `testdata/quant/` is written by `scripts/gen_quant_fixtures.py` with the PyPI package `gguf`
//! (numpy): a GGUF of every weight type (random data quantised by gguf-py, and random valid raw
//! blocks), and gguf-py's `dequantize` of each tensor as f32. gguf-py computes ggml's
//! `dequantize_row_*` formulas step for step (the script lists them), so every value must have
//! the same bits here; no tolerance is needed for any type. NaNs compare by their bits too
//! (the fixtures hold quiet and, for F32 and BF16, signalling NaNs: ggml keeps their bits).

use std::collections::BTreeSet;
use std::path::PathBuf;

use duet_kernels::quant::{dequantize, GgmlType};
use duet_model::gguf::GgufFile;
use duet_model::testutil::workspace_root;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    let p = workspace_root().join("testdata/quant").join(name);
    assert!(p.exists(), "{} is missing: run python3 scripts/gen_quant_fixtures.py", p.display());
    p
}

const ALL_TYPES: [GgmlType; 11] = GgmlType::WEIGHT_TYPES;

#[test]
fn every_tensor_dequantises_to_gguf_py_bits() {
    let file = GgufFile::open(fixture("quant_fixtures.gguf")).expect("fixture GGUF parses");
    let index: Value = serde_json::from_str(&std::fs::read_to_string(fixture("quant_expected.json")).unwrap()).unwrap();
    let expected = std::fs::read(fixture("quant_expected.bin")).unwrap();
    let entries = index["tensors"].as_array().expect("index has tensors");

    // The index and the file describe the same tensors.
    let in_file: BTreeSet<&str> = file.tensors.iter().map(|t| t.name.as_str()).collect();
    let in_index: BTreeSet<&str> = entries.iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(in_file, in_index, "tensors of quant_fixtures.gguf vs quant_expected.json");

    let mut failures = Vec::new();
    let mut types_seen = BTreeSet::new();
    let mut values_checked = 0usize;
    for e in entries {
        let name = e["name"].as_str().unwrap();
        let view = file.tensor(name).unwrap();
        let info = view.info;
        let ty = info.ty;
        assert_eq!(ty.to_string(), e["type"].as_str().unwrap(), "{name}: type name");
        assert_eq!(u64::from(ty.id()), e["type_id"].as_u64().unwrap(), "{name}: type id");
        let dims: Vec<u64> = e["dims"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
        assert_eq!(info.dims, dims, "{name}: dims");

        let (off, nbytes) = (e["offset"].as_u64().unwrap() as usize, e["nbytes"].as_u64().unwrap() as usize);
        let want: Vec<u32> =
            expected[off..off + nbytes].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(want.len() as u64, info.n_elements(), "{name}: expected value count");

        // Row by row, as the model loader and the kernels see the data.
        let row_len = info.dims[0] as usize;
        let row_bytes = ty.row_bytes(row_len);
        assert_eq!(view.data.len() % row_bytes, 0, "{name}: whole rows");
        let mut row = vec![0f32; row_len];
        let mut first_diff = None;
        for (r, src) in view.data.chunks_exact(row_bytes).enumerate() {
            dequantize(ty, src, &mut row).unwrap_or_else(|err| panic!("{name} row {r}: {err}"));
            let want_row = &want[r * row_len..(r + 1) * row_len];
            if let Some(i) = row.iter().zip(want_row).position(|(g, &w)| g.to_bits() != w) {
                first_diff = Some(r * row_len + i);
                break;
            }
        }
        if let Some(i) = first_diff {
            let (r, c) = (i / row_len, i % row_len);
            dequantize(ty, &view.data[r * row_bytes..(r + 1) * row_bytes], &mut row).unwrap();
            let (got, exp) = (row[c], f32::from_bits(want[i]));
            failures.push(format!(
                "{name} ({ty}, dims {dims:?}): first difference at element {i} (row {r}, column {c}, block {}): \
                 Duet {got:e} ({:#010x}), gguf-py {exp:e} ({:#010x})",
                c / ty.block_size(),
                got.to_bits(),
                want[i],
            ));
        }
        values_checked += want.len();
        types_seen.insert(ty.to_string());
    }
    assert!(failures.is_empty(), "dequantisation differs from gguf-py:\n{}", failures.join("\n"));

    let all: BTreeSet<String> = ALL_TYPES.iter().map(|t| t.to_string()).collect();
    assert_eq!(types_seen, all, "the fixtures must cover every weight type Duet loads");
    assert!(
        ALL_TYPES.iter().all(|t| t.is_storage_type()) && all.len() == ALL_TYPES.len(),
        "ALL_TYPES lists each storage type once"
    );
    eprintln!("{values_checked} values of {} tensors bit-identical to gguf-py", entries.len());
}

/// Each type is there both from gguf-py's quantiser (where it has one) and as random raw
/// blocks, and with odd shapes: a fixture regenerated with fewer tensors would fail here.
#[test]
fn fixtures_cover_quantised_and_raw_data_in_odd_shapes() {
    let index: Value = serde_json::from_str(&std::fs::read_to_string(fixture("quant_expected.json")).unwrap()).unwrap();
    let entries = index["tensors"].as_array().unwrap();
    for ty in ALL_TYPES {
        let of_ty: Vec<&Value> = entries.iter().filter(|e| e["type"] == ty.to_string().as_str()).collect();
        assert!(of_ty.iter().any(|e| e["source"] == "raw"), "{ty}: no raw-block tensor");
        let quantizable = !matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K);
        if quantizable {
            assert!(of_ty.iter().any(|e| e["source"] == "quantize"), "{ty}: no gguf-py-quantised tensor");
        }
        let ranks: BTreeSet<usize> = of_ty.iter().map(|e| e["dims"].as_array().unwrap().len()).collect();
        assert!(ranks.len() >= 2, "{ty}: tensors of one rank only ({ranks:?})");
        for e in &of_ty {
            let dims: Vec<u64> = e["dims"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).collect();
            let blocks_per_row = dims[0] / ty.block_size() as u64;
            let rows: u64 = dims[1..].iter().product();
            assert!(blocks_per_row % 2 == 1 || rows % 2 == 1, "{}: shape {dims:?} is not odd anywhere", e["name"]);
        }
    }
}
