//! GGUF reader tests: tiny GGUF files built in memory, round trips of every metadata type,
//! zero-copy tensor views, the memory-mapped path, and every bad input giving its typed error.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use duet_kernels::quant::GgmlType;
use duet_model::gguf::{GgufError, GgufFile, Value, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS, MAX_ENTRIES};

// ---------------------------------------------------------------------------------------------
// Allocation tracking: the largest single allocation made on the current thread.

struct Tracking;

thread_local! {
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = PEAK.try_with(|p| {
        if size > p.get() {
            p.set(size)
        }
    });
}

// SAFETY: forwards to the system allocator; only records sizes.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

/// Parses `bytes`, returning the result and the largest single allocation made while parsing.
fn parse_measured(bytes: Vec<u8>) -> (Result<GgufFile, GgufError>, usize) {
    PEAK.with(|p| p.set(0));
    let r = GgufFile::from_bytes(bytes);
    (r, PEAK.with(|p| p.get()))
}

/// An absurd count must be refused at once, without reserving anything near the count.
fn parse_cheaply(bytes: Vec<u8>) -> GgufError {
    let len = bytes.len();
    let (r, peak) = parse_measured(bytes);
    assert!(peak <= 64 * 1024 + len, "parsing a {len}-byte file allocated {peak} bytes at once");
    r.expect_err("absurd input parsed")
}

fn parse(bytes: Vec<u8>) -> GgufFile {
    GgufFile::from_bytes(bytes).expect("valid GGUF failed to parse")
}

fn parse_err(bytes: Vec<u8>) -> GgufError {
    GgufFile::from_bytes(bytes).expect_err("bad GGUF parsed")
}

// ---------------------------------------------------------------------------------------------
// A tiny GGUF writer.

fn value_type(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

/// Little-endian byte writer with the GGUF primitives.
#[derive(Default)]
struct W(Vec<u8>);

impl W {
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    fn header(&mut self, version: u32, n_tensors: u64, n_kv: u64) -> &mut Self {
        self.bytes(b"GGUF").u32(version).u64(n_tensors).u64(n_kv)
    }
    /// A value's payload (no type tag). Arrays take their item type from the first item
    /// (u8 when empty).
    fn value(&mut self, v: &Value) -> &mut Self {
        match v {
            Value::U8(x) => self.bytes(&x.to_le_bytes()),
            Value::I8(x) => self.bytes(&x.to_le_bytes()),
            Value::U16(x) => self.bytes(&x.to_le_bytes()),
            Value::I16(x) => self.bytes(&x.to_le_bytes()),
            Value::U32(x) => self.bytes(&x.to_le_bytes()),
            Value::I32(x) => self.bytes(&x.to_le_bytes()),
            Value::F32(x) => self.bytes(&x.to_le_bytes()),
            Value::Bool(x) => self.bytes(&[*x as u8]),
            Value::String(s) => self.str(s),
            Value::Array(items) => {
                self.u32(items.first().map_or(0, value_type)).u64(items.len() as u64);
                for item in items {
                    self.value(item);
                }
                self
            }
            Value::U64(x) => self.bytes(&x.to_le_bytes()),
            Value::I64(x) => self.bytes(&x.to_le_bytes()),
            Value::F64(x) => self.bytes(&x.to_le_bytes()),
        }
    }
    fn kv(&mut self, key: &str, v: &Value) -> &mut Self {
        self.str(key).u32(value_type(v)).value(v)
    }
    fn tensor_info(&mut self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(type_id).u64(offset)
    }
}

struct TensorSpec {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    /// `None`: the next aligned offset after the previous tensor.
    offset: Option<u64>,
    data: Vec<u8>,
}

/// Builds a whole GGUF image: header, metadata, tensor infos, padding and tensor data. The
/// last tensor ends exactly at the end of the file.
struct Builder {
    version: u32,
    kvs: Vec<(String, Value)>,
    tensors: Vec<TensorSpec>,
    alignment: u64,
}

/// Distinct, non-constant bytes for tensor `seed`.
fn pattern(n: usize, seed: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 31 + seed * 7 + 1) as u8).collect()
}

fn expected_size(ty: GgmlType, dims: &[u64]) -> usize {
    ty.row_bytes(dims.iter().product::<u64>() as usize)
}

