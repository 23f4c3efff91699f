//! GGUF reader tests on bad input: every truncation, bad count, type, offset and string gives
//! its own typed error, and an absurd count is refused without reserving memory for it.

mod gguf_writer;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use duet_kernels::quant::GgmlType;
use duet_model::gguf::{GgufError, GgufFile, Value, MAX_DIMS, MAX_ENTRIES};
use gguf_writer::*;

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
