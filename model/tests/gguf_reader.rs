//! GGUF reader tests on well-formed files: tiny GGUF files built in memory, round trips of every
//! metadata type, zero-copy tensor views, the memory-mapped path, and files gguf-py wrote. Bad
//! input: `gguf_bad_input.rs`.

mod gguf_writer;

use duet_kernels::quant::GgmlType;
use duet_model::gguf::{GgufError, GgufFile, Value, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS};
use gguf_writer::*;

#[test]
fn every_value_type_round_trips_in_v2_and_v3() {
    for version in [2, 3] {
        let mut b = Builder::new(version);
        for (k, v) in every_value() {
            b = b.kv(k, v);
        }
        let f = parse(b.build());
        assert_eq!(f.version, version);
        assert_eq!(f.alignment, DEFAULT_ALIGNMENT);
        assert!(f.tensors.is_empty());
        assert_eq!(f.metadata.len(), every_value().len());
        for (k, v) in every_value() {
            assert_eq!(f.get(k), Some(&v), "v{version} key {k}");
        }
        assert_eq!(f.get("t.u32").and_then(Value::as_u64), Some(0xdead_beef));
        assert_eq!(f.get("t.i8").and_then(Value::as_u64), None);
        assert_eq!(f.get("t.i8").and_then(Value::as_f64), Some(-128.0));
        assert_eq!(f.get("t.f32").and_then(Value::as_f64), Some(-1.5e-3f32 as f64));
        assert_eq!(f.get("t.string").and_then(Value::as_str), Some("héllo, wörld ✓"));
        assert_eq!(f.get("t.bool.true").and_then(Value::as_bool), Some(true));
        assert_eq!(f.get("a.string").and_then(Value::as_array).map(<[Value]>::len), Some(4));
        assert_eq!(f.get("missing"), None);
    }
}

#[test]
fn arrays_nest_up_to_the_depth_limit() {
    let f = parse(Builder::new(3).kv("deep", nested(MAX_ARRAY_DEPTH)).build());
    assert_eq!(f.get("deep"), Some(&nested(MAX_ARRAY_DEPTH)));
    let e = parse_err(Builder::new(3).kv("deeper", nested(MAX_ARRAY_DEPTH + 1)).build());
    assert!(matches!(&e, GgufError::ArrayTooDeep { key } if key == "deeper"), "{e:?}");
}

/// Tensors of several types and ranks (up to `MAX_DIMS`).
fn many_tensors(version: u32) -> Builder {
    assert_eq!(MAX_DIMS, 4);
    Builder::new(version)
        .kv("general.architecture", Value::String("llama".into()))
        .tensor("f32", GgmlType::F32, &[4, 3])
        .tensor("empty", GgmlType::F32, &[0, 5])
        .tensor("f16", GgmlType::F16, &[7])
        .tensor("bf16", GgmlType::BF16, &[5, 2, 1, 3])
        .tensor("q4_0", GgmlType::Q4_0, &[64, 2])
        .tensor("q4_1", GgmlType::Q4_1, &[32])
        .tensor("q5_0", GgmlType::Q5_0, &[32, 3])
        .tensor("q5_1", GgmlType::Q5_1, &[96])
        .tensor("q8_0", GgmlType::Q8_0, &[32, 2, 2])
        .tensor("q4_k", GgmlType::Q4K, &[256, 2])
        .tensor("q5_k", GgmlType::Q5K, &[256])
        .tensor("q6_k", GgmlType::Q6K, &[512, 1])
}

/// Checks every tensor of `f` against the builder: type, shape, size, alignment, bytes, and
/// that the view points at `base + data_start + offset` when `base` is known.
fn check_tensors(f: &GgufFile, b: &Builder, base: Option<*const u8>) {
    assert_eq!(f.tensors.len(), b.tensors.len());
    assert_eq!(f.data_start() % f.alignment, 0);
    for (spec, &off) in b.tensors.iter().zip(&b.offsets()) {
        let view = f.tensor(&spec.name).unwrap();
        let ty = GgmlType::from_id(spec.type_id).unwrap();
        assert_eq!(view.info.name, spec.name);
        assert_eq!(view.info.ty, ty);
        assert_eq!(view.info.dims, spec.dims);
        assert_eq!(view.info.offset, off);
        assert_eq!(view.info.offset % f.alignment, 0);
        assert_eq!(view.info.size_bytes as usize, expected_size(ty, &spec.dims), "{}", spec.name);
        assert_eq!(view.info.n_elements(), spec.dims.iter().product::<u64>());
        assert_eq!(view.data.len(), view.info.size_bytes as usize);
        assert_eq!(view.data, &spec.data[..], "{}", spec.name);
        if let Some(base) = base {
            let want = base.wrapping_add((f.data_start() + off) as usize);
            assert_eq!(view.data.as_ptr(), want, "{} is not a view into the file bytes", spec.name);
        }
        assert_eq!(f.tensor_info(&spec.name), Some(view.info));
    }
}