impl Builder {
    fn new(version: u32) -> Self {
        Builder { version, kvs: Vec::new(), tensors: Vec::new(), alignment: DEFAULT_ALIGNMENT }
    }

    fn kv(mut self, key: &str, v: Value) -> Self {
        self.kvs.push((key.to_string(), v));
        self
    }

    /// Writes `general.alignment` (u32); lays data out with it when it is a power of two.
    fn alignment(mut self, a: u32) -> Self {
        if a.is_power_of_two() {
            self.alignment = a as u64;
        }
        self.kv("general.alignment", Value::U32(a))
    }

    /// A well-formed tensor of `ty` and `dims` filled with a pattern.
    fn tensor(self, name: &str, ty: GgmlType, dims: &[u64]) -> Self {
        let n = expected_size(ty, dims);
        let seed = self.tensors.len();
        self.raw_tensor(name, ty.id(), dims, None, pattern(n, seed))
    }

    fn raw_tensor(mut self, name: &str, type_id: u32, dims: &[u64], offset: Option<u64>, data: Vec<u8>) -> Self {
        self.tensors.push(TensorSpec { name: name.to_string(), dims: dims.to_vec(), type_id, offset, data });
        self
    }

    /// Data-section offsets of the tensors.
    fn offsets(&self) -> Vec<u64> {
        let mut cursor = 0u64;
        self.tensors
            .iter()
            .map(|t| {
                let off = t.offset.unwrap_or_else(|| cursor.next_multiple_of(self.alignment));
                cursor = cursor.max(off + t.data.len() as u64);
                off
            })
            .collect()
    }

    fn build(&self) -> Vec<u8> {
        let mut w = W::default();
        w.header(self.version, self.tensors.len() as u64, self.kvs.len() as u64);
        for (k, v) in &self.kvs {
            w.kv(k, v);
        }
        let offsets = self.offsets();
        for (t, &off) in self.tensors.iter().zip(&offsets) {
            w.tensor_info(&t.name, &t.dims, t.type_id, off);
        }
        if self.tensors.is_empty() {
            return w.0;
        }
        let data_start = (w.0.len() as u64).next_multiple_of(self.alignment) as usize;
        w.0.resize(data_start, 0);
        for (t, &off) in self.tensors.iter().zip(&offsets) {
            if t.data.is_empty() {
                continue;
            }
            let at = data_start + off as usize;
            if w.0.len() < at + t.data.len() {
                w.0.resize(at + t.data.len(), 0);
            }
            w.0[at..at + t.data.len()].copy_from_slice(&t.data);
        }
        w.0
    }
}

/// One value of every type, arrays of each type, and nested arrays.
fn every_value() -> Vec<(&'static str, Value)> {
    use Value::*;
    let s = |x: &str| String(x.to_string());
    vec![
        ("t.u8", U8(0xfe)),
        ("t.i8", I8(-128)),
        ("t.u16", U16(0xbeef)),
        ("t.i16", I16(-12345)),
        ("t.u32", U32(0xdead_beef)),
        ("t.i32", I32(i32::MIN)),
        ("t.f32", F32(-1.5e-3)),
        ("t.bool.true", Bool(true)),
        ("t.bool.false", Bool(false)),
        ("t.string", s("héllo, wörld ✓")),
        ("t.string.empty", s("")),
        ("t.u64", U64(u64::MAX - 1)),
        ("t.i64", I64(i64::MIN + 7)),
        ("t.f64", F64(std::f64::consts::PI)),
        ("a.u8", Array(vec![U8(1), U8(2), U8(255)])),
        ("a.i8", Array(vec![I8(-1), I8(127)])),
        ("a.u16", Array(vec![U16(0), U16(65535)])),
        ("a.i16", Array(vec![I16(-32768), I16(1)])),
        ("a.u32", Array(vec![U32(7), U32(8), U32(9)])),
        ("a.i32", Array(vec![I32(-7)])),
        ("a.f32", Array(vec![F32(0.5), F32(-0.0), F32(f32::MAX)])),
        ("a.bool", Array(vec![Bool(true), Bool(false), Bool(true)])),
        ("a.string", Array(vec![s("<s>"), s(""), s("Ġthe"), s("日本")])),
        ("a.u64", Array(vec![U64(0), U64(u64::MAX)])),
        ("a.i64", Array(vec![I64(i64::MAX), I64(-1)])),
        ("a.f64", Array(vec![F64(1e300), F64(-2.25)])),
        ("a.empty", Array(vec![])),
        ("a.nested", Array(vec![Array(vec![U32(1), U32(2)]), Array(vec![U32(3)]), Array(vec![])])),
        ("a.nested.strings", Array(vec![Array(vec![s("a"), s("bc")]), Array(vec![s("")])])),
        ("a.nested3", Array(vec![Array(vec![Array(vec![I64(-3), I64(4)])]), Array(vec![Array(vec![])])])),
    ]
}

