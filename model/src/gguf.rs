//! GGUF v2/v3 reader: metadata, tensor infos and zero-copy tensor views over a memory map.
//!
//! The reader is pure: it parses from a byte slice, caps every count and length by what the
//! remaining bytes could possibly hold, and checks every tensor against the end of the data.
//! A malformed file gives a [`GgufError`] naming the problem; it never panics and never
//! allocates more than the file could describe.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use memmap2::Mmap;

use duet_kernels::quant::GgmlType;

/// `GGUF` read as a little-endian u32.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the tensor data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// More dimensions than ggml supports is a malformed tensor.
pub const MAX_DIMS: u32 = 4;
/// Nested arrays deeper than this are refused (the format allows it; nobody writes it).
pub const MAX_ARRAY_DEPTH: u32 = 8;
/// Hard cap on the number of tensors and metadata entries, whatever the file claims.
pub const MAX_ENTRIES: u64 = 1 << 24;

/// Everything that can be wrong with a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read GGUF file {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {0} (this reader handles versions 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("file truncated while reading {what} at byte {offset} (file is {len} bytes)")]
    Truncated { what: String, offset: u64, len: u64 },
    #[error("{what} count {count} is impossible (limit {limit})")]
    TooMany { what: &'static str, count: u64, limit: u64 },
    #[error("string of {len} bytes at byte {offset} runs past the end of the file ({remaining} bytes left)")]
    StringTooLong { len: u64, offset: u64, remaining: u64 },
    #[error("string at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { offset: u64 },
    #[error("metadata key {key:?} has unknown value type {value_type}")]
    UnknownValueType { key: String, value_type: u32 },
    #[error("metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH}")]
    ArrayTooDeep { key: String },
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    #[error("tensor {tensor:?} has unknown ggml type {type_id}")]
    UnknownTensorType { tensor: String, type_id: u32 },
    #[error("tensor {tensor:?} has unsupported ggml type {ty}")]
    UnsupportedTensorType { tensor: String, ty: GgmlType },
    #[error("tensor {tensor:?} has a bad shape: {reason}")]
    BadShape { tensor: String, reason: String },
    #[error("tensor {tensor:?} data offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned { tensor: String, offset: u64, alignment: u64 },
    #[error("tensor {tensor:?} ({size} bytes at data offset {offset}) runs past the end of the file (data section holds {available} bytes)")]
    TensorOutOfBounds { tensor: String, offset: u64, size: u64, available: u64 },
    #[error("general.alignment {0} is not a non-zero power of two")]
    BadAlignment(u64),
    #[error("metadata key {key:?} is missing")]
    MissingKey { key: String },
    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType { key: String, expected: &'static str, found: &'static str },
    #[error("tensor {0:?} is missing")]
    MissingTensor(String),
}

/// A metadata value, with every type GGUF defines (arrays may nest).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The GGUF name of this value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }

    /// Any integer type that fits a u64 (negative values do not).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any numeric type as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64).or(match *self {
                Value::I8(v) => Some(v as f64),
                Value::I16(v) => Some(v as f64),
                Value::I32(v) => Some(v as f64),
                Value::I64(v) => Some(v as f64),
                _ => None,
            }),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where a tensor's bytes are and how to read them.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: `dims[0]` is the contiguous (row) dimension.
    pub dims: Vec<u64>,
    /// Offset relative to the start of the data section.
    pub offset: u64,
    pub size_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A tensor's bytes, borrowed from the file.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub info: &'a TensorInfo,
    pub data: &'a [u8],
}

enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file; tensor data stays in the memory map.
pub struct GgufFile {
    storage: Storage,
    pub version: u32,
    pub alignment: u64,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: BTreeMap<String, usize>,
    data_start: u64,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses a file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io { path: path.display().to_string(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; a model file changed underneath a running server is
        // outside what any inference server can defend against (llama.cpp maps the same way).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(Storage::Mapped(map))
    }

    /// Parses a GGUF image held in memory (tests, fuzzing).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<Self, GgufError> {
        let header = parse_header(storage.bytes())?;
        let tensor_index = header.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(GgufFile {
            storage,
            version: header.version,
            alignment: header.alignment,
            metadata: header.metadata,
            tensors: header.tensors,
            tensor_index,
            data_start: header.data_start,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Zero-copy view of a tensor's bytes (bounds were checked at parse time).
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, GgufError> {
        let info = self.tensor_info(name).ok_or_else(|| GgufError::MissingTensor(name.to_string()))?;
        let start = (self.data_start + info.offset) as usize;
        let data = &self.storage.bytes()[start..start + info.size_bytes as usize];
        Ok(TensorView { info, data })
    }

    /// Drops this process's mapping of a tensor's pages (`madvise(MADV_DONTNEED)`), for a
    /// tensor whose bytes were copied elsewhere: its resident memory is then counted once.
    /// The bytes stay readable (a later read faults them in again from the page cache).
    /// Does nothing for an image held in memory; errors are the kernel's.
    pub fn release_tensor_pages(&self, name: &str) -> std::io::Result<()> {
        let Storage::Mapped(map) = &self.storage else {
            return Ok(());
        };
        let Some(info) = self.tensor_info(name) else {
            return Ok(());
        };
        let start = (self.data_start + info.offset) as usize;
        // SAFETY: the map is read-only and private to this process, so dropping its pages
        // loses nothing: a later access maps the file's (unchanged) pages again. Pages that a
        // neighbouring tensor shares are faulted back in the same way.
        unsafe {
            map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                start,
                info.size_bytes as usize,
            )
        }
    }

    /// Byte offset of the tensor data section within the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }
}

struct Header {
    version: u32,
    alignment: u64,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    data_start: u64,
}

/// A bounds-checked little-endian cursor.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated { what: what(), offset: self.pos as u64, len: self.bytes.len() as u64 });
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(GgufError::StringTooLong { len, offset: self.pos as u64, remaining: self.remaining() });
        }
        let offset = self.pos as u64;
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes).map(str::to_owned).map_err(|_| GgufError::InvalidUtf8 { offset })
    }

    /// A count of items each at least `min_item_bytes` long must fit in what is left.
    fn count(&mut self, what: &'static str, min_item_bytes: u64) -> Result<u64, GgufError> {
        let count = self.u64(&|| format!("{what} count"))?;
        let limit = (self.remaining() / min_item_bytes.max(1)).min(MAX_ENTRIES);
        if count > limit {
            return Err(GgufError::TooMany { what, count, limit });
        }
        Ok(count)
    }
}

const VALUE_TYPE_ARRAY: u32 = 9;

/// Smallest encoding of a value of this type (used to cap array lengths).
fn min_value_bytes(value_type: u32) -> u64 {
    match value_type {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        VALUE_TYPE_ARRAY => 12,
        _ => 8,
    }
}

fn read_value(c: &mut Cursor<'_>, key: &str, value_type: u32, depth: u32) -> Result<Value, GgufError> {
    let what = || format!("value of {key:?}");
    Ok(match value_type {
        0 => Value::U8(c.array::<1>(&what)?[0]),
        1 => Value::I8(c.array::<1>(&what)?[0] as i8),
        2 => Value::U16(u16::from_le_bytes(c.array(&what)?)),
        3 => Value::I16(i16::from_le_bytes(c.array(&what)?)),
        4 => Value::U32(u32::from_le_bytes(c.array(&what)?)),
        5 => Value::I32(i32::from_le_bytes(c.array(&what)?)),
        6 => Value::F32(f32::from_le_bytes(c.array(&what)?)),
        7 => Value::Bool(c.array::<1>(&what)?[0] != 0),
        8 => Value::String(c.string(&what)?),
        VALUE_TYPE_ARRAY => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(GgufError::ArrayTooDeep { key: key.to_string() });
            }
            let item_type = c.u32(&what)?;
            if !(0..=12).contains(&item_type) {
                return Err(GgufError::UnknownValueType { key: key.to_string(), value_type: item_type });
            }
            let n = c.count("array element", min_value_bytes(item_type))?;
            let mut items = Vec::with_capacity(n as usize);
            for _ in 0..n {
                items.push(read_value(c, key, item_type, depth + 1)?);
            }
            Value::Array(items)
        }
        10 => Value::U64(u64::from_le_bytes(c.array(&what)?)),
        11 => Value::I64(i64::from_le_bytes(c.array(&what)?)),
        12 => Value::F64(f64::from_le_bytes(c.array(&what)?)),
        other => return Err(GgufError::UnknownValueType { key: key.to_string(), value_type: other }),
    })
}

