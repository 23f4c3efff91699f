//! Fuzz target: arbitrary bytes into the GGUF reader; on success, every metadata value and
//! every byte of every tensor view is read. Any panic (including overflow) is a bug.

#![no_main]

use std::hint::black_box;

use duet_model::gguf::{GgufFile, Value};
use libfuzzer_sys::fuzz_target;

/// Visits a value and everything nested in it through the public accessors.
fn touch(v: &Value) -> u64 {
    let mut h = v.type_name().len() as u64;
    h ^= v.as_u64().unwrap_or(0);
    h ^= v.as_f64().map_or(0, f64::to_bits);
    h ^= v.as_str().map_or(0, |s| s.len() as u64);
    h ^= v.as_bool().map_or(0, u64::from);
    if let Some(items) = v.as_array() {
        for item in items {
            h = h.rotate_left(5) ^ touch(item);
        }
    }
    h
}

fuzz_target!(|data: &[u8]| {
    let file = match GgufFile::from_bytes(data.to_vec()) {
        Ok(f) => f,
        Err(e) => {
            black_box(e.to_string());
            return;
        }
    };
    black_box(format!("{file:?}"));
    assert!(matches!(file.version, 2 | 3));
    assert!(file.alignment.is_power_of_two());
    assert_eq!(file.data_start() % file.alignment, 0);
    for (key, value) in &file.metadata {
        // Identity, not equality: a NaN value is not equal to itself.
        assert!(file.get(key).is_some_and(|v| std::ptr::eq(v, value)));
        black_box(touch(value));
    }
    for info in &file.tensors {
        let view = file.tensor(&info.name).expect("a listed tensor has a view");
        assert_eq!(view.info, info);
        assert_eq!(view.data.len() as u64, info.size_bytes);
        assert_eq!(info.offset % file.alignment, 0);
        assert!(!info.dims.is_empty());
        assert_eq!(info.dims[0] % info.ty.block_size() as u64, 0);
        black_box(info.n_elements());
        black_box(view.data.iter().fold(0u8, |a, &b| a.wrapping_add(b)));
    }
});