#[test]
fn tensor_views_are_zero_copy_with_the_right_bytes() {
    for version in [2, 3] {
        let b = many_tensors(version);
        let bytes = b.build();
        let (base, len) = (bytes.as_ptr(), bytes.len());
        let f = parse(bytes);
        check_tensors(&f, &b, Some(base));
        // Every non-empty view lies inside the original buffer: nothing was copied.
        for t in &f.tensors {
            let v = f.tensor(&t.name).unwrap();
            if !v.data.is_empty() {
                let start = v.data.as_ptr() as usize - base as usize;
                assert!(start + v.data.len() <= len);
            }
        }
        assert!(matches!(f.tensor("nope"), Err(GgufError::MissingTensor(n)) if n == "nope"));
        assert_eq!(f.tensor_info("nope"), None);
    }
}

#[test]
fn custom_alignment_is_honoured() {
    for a in [1u32, 2, 8, 64, 256] {
        let b = Builder::new(3)
            .alignment(a)
            .kv("x", Value::U8(1))
            .tensor("a", GgmlType::F16, &[3])
            .tensor("b", GgmlType::F32, &[1])
            .tensor("c", GgmlType::Q8_0, &[32]);
        let bytes = b.build();
        let base = bytes.as_ptr();
        let f = parse(bytes);
        assert_eq!(f.alignment, a as u64);
        assert_eq!(f.get("general.alignment"), Some(&Value::U32(a)));
        check_tensors(&f, &b, Some(base));
    }
    // Any unsigned or non-negative integer type is accepted for the alignment.
    let mut b = Builder::new(2).kv("general.alignment", Value::U64(16));
    b.alignment = 16;
    let b = b.tensor("t", GgmlType::F32, &[3]).tensor("u", GgmlType::F16, &[5]);
    let f = parse(b.build());
    assert_eq!(f.alignment, 16);
    check_tensors(&f, &b, None);
}

#[test]
fn open_memory_maps_a_real_file() {
    let b = many_tensors(3);
    let bytes = b.build();
    let path = std::env::temp_dir().join(format!("duet-gguf-reader-test-{}.gguf", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let f = GgufFile::open(&path);
    std::fs::remove_file(&path).unwrap();
    let f = f.unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.get("general.architecture").and_then(Value::as_str), Some("llama"));
    check_tensors(&f, &b, None);
    // The views all point into one mapping: their addresses differ exactly as their offsets do.
    let first = f.tensor("f32").unwrap();
    let base = first.data.as_ptr().wrapping_sub((f.data_start() + first.info.offset) as usize);
    check_tensors(&f, &b, Some(base));
    assert!(!(bytes.as_ptr_range().contains(&first.data.as_ptr())));

    let e = GgufFile::open(std::env::temp_dir().join("duet-no-such-file.gguf")).unwrap_err();
    assert!(matches!(&e, GgufError::Io { path, .. } if path.ends_with("duet-no-such-file.gguf")), "{e:?}");
}

// ---------------------------------------------------------------------------------------------
// Files written by the reference writer (gguf-py), kept as the fuzzer's seeds.

fn seed(name: &str) -> GgufFile {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds").join(name);
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn files_written_by_gguf_py_parse() {
    for (name, version) in [("every_value_v3.gguf", 3), ("every_value_v2.gguf", 2)] {
        let f = seed(name);
        assert_eq!(f.version, version);
        assert_eq!(f.get("t.i32"), Some(&Value::I32(i32::MIN)));
        assert_eq!(f.get("t.u64"), Some(&Value::U64(u64::MAX - 1)));
        assert_eq!(f.get("t.string").and_then(Value::as_str), Some("héllo ✓"));
        assert_eq!(f.get("a.u64"), Some(&Value::Array(vec![Value::U64(0), Value::U64(u64::MAX)])));
        let s = |x: &str| Value::String(x.into());
        assert_eq!(
            f.get("a.nested3"),
            Some(&Value::Array(vec![
                Value::Array(vec![Value::Array(vec![s("a"), s("bc")])]),
                Value::Array(vec![Value::Array(vec![s("d")])])
            ]))
        );
    }
    let f = seed("tensors_v3.gguf");
    let t = f.tensor("f32").unwrap();
    assert_eq!(t.info.dims, [4, 2]);
    let want: Vec<u8> = (0..8).flat_map(|i| (i as f32).to_le_bytes()).collect();
    assert_eq!(t.data, &want[..]);
    assert_eq!(f.tensor("q8_0").unwrap().info.dims, [32, 2]);
    assert_eq!(f.tensor("q6_k").unwrap().info.ty, GgmlType::Q6K);
    let f = seed("aligned8_v2.gguf");
    assert_eq!((f.version, f.alignment), (2, 8));
    assert_eq!(f.tensor("c").unwrap().info.ty, GgmlType::Q4_1);
    let f = seed("vocab_v3.gguf");
    assert_eq!(f.get("tokenizer.ggml.tokens").and_then(Value::as_array).map(<[Value]>::len), Some(6));
    assert_eq!(f.tensor("token_embd.weight").unwrap().data.len(), 6 * 22);
}