fn parse_header(bytes: &[u8]) -> Result<Header, GgufError> {
    let mut c = Cursor { bytes, pos: 0 };
    let magic = c.array::<4>(&|| "magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32(&|| "version".into())?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    // A tensor info takes at least 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes;
    // a metadata entry at least 8 (key len) + 4 (type) + 1 byte.
    let n_tensors = c.count("tensor", 24)?;
    let n_kv = c.count("metadata entry", 13)?;

    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&|| format!("key of metadata entry {i}"))?;
        let value_type = c.u32(&|| format!("type of {key:?}"))?;
        let value = read_value(&mut c, &key, value_type, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(GgufError::DuplicateKey(key));
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => {
            let a = v.as_u64().ok_or(GgufError::WrongType {
                key: "general.alignment".into(),
                expected: "u32",
                found: v.type_name(),
            })?;
            if a == 0 || !a.is_power_of_two() {
                return Err(GgufError::BadAlignment(a));
            }
            a
        }
    };

    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..n_tensors {
        let name = c.string(&|| format!("name of tensor {i}"))?;
        let what = || format!("info of tensor {name:?}");
        let n_dims = c.u32(&what)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::BadShape { tensor: name, reason: format!("{n_dims} dimensions (1..={MAX_DIMS} allowed)") });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&what)?);
        }
        let type_id = c.u32(&what)?;
        let offset = c.u64(&what)?;
        let ty = match GgmlType::from_id(type_id) {
            Some(t) => t,
            None => return Err(GgufError::UnknownTensorType { tensor: name, type_id }),
        };
        if !ty.is_storage_type() {
            return Err(GgufError::UnsupportedTensorType { tensor: name, ty });
        }
        let size_bytes = tensor_size(&name, ty, &dims)?;
        if offset % alignment != 0 {
            return Err(GgufError::Misaligned { tensor: name, offset, alignment });
        }
        if !seen.insert(name.clone()) {
            return Err(GgufError::DuplicateTensor(name));
        }
        tensors.push(TensorInfo { name, ty, dims, offset, size_bytes });
    }

    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let available = (bytes.len() as u64).saturating_sub(data_start);
    for t in &tensors {
        // Checked against the whole file, not just the data section's length: when the file
        // ends before its (aligned) data section, even an empty tensor starts past the end.
        let end = data_start.checked_add(t.offset).and_then(|start| start.checked_add(t.size_bytes));
        if end.is_none_or(|end| end > bytes.len() as u64) {
            return Err(GgufError::TensorOutOfBounds {
                tensor: t.name.clone(),
                offset: t.offset,
                size: t.size_bytes,
                available,
            });
        }
    }
    Ok(Header { version, alignment, metadata, tensors, data_start })
}

/// Bytes of a tensor of this type and shape, with every overflow and block mismatch caught.
fn tensor_size(name: &str, ty: GgmlType, dims: &[u64]) -> Result<u64, GgufError> {
    let bad = |reason: String| GgufError::BadShape { tensor: name.to_string(), reason };
    let block = ty.block_size() as u64;
    if !dims[0].is_multiple_of(block) {
        return Err(bad(format!("row length {} is not a multiple of the {ty} block size {block}", dims[0])));
    }
    let mut n: u64 = 1;
    for &d in dims {
        n = n.checked_mul(d).ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
    }
    (n / block)
        .checked_mul(ty.block_bytes() as u64)
        .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))
}