/// `levels` arrays nested inside each other around a u8.
fn nested(levels: u32) -> Value {
    (0..levels).fold(Value::U8(42), |v, _| Value::Array(vec![v]))
}

// ---------------------------------------------------------------------------------------------
// Well-formed files.

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
// Bad input: every case gives its own typed error.

fn small_valid(version: u32) -> Vec<u8> {
    Builder::new(version)
        .kv("general.architecture", Value::String("llama".into()))
        .kv("n", Value::U32(3))
        .kv("tokens", Value::Array(vec![Value::String("a".into()), Value::String("bc".into())]))
        .kv("nested", Value::Array(vec![Value::Array(vec![Value::I16(1)])]))
        .tensor("w", GgmlType::F32, &[4])
        .tensor("q", GgmlType::Q8_0, &[32])
        .build()
}

#[test]
fn every_truncation_is_a_typed_error() {
    for version in [2, 3] {
        let full = small_valid(version);
        parse(full.clone());
        let mut seen = [false; 4];
        for len in 0..full.len() {
            let e = parse_err(full[..len].to_vec());
            match &e {
                GgufError::Truncated { what, offset, len: file_len } => {
                    assert_eq!(*file_len, len as u64);
                    assert!(*offset <= len as u64);
                    if len < 4 {
                        assert_eq!(what, "magic");
                    } else if len < 8 {
                        assert_eq!(what, "version");
                    }
                    seen[0] = true;
                }
                GgufError::StringTooLong { .. } => seen[1] = true,
                GgufError::TooMany { .. } => seen[2] = true,
                GgufError::TensorOutOfBounds { .. } => seen[3] = true,
                other => panic!("prefix of {len} bytes gave {other:?}"),
            }
        }
        assert_eq!(seen, [true; 4], "not every kind of truncation was exercised");
        // Cutting into the tensor data is always a tensor out of bounds.
        let e = parse_err(full[..full.len() - 1].to_vec());
        assert!(matches!(&e, GgufError::TensorOutOfBounds { tensor, size: 34, .. } if tensor == "q"), "{e:?}");
    }
}

#[test]
fn wrong_magic() {
    for magic in [*b"GGUE", *b"FUGG", *b"GGML", *b"\0\0\0\0"] {
        let mut bytes = small_valid(3);
        bytes[..4].copy_from_slice(&magic);
        let e = parse_err(bytes);
        assert!(matches!(e, GgufError::BadMagic { found } if found == magic), "{e:?}");
    }
}

