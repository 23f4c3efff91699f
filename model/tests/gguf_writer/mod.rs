//! A tiny GGUF writer for the reader's tests (`gguf_reader.rs`, `gguf_bad_input.rs`): a
//! little-endian byte writer with the format's primitives, a builder of whole files, one value
//! of every metadata type.

// Each test binary uses a part of it.
#![allow(dead_code)]

use duet_kernels::quant::GgmlType;
use duet_model::gguf::{GgufError, GgufFile, Value, DEFAULT_ALIGNMENT};

pub fn parse(bytes: Vec<u8>) -> GgufFile {
    GgufFile::from_bytes(bytes).expect("valid GGUF failed to parse")
}

pub fn parse_err(bytes: Vec<u8>) -> GgufError {
    GgufFile::from_bytes(bytes).expect_err("bad GGUF parsed")
}

pub fn value_type(v: &Value) -> u32 {
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
pub struct W(pub Vec<u8>);

impl W {
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    pub fn header(&mut self, version: u32, n_tensors: u64, n_kv: u64) -> &mut Self {
        self.bytes(b"GGUF").u32(version).u64(n_tensors).u64(n_kv)
    }
    /// A value's payload (no type tag). Arrays take their item type from the first item
    /// (u8 when empty).
    pub fn value(&mut self, v: &Value) -> &mut Self {
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
    pub fn kv(&mut self, key: &str, v: &Value) -> &mut Self {
        self.str(key).u32(value_type(v)).value(v)
    }
    pub fn tensor_info(&mut self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(type_id).u64(offset)
    }
}

pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    /// `None`: the next aligned offset after the previous tensor.
    pub offset: Option<u64>,
    pub data: Vec<u8>,
}

/// Builds a whole GGUF image: header, metadata, tensor infos, padding and tensor data. The
/// last tensor ends exactly at the end of the file.
pub struct Builder {
    pub version: u32,
    pub kvs: Vec<(String, Value)>,
    pub tensors: Vec<TensorSpec>,
    pub alignment: u64,
}

/// Distinct, non-constant bytes for tensor `seed`.
pub fn pattern(n: usize, seed: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 31 + seed * 7 + 1) as u8).collect()
}

pub fn expected_size(ty: GgmlType, dims: &[u64]) -> usize {
    ty.row_bytes(dims.iter().product::<u64>() as usize)
}

impl Builder {
    pub fn new(version: u32) -> Self {
        Builder { version, kvs: Vec::new(), tensors: Vec::new(), alignment: DEFAULT_ALIGNMENT }
    }

    pub fn kv(mut self, key: &str, v: Value) -> Self {
        self.kvs.push((key.to_string(), v));
        self
    }

    /// Writes `general.alignment` (u32); lays data out with it when it is a power of two.
    pub fn alignment(mut self, a: u32) -> Self {
        if a.is_power_of_two() {
            self.alignment = a as u64;
        }
        self.kv("general.alignment", Value::U32(a))
    }

    /// A well-formed tensor of `ty` and `dims` filled with a pattern.
    pub fn tensor(self, name: &str, ty: GgmlType, dims: &[u64]) -> Self {
        let n = expected_size(ty, dims);
        let seed = self.tensors.len();
        self.raw_tensor(name, ty.id(), dims, None, pattern(n, seed))
    }

    pub fn raw_tensor(mut self, name: &str, type_id: u32, dims: &[u64], offset: Option<u64>, data: Vec<u8>) -> Self {
        self.tensors.push(TensorSpec { name: name.to_string(), dims: dims.to_vec(), type_id, offset, data });
        self
    }

    /// Data-section offsets of the tensors.
    pub fn offsets(&self) -> Vec<u64> {
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

    pub fn build(&self) -> Vec<u8> {
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
pub fn every_value() -> Vec<(&'static str, Value)> {
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
pub fn nested(levels: u32) -> Value {
    (0..levels).fold(Value::U8(42), |v, _| Value::Array(vec![v]))
}

// ---------------------------------------------------------------------------------------------
// Well-formed files.

/// A small well-formed file: metadata of several types, two tensors.
pub fn small_valid(version: u32) -> Vec<u8> {
    Builder::new(version)
        .kv("general.architecture", Value::String("llama".into()))
        .kv("n", Value::U32(3))
        .kv("tokens", Value::Array(vec![Value::String("a".into()), Value::String("bc".into())]))
        .kv("nested", Value::Array(vec![Value::Array(vec![Value::I16(1)])]))
        .tensor("w", GgmlType::F32, &[4])
        .tensor("q", GgmlType::Q8_0, &[32])
        .build()
}