#[test]
fn unsupported_versions() {
    for version in [0, 1, 4, u32::MAX] {
        let e = parse_err(small_valid(version));
        assert!(matches!(e, GgufError::UnsupportedVersion(v) if v == version), "{e:?}");
    }
    // A big-endian v3 file reads as version 0x03000000.
    let mut bytes = small_valid(3);
    bytes[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(matches!(parse_err(bytes), GgufError::UnsupportedVersion(0x0300_0000)));
}

#[test]
fn unknown_tensor_type() {
    for type_id in [4, 5, 99, u32::MAX] {
        let b = Builder::new(3).tensor("ok", GgmlType::F32, &[1]).raw_tensor("bad", type_id, &[32], None, vec![0; 64]);
        let e = parse_err(b.build());
        assert!(
            matches!(&e, GgufError::UnknownTensorType { tensor, type_id: t } if tensor == "bad" && *t == type_id),
            "{e:?}"
        );
    }
}

#[test]
fn known_but_unsupported_tensor_type() {
    for ty in [GgmlType::Q2K, GgmlType::Q3K, GgmlType::Q8K, GgmlType::Q8_1] {
        assert!(!ty.is_storage_type());
        let b = Builder::new(3).raw_tensor("t", ty.id(), &[256], None, vec![0; expected_size(ty, &[256])]);
        let e = parse_err(b.build());
        assert!(matches!(&e, GgufError::UnsupportedTensorType { tensor, ty: t } if tensor == "t" && *t == ty), "{e:?}");
    }
    // Q2_K is id 10.
    let b = Builder::new(3).raw_tensor("t", 10, &[256], None, vec![0; 84]);
    assert!(matches!(parse_err(b.build()), GgufError::UnsupportedTensorType { ty: GgmlType::Q2K, .. }));
}

#[test]
fn tensor_past_the_end_of_the_file() {
    // Data one byte short.
    let b = Builder::new(3).tensor("a", GgmlType::F32, &[8]).raw_tensor("b", 0, &[8], None, vec![0; 31]);
    let e = parse_err(b.build());
    assert!(
        matches!(&e, GgufError::TensorOutOfBounds { tensor, offset: 32, size: 32, available: 63 } if tensor == "b"),
        "{e:?}"
    );
    // Offset far beyond the data.
    let b = Builder::new(3).tensor("a", GgmlType::F32, &[8]).raw_tensor("far", 0, &[1], Some(1 << 20), vec![]);
    let e = parse_err(b.build());
    assert!(
        matches!(&e, GgufError::TensorOutOfBounds { tensor, offset, .. } if tensor == "far" && *offset == 1 << 20),
        "{e:?}"
    );
    // Offset + size overflows a u64.
    let huge = u64::MAX - 31;
    let b = Builder::new(3).tensor("a", GgmlType::F32, &[8]).raw_tensor("wrap", 0, &[64], Some(huge), vec![]);
    let e = parse_err(b.build());
    assert!(
        matches!(&e, GgufError::TensorOutOfBounds { tensor, offset, .. } if tensor == "wrap" && *offset == huge),
        "{e:?}"
    );
}

#[test]
fn empty_tensor_when_the_data_section_starts_past_the_end() {
    // A zero-size tensor in a file that ends before its (aligned) data section: the tensor
    // still starts past the end of the file.
    let mut w = W::default();
    w.header(3, 1, 0).tensor_info("e", &[0], 0, 0);
    assert_ne!(w.0.len() % 32, 0);
    let e = parse_err(w.0.clone());
    assert!(matches!(&e, GgufError::TensorOutOfBounds { tensor, size: 0, available: 0, .. } if tensor == "e"), "{e:?}");
    // With the padding present it is a valid empty tensor.
    let padded = w.0.len().next_multiple_of(32);
    w.0.resize(padded, 0);
    let f = parse(w.0);
    assert!(f.tensor("e").unwrap().data.is_empty());
}

#[test]
fn absurd_tensor_count() {
    for count in [1u64 << 60, u64::MAX] {
        let mut w = W::default();
        w.header(3, count, 0);
        let e = parse_cheaply(w.0);
        assert!(matches!(e, GgufError::TooMany { what: "tensor", count: c, limit: 0 } if c == count), "{e:?}");
    }
    // Followed by some bytes: the limit is what those bytes could hold.
    let mut w = W::default();
    w.header(3, 1 << 60, 0).bytes(&[0; 240]);
    let e = parse_cheaply(w.0);
    assert!(matches!(e, GgufError::TooMany { what: "tensor", limit: 10, .. }), "{e:?}");
}

#[test]
fn absurd_metadata_count() {
    let mut w = W::default();
    w.header(3, 0, 1 << 60).bytes(&[0; 100]);
    let e = parse_cheaply(w.0);
    assert!(matches!(e, GgufError::TooMany { what: "metadata entry", count, .. } if count == 1 << 60), "{e:?}");
}

#[test]
fn absurd_string_length() {
    let len = 1u64 << 40;
    // As a key.
    let mut w = W::default();
    w.header(3, 0, 1).u64(len).bytes(b"key").u32(0).bytes(&[0; 16]);
    let e = parse_cheaply(w.0);
    assert!(matches!(e, GgufError::StringTooLong { len: l, offset: 32, remaining: 23 } if l == len), "{e:?}");
    // As a string value.
    let mut w = W::default();
    w.header(3, 0, 1).str("k").u32(8).u64(len).bytes(b"abc");
    let e = parse_cheaply(w.0);
    assert!(matches!(e, GgufError::StringTooLong { len: l, remaining: 3, .. } if l == len), "{e:?}");
    // As a tensor name.
    let mut w = W::default();
    w.header(3, 1, 0).u64(len).bytes(&[b'x'; 40]);
    let e = parse_cheaply(w.0);
    assert!(matches!(e, GgufError::StringTooLong { len: l, .. } if l == len), "{e:?}");
    // u64::MAX does not overflow anything either.
    let mut w = W::default();
    w.header(3, 0, 1).u64(u64::MAX).bytes(&[0; 16]);
    assert!(matches!(parse_cheaply(w.0), GgufError::StringTooLong { len: u64::MAX, .. }));
}

#[test]
fn absurd_array_length() {
    for (item_type, count) in [(0u32, 1u64 << 40), (8, 1 << 60), (9, 1 << 60), (12, u64::MAX)] {
        let mut w = W::default();
        w.header(3, 0, 1).str("arr").u32(9).u32(item_type).u64(count).bytes(&[0; 64]);
        let e = parse_cheaply(w.0);
        assert!(
            matches!(e, GgufError::TooMany { what: "array element", count: c, .. } if c == count),
            "type {item_type}: {e:?}"
        );
    }
    // Inside a nested array.
    let mut w = W::default();
    w.header(3, 0, 1).str("arr").u32(9).u32(9).u64(1).u32(0).u64(1 << 50).bytes(&[1, 2, 3]);
    let e = parse_cheaply(w.0);
    assert!(matches!(e, GgufError::TooMany { what: "array element", limit: 3, .. }), "{e:?}");
}

#[test]
fn counts_are_capped_at_max_entries() {
    // A u8 array one longer than the cap, with every byte present.
    let n = MAX_ENTRIES + 1;
    let mut w = W::default();
    w.header(3, 0, 1).str("big").u32(9).u32(0).u64(n);
    w.0.resize(w.0.len() + n as usize, 7);
    let e = parse_err(w.0);
    assert!(
        matches!(e, GgufError::TooMany { what: "array element", count, limit } if count == n && limit == MAX_ENTRIES),
        "{e:?}"
    );
}

#[test]
fn arrays_nested_too_deep() {
    // Raw nesting far past the limit: an array of one array of one array ...
    let mut w = W::default();
    w.header(3, 0, 1).str("deep").u32(9);
    for _ in 0..1000 {
        w.u32(9).u64(1);
    }
    w.u32(0).u64(0);
    let e = parse_cheaply(w.0);
    assert!(matches!(&e, GgufError::ArrayTooDeep { key } if key == "deep"), "{e:?}");
}

#[test]
fn unknown_metadata_value_type() {
    for value_type in [13u32, 100, u32::MAX] {
        let mut w = W::default();
        w.header(3, 0, 1).str("k").u32(value_type).bytes(&[0; 16]);
        let e = parse_err(w.0);
        assert!(
            matches!(&e, GgufError::UnknownValueType { key, value_type: t } if key == "k" && *t == value_type),
            "{e:?}"
        );
        // As an array item type.
        let mut w = W::default();
        w.header(3, 0, 1).str("a").u32(9).u32(value_type).u64(1).bytes(&[0; 16]);
        let e = parse_err(w.0);
        assert!(
            matches!(&e, GgufError::UnknownValueType { key, value_type: t } if key == "a" && *t == value_type),
            "{e:?}"
        );
    }
}

#[test]
fn bad_alignment() {
    for a in [0u32, 3, 48, u32::MAX] {
        let e = parse_err(Builder::new(3).alignment(a).tensor("t", GgmlType::F32, &[4]).build());
        assert!(matches!(e, GgufError::BadAlignment(x) if x == a as u64), "{a}: {e:?}");
    }
    for v in [Value::String("32".into()), Value::I32(-32), Value::F32(32.0)] {
        let found = v.type_name();
        let e = parse_err(Builder::new(3).kv("general.alignment", v).build());
        assert!(
            matches!(&e, GgufError::WrongType { key, found: f, .. } if key == "general.alignment" && *f == found),
            "{e:?}"
        );
    }
}

#[test]
fn misaligned_tensor_offset() {
    let b = Builder::new(3).raw_tensor("t", 0, &[4], Some(4), vec![0; 16]);
    let e = parse_err(b.build());
    assert!(matches!(&e, GgufError::Misaligned { tensor, offset: 4, alignment: 32 } if tensor == "t"), "{e:?}");
    let b =
        Builder::new(3).alignment(64).tensor("a", GgmlType::F32, &[1]).raw_tensor("b", 0, &[1], Some(32), vec![0; 4]);
    let e = parse_err(b.build());
    assert!(matches!(&e, GgufError::Misaligned { tensor, offset: 32, alignment: 64 } if tensor == "b"), "{e:?}");
}

#[test]
fn duplicate_key() {
    let b = Builder::new(3).kv("k", Value::U8(1)).kv("other", Value::U8(2)).kv("k", Value::String("x".into()));
    let e = parse_err(b.build());
    assert!(matches!(&e, GgufError::DuplicateKey(k) if k == "k"), "{e:?}");
}

#[test]
fn duplicate_tensor() {
    let b = Builder::new(3).tensor("t", GgmlType::F32, &[4]).tensor("u", GgmlType::F32, &[4]).tensor(
        "t",
        GgmlType::F16,
        &[4],
    );
    let e = parse_err(b.build());
    assert!(matches!(&e, GgufError::DuplicateTensor(t) if t == "t"), "{e:?}");
}

#[test]
fn bad_number_of_dims() {
    for n_dims in [0u32, MAX_DIMS + 1, 64, u32::MAX] {
        let mut w = W::default();
        w.header(3, 1, 0).str("t").u32(n_dims).bytes(&[1; 64]);
        let e = parse_cheaply(w.0);
        assert!(
            matches!(&e, GgufError::BadShape { tensor, reason } if tensor == "t" && reason.contains("dimensions")),
            "{n_dims}: {e:?}"
        );
    }
}

#[test]
fn row_length_not_a_multiple_of_the_block_size() {
    for (ty, dims) in
        [(GgmlType::Q4_0, [33u64, 2]), (GgmlType::Q8_0, [16, 1]), (GgmlType::Q4K, [128, 2]), (GgmlType::Q6K, [300, 1])]
    {
        let b = Builder::new(3).raw_tensor("t", ty.id(), &dims, None, vec![0; 1024]);
        let e = parse_err(b.build());
        assert!(
            matches!(&e, GgufError::BadShape { tensor, reason } if tensor == "t" && reason.contains("block size")),
            "{ty}: {e:?}"
        );
    }
}

#[test]
fn dims_whose_product_overflows() {
    // The element count overflows, or the byte size does.
    for (type_id, dims) in
        [(0u32, vec![1u64 << 32, 1 << 32]), (0, vec![1 << 62]), (1, vec![3, u64::MAX / 2]), (2, vec![1 << 63, 4])]
    {
        let b = Builder::new(3).raw_tensor("t", type_id, &dims, None, vec![]);
        let e = parse_cheaply(b.build());
        assert!(
            matches!(&e, GgufError::BadShape { tensor, reason } if tensor == "t" && reason.contains("overflow")),
            "{dims:?}: {e:?}"
        );
    }
}

#[test]
fn invalid_utf8() {
    let mut w = W::default();
    w.header(3, 0, 1).u64(2).bytes(&[0xff, 0xfe]).u32(0).bytes(&[0]);
    assert!(matches!(parse_err(w.0), GgufError::InvalidUtf8 { offset: 32 }));
    let mut w = W::default();
    w.header(3, 1, 0).u64(1).bytes(&[0x80]).bytes(&[0; 40]);
    assert!(matches!(parse_err(w.0), GgufError::InvalidUtf8 { offset: 32 }));
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

#[test]
fn the_allocation_tracker_sees_big_allocations() {
    // Self-check for `parse_cheaply`: a real 100 000-element array is seen as one big Vec.
    let n = 100_000u64;
    let mut w = W::default();
    w.header(3, 0, 1).str("big").u32(9).u32(0).u64(n);
    w.0.resize(w.0.len() + n as usize, 7);
    let (r, peak) = parse_measured(w.0);
    assert_eq!(r.unwrap().get("big").and_then(Value::as_array).map(<[Value]>::len), Some(n as usize));
    assert!(peak >= n as usize * std::mem::size_of::<Value>(), "peak {peak}");
}
