//! Byte layout of one cpu-worker's KV arena: a 4096-byte header, then the runs of `n_blocks`
//! blocks.
//!
//! A block holds `block_size` tokens of every layer, so a block id names the same token
//! slots in every layer. The arena is ordered run-major: for each layer, the K runs of every
//! KV head, then the V runs, and each of those as the run of every block in block order:
//!
//! ```text
//! arena  = header (HEADER_BYTES) | layer 0 | layer 1 | ... | layer n_layer-1
//! layer  = K head 0 | ... | K head n_kv_head-1 | V head 0 | ... | V head n_kv_head-1
//! head   = run of block 0 | run of block 1 | ... | run of block n_blocks-1
//! run    = [token 0..block_size] rows of head_dim values of dtype, then padding
//! ```
//!
//! so decode attention streams each KV head's run once for its whole GQA query group, and a
//! sequence on consecutive blocks (what a fresh allocation gets) has each KV head's K and V as
//! one contiguous span each, which the hardware prefetchers follow. (Version 1 kept each
//! block's runs together; a sequence's runs then lay a whole block apart, and decode
//! attention ran 20–30 % slower.)
//! Every run is padded to a multiple of [`ALIGN`] (64) bytes, which makes every offset this
//! module returns 64-byte aligned (the header is a multiple of 64 too). Runs of real models
//! need no padding (64 tokens × 64 dims × 2 bytes = 8192); a layout such as `head_dim` 3 in
//! f16 pads each 96-byte run to 128.
//!
//! Header fields, all little-endian at fixed offsets, the rest zero:
//!
//! | offset | type | field |
//! |---|---|---|
//! | 0 | `[u8; 8]` | magic `DUETKVAR` |
//! | 8 | u32 | version (2) |
//! | 12 | u32 | header bytes (4096) |
//! | 16 | u32 | dtype (0 f16, 1 bf16, 2 f32, 3 q8_0: ggml's 34-byte blocks of 32, `head_dim / 32` per row) |
//! | 20 | u32 | n_layer |
//! | 24 | u32 | n_kv_head |
//! | 28 | u32 | head_dim |
//! | 32 | u32 | block_size |
//! | 36 | u32 | n_blocks |
//! | 40 | u64 | block bytes (derived, checked on decode) |
//! | 48 | u64 | total bytes (derived, checked on decode) |
//! | 56 | u64 | identity of the model whose K/V the arena holds (written by the cpu-worker; 0: unknown) |
//! | 64 | u64 | generation: workers that attached to the arena, 1 for its creator (written by the cpu-worker) |
//!
//! The fields are public plain data; every size is computed with checked arithmetic and
//! returns [`KvError::ZeroDimension`] or [`KvError::SizeOverflow`] for a layout that cannot
//! exist. [`ArenaLayout::validate`] once, then the offset functions cannot fail.

use super::{BlockId, KvError};

/// Magic bytes at the start of every arena.
pub const MAGIC: [u8; 8] = *b"DUETKVAR";
/// The header version this build writes and reads.
pub const VERSION: u32 = 2;
/// Size of the header; block 0 starts here.
pub const HEADER_BYTES: usize = 4096;
/// Byte offset of the header's model identity (see the table above; not part of the layout).
pub const OFF_MODEL_ID: usize = 56;
/// Byte offset of the header's generation counter (see the table above).
pub const OFF_GENERATION: usize = 64;
/// Alignment of every head run, block and offset, in bytes.
pub const ALIGN: usize = 64;
/// Tokens per block unless configured otherwise. A block's run of one layer and KV head is
/// `block_size` rows in a row, and the runs of a sequence's next block lie a whole block
/// further: at 16 tokens (2 KiB runs of the default model, a new page every 16 positions)
/// decode attention at depth 4096 ran at 108 tok/s, at 64 tokens at 136–140, at 256 at
/// 138–143 (`duet bench --context 4096 --policies gpu`, 2 threads).
pub const DEFAULT_BLOCK_SIZE: u32 = 64;

/// Element type of the cached K and V values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum KvDtype {
    #[default]
    F16,
    BF16,
    F32,
    /// ggml's Q8_0 blocks (an f16 scale and 32 signed bytes): 34 bytes per 32 values, as
    /// llama.cpp's `-ctk q8_0 -ctv q8_0`. Heads must be a multiple of 32 values.
    Q8_0,
}

impl KvDtype {
    /// Bytes of one row of `head_dim` values; `None` for Q8_0 rows that are not whole blocks.
    pub fn row_bytes(self, head_dim: usize) -> Option<usize> {
        match self {
            KvDtype::F16 | KvDtype::BF16 => head_dim.checked_mul(2),
            KvDtype::F32 => head_dim.checked_mul(4),
            KvDtype::Q8_0 => head_dim.is_multiple_of(32).then_some(head_dim / 32 * 34),
        }
    }

    fn code(self) -> u32 {
        match self {
            KvDtype::F16 => 0,
            KvDtype::BF16 => 1,
            KvDtype::F32 => 2,
            KvDtype::Q8_0 => 3,
        }
    }

    fn from_code(code: u32) -> Result<Self, KvError> {
        match code {
            0 => Ok(KvDtype::F16),
            1 => Ok(KvDtype::BF16),
            2 => Ok(KvDtype::F32),
            3 => Ok(KvDtype::Q8_0),
            _ => Err(KvError::UnknownDtype(code)),
        }
    }

    /// Whether Duet's attention reads this type (f16 and q8_0; bf16 and f32 arenas are only
    /// described).
    pub fn attended(self) -> bool {
        matches!(self, KvDtype::F16 | KvDtype::Q8_0)
    }
}

/// A `--kv-type` flag's value: a type attention reads (`f16`, `q8_0`).
pub fn parse_kv_type(s: &str) -> Result<KvDtype, String> {
    let t: KvDtype = s.parse()?;
    if t.attended() {
        Ok(t)
    } else {
        Err(format!("{t} KV is not supported (f16 or q8_0)"))
    }
}

/// The names the flags take: `f16`, `q8_0` (and `bf16`, `f32`).
impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(KvDtype::F16),
            "q8_0" => Ok(KvDtype::Q8_0),
            "bf16" => Ok(KvDtype::BF16),
            "f32" => Ok(KvDtype::F32),
            _ => Err(format!("unknown KV cache type {s:?} (f16 or q8_0)")),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F16 => "f16",
            KvDtype::BF16 => "bf16",
            KvDtype::F32 => "f32",
            KvDtype::Q8_0 => "q8_0",
        })
    }
}

/// The KV shape of a model — layers, KV heads and their dimension — defined once here: an
/// arena's layout must have it, and every process derives it from the model
/// (`LlamaConfig::kv_shape`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvShape {
    pub n_layer: u32,
    pub n_kv_head: u32,
    pub head_dim: u32,
}

/// The shape of one cpu-worker's KV arena (see the module documentation for the bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ArenaLayout {
    pub n_layer: u32,
    pub n_kv_head: u32,
    pub head_dim: u32,
    /// Tokens per block ([`DEFAULT_BLOCK_SIZE`] unless configured otherwise).
    pub block_size: u32,
    pub dtype: KvDtype,
    pub n_blocks: u32,
}

// Byte offsets of the header fields.
const OFF_VERSION: usize = 8;
const OFF_HEADER_BYTES: usize = 12;
const OFF_DTYPE: usize = 16;
const OFF_N_LAYER: usize = 20;
const OFF_N_KV_HEAD: usize = 24;
const OFF_HEAD_DIM: usize = 28;
const OFF_BLOCK_SIZE: usize = 32;
const OFF_N_BLOCKS: usize = 36;
const OFF_BLOCK_BYTES: usize = 40;
const OFF_TOTAL_BYTES: usize = 48;

impl ArenaLayout {
    /// The model KV shape this arena holds.
    pub fn kv_shape(&self) -> KvShape {
        KvShape { n_layer: self.n_layer, n_kv_head: self.n_kv_head, head_dim: self.head_dim }
    }

    /// Bytes before block 0.
    pub fn header_bytes(&self) -> usize {
        HEADER_BYTES
    }

    /// Bytes of one head's `[token][head_dim]` run, padded to [`ALIGN`].
    pub fn head_run_bytes(&self) -> Result<usize, KvError> {
        for (field, value) in [
            ("n_layer", self.n_layer),
            ("n_kv_head", self.n_kv_head),
            ("head_dim", self.head_dim),
            ("block_size", self.block_size),
        ] {
            if value == 0 {
                return Err(KvError::ZeroDimension { field });
            }
        }
        (self.block_size as usize)
            .checked_mul(self.row_bytes()?)
            .and_then(|n| n.checked_next_multiple_of(ALIGN))
            .ok_or(KvError::SizeOverflow { what: "head run" })
    }

    /// Bytes of one token's row of one KV head (`head_dim` values of `dtype`).
    pub fn row_bytes(&self) -> Result<usize, KvError> {
        self.dtype.row_bytes(self.head_dim as usize).ok_or(KvError::RowNotWholeBlocks { dtype: self.dtype, head_dim: self.head_dim })
    }

    /// Bytes of one block: every layer's K and V runs of `block_size` tokens (spread over
    /// the arena, one run per layer, K/V and KV head).
    pub fn block_bytes(&self) -> Result<usize, KvError> {
        self.head_run_bytes()?
            .checked_mul(2)
            .and_then(|n| n.checked_mul(self.n_kv_head as usize))
            .and_then(|n| n.checked_mul(self.n_layer as usize))
            .ok_or(KvError::SizeOverflow { what: "block" })
    }

    /// Bytes of the whole arena, header included.
    pub fn total_bytes(&self) -> Result<usize, KvError> {
        let block = self.block_bytes()?;
        if self.n_blocks == 0 {
            return Err(KvError::ZeroDimension { field: "n_blocks" });
        }
        block
            .checked_mul(self.n_blocks as usize)
            .and_then(|n| n.checked_add(HEADER_BYTES))
            .ok_or(KvError::SizeOverflow { what: "arena" })
    }

    /// Checks that no field is zero and that the arena's size fits in `usize`.
    pub fn validate(&self) -> Result<(), KvError> {
        self.total_bytes().map(drop)
    }

    /// Byte offset, from the start of the arena, of the K run of `kv_head` in `layer` of
    /// `block`. Panics if an index is out of range or the layout does not validate.
    pub fn k_offset(&self, block: BlockId, layer: u32, kv_head: u32) -> usize {
        self.run_offset(block, layer, kv_head, false)
    }

    /// Byte offset of the V run; as [`k_offset`](Self::k_offset).
    pub fn v_offset(&self, block: BlockId, layer: u32, kv_head: u32) -> usize {
        self.run_offset(block, layer, kv_head, true)
    }

    /// Where slot `slot` of `block` lies in every run, for a device that computes the
    /// addresses itself (the CUDA device's in-place K/V writes): its byte offset in the first
    /// run (layer 0, K, KV head 0) and the stride between runs, which follow each other in
    /// `[layer][K, V][kv_head]` order — the K row of `kv_head` in `layer` at `offset +
    /// (layer · 2 · n_kv_head + kv_head) · stride`, its V row `n_kv_head` strides further.
    /// Panics if an index is out of range or the layout does not validate.
    pub fn slot_runs(&self, block: BlockId, slot: usize) -> (usize, usize) {
        assert!(slot < self.block_size as usize, "slot {slot} of {}", self.block_size);
        let run = self.head_run_bytes().expect("KV layout does not validate");
        (self.k_offset(block, 0, 0) + slot * self.row_bytes().expect("a validated layout"), self.n_blocks as usize * run)
    }

    fn run_offset(&self, block: BlockId, layer: u32, kv_head: u32, is_v: bool) -> usize {
        assert!(block.0 < self.n_blocks, "block {block} of {}", self.n_blocks);
        assert!(layer < self.n_layer, "layer {layer} of {}", self.n_layer);
        assert!(kv_head < self.n_kv_head, "kv head {kv_head} of {}", self.n_kv_head);
        let run = self.head_run_bytes().expect("KV layout does not validate");
        let n_kv_head = self.n_kv_head as usize;
        let head = kv_head as usize + if is_v { n_kv_head } else { 0 };
        // Runs ordered [layer][K, V][kv_head][block]: a (layer, KV head)'s consecutive blocks
        // are adjacent, so a sequence on consecutive blocks streams its K (and its V) as one
        // span, which the hardware prefetchers follow (block-major runs a block apart made
        // decode attention 20–30 % slower). Below total_bytes(), which fits: no overflow once
        // the indices are in range.
        HEADER_BYTES + ((layer as usize * 2 * n_kv_head + head) * self.n_blocks as usize + block.0 as usize) * run
    }

    /// How many blocks of this shape fit, with the header, in `budget` bytes (`n_blocks` is
    /// ignored); at most `u32::MAX`.
    pub fn n_blocks_for_bytes(&self, budget: usize) -> Result<u32, KvError> {
        let block = self.block_bytes()?;
        let n = budget.saturating_sub(HEADER_BYTES) / block;
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// The arena header describing this layout. Fails if the layout does not validate.
    pub fn encode_header(&self) -> Result<[u8; HEADER_BYTES], KvError> {
        let block_bytes = self.block_bytes()?;
        let total_bytes = self.total_bytes()?;
        let mut h = [0u8; HEADER_BYTES];
        h[..8].copy_from_slice(&MAGIC);
        let u32s = [
            (OFF_VERSION, VERSION),
            (OFF_HEADER_BYTES, HEADER_BYTES as u32),
            (OFF_DTYPE, self.dtype.code()),
            (OFF_N_LAYER, self.n_layer),
            (OFF_N_KV_HEAD, self.n_kv_head),
            (OFF_HEAD_DIM, self.head_dim),
            (OFF_BLOCK_SIZE, self.block_size),
            (OFF_N_BLOCKS, self.n_blocks),
        ];
        for (off, v) in u32s {
            h[off..off + 4].copy_from_slice(&v.to_le_bytes());
        }
        h[OFF_BLOCK_BYTES..OFF_BLOCK_BYTES + 8]
            .copy_from_slice(&(block_bytes as u64).to_le_bytes());
        h[OFF_TOTAL_BYTES..OFF_TOTAL_BYTES + 8]
            .copy_from_slice(&(total_bytes as u64).to_le_bytes());
        Ok(h)
    }

    /// Reads a header written by [`encode_header`](Self::encode_header) from the start of
    /// `bytes` (an arena or just its header), checking magic, version, every field and the
    /// stored sizes against the ones this build computes.
    pub fn decode_header(bytes: &[u8]) -> Result<ArenaLayout, KvError> {
        if bytes.len() < HEADER_BYTES {
            return Err(KvError::HeaderTruncated { len: bytes.len(), need: HEADER_BYTES });
        }
        let u32_at = |off: usize| u32::from_le_bytes(bytes[off..off + 4].try_into().unwrap());
        let u64_at = |off: usize| u64::from_le_bytes(bytes[off..off + 8].try_into().unwrap());
        let found: [u8; 8] = bytes[..8].try_into().unwrap();
        if found != MAGIC {
            return Err(KvError::BadMagic { found, expected: MAGIC });
        }
        let version = u32_at(OFF_VERSION);
        if version != VERSION {
            return Err(KvError::UnsupportedVersion { found: version, supported: VERSION });
        }
        let header_bytes = u32_at(OFF_HEADER_BYTES);
        if header_bytes as usize != HEADER_BYTES {
            return Err(KvError::HeaderMismatch {
                field: "header_bytes",
                stored: header_bytes.into(),
                computed: HEADER_BYTES as u64,
            });
        }
        let layout = ArenaLayout {
            n_layer: u32_at(OFF_N_LAYER),
            n_kv_head: u32_at(OFF_N_KV_HEAD),
            head_dim: u32_at(OFF_HEAD_DIM),
            block_size: u32_at(OFF_BLOCK_SIZE),
            dtype: KvDtype::from_code(u32_at(OFF_DTYPE))?,
            n_blocks: u32_at(OFF_N_BLOCKS),
        };
        for (field, off, computed) in [
            ("block_bytes", OFF_BLOCK_BYTES, layout.block_bytes()?),
            ("total_bytes", OFF_TOTAL_BYTES, layout.total_bytes()?),
        ] {
            let stored = u64_at(off);
            if stored != computed as u64 {
                return Err(KvError::HeaderMismatch { field, stored, computed: computed as u64 });
            }
        }
        Ok(layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(
        n_layer: u32,
        n_kv_head: u32,
        head_dim: u32,
        block_size: u32,
        dtype: KvDtype,
        n_blocks: u32,
    ) -> ArenaLayout {
        ArenaLayout { n_layer, n_kv_head, head_dim, block_size, dtype, n_blocks }
    }

    /// SmolLM2-135M: 30 layers, 3 KV heads of 64, blocks of 16 tokens.
    fn smollm2(n_blocks: u32) -> ArenaLayout {
        layout(30, 3, 64, 16, KvDtype::F16, n_blocks)
    }

    #[test]
    fn dtype_sizes_and_default() {
        assert_eq!(KvDtype::default(), KvDtype::F16);
        assert_eq!([KvDtype::F16, KvDtype::BF16, KvDtype::F32, KvDtype::Q8_0].map(|t| t.row_bytes(64)), [Some(128), Some(128), Some(256), Some(68)]);
        assert_eq!(KvDtype::Q8_0.row_bytes(48), None, "Q8_0 rows are whole blocks of 32");
        for t in [KvDtype::F16, KvDtype::BF16, KvDtype::F32, KvDtype::Q8_0] {
            assert_eq!(KvDtype::from_code(t.code()), Ok(t));
            assert_eq!(t.to_string().parse::<KvDtype>(), Ok(t));
        }
        assert_eq!(parse_kv_type("Q8_0"), Ok(KvDtype::Q8_0));
        assert!(parse_kv_type("f32").is_err() && parse_kv_type("q4_0").is_err());
    }

    #[test]
    fn q8_0_arena_sizes() {
        // SmolLM2's shape, 64-token blocks: a run is 64 rows of two 34-byte blocks.
        let l = layout(30, 3, 64, 64, KvDtype::Q8_0, 10);
        assert_eq!(l.row_bytes(), Ok(68));
        assert_eq!(l.head_run_bytes(), Ok(64 * 68));
        assert_eq!(l.block_bytes(), Ok(30 * 2 * 3 * 64 * 68));
        let header = ArenaLayout::decode_header(&l.encode_header().unwrap()).unwrap();
        assert_eq!(header, l);
        assert_eq!(
            layout(2, 1, 48, 16, KvDtype::Q8_0, 1).validate(),
            Err(KvError::RowNotWholeBlocks { dtype: KvDtype::Q8_0, head_dim: 48 })
        );
    }

    #[test]
    fn sizes_of_a_real_model() {
        let l = smollm2(100);
        assert_eq!(l.head_run_bytes(), Ok(16 * 64 * 2));
        assert_eq!(l.block_bytes(), Ok(30 * 2 * 3 * 2048));
        assert_eq!(l.total_bytes(), Ok(4096 + 100 * 368_640));
        // [layer][K, V][kv_head][block] runs of 2048 bytes, 100 blocks.
        assert_eq!(l.k_offset(BlockId(0), 0, 0), 4096);
        assert_eq!(l.k_offset(BlockId(1), 0, 0), 4096 + 2048);
        assert_eq!(l.k_offset(BlockId(0), 0, 1), 4096 + 100 * 2048);
        assert_eq!(l.v_offset(BlockId(0), 0, 0), 4096 + 3 * 100 * 2048);
        assert_eq!(l.k_offset(BlockId(0), 1, 0), 4096 + 6 * 100 * 2048);
        assert_eq!(l.k_offset(BlockId(2), 0, 0), 4096 + 2 * 2048);
        assert_eq!(l.v_offset(BlockId(99), 29, 2) + 2048, l.total_bytes().unwrap());
    }

    #[test]
    fn runs_are_padded_to_the_alignment() {
        // 5 tokens x 3 dims x 2 bytes = 30 bytes, padded to 64.
        let l = layout(2, 2, 3, 5, KvDtype::BF16, 4);
        assert_eq!(l.head_run_bytes(), Ok(64));
        assert_eq!(l.block_bytes(), Ok(2 * 2 * 2 * 64));
    }

    /// Every (block, layer, head, K/V) run lies inside the arena after the header, is
    /// 64-byte aligned and overlaps no other run.
    #[test]
    fn offsets_are_aligned_disjoint_and_inside_the_arena() {
        let layouts = [
            layout(1, 1, 1, 1, KvDtype::F16, 1),
            layout(3, 2, 8, 4, KvDtype::F16, 5),
            layout(2, 3, 3, 5, KvDtype::BF16, 7),
            layout(4, 1, 17, 16, KvDtype::F32, 3),
            layout(2, 4, 64, 16, KvDtype::F16, 6),
            layout(5, 2, 7, 3, KvDtype::F32, 4),
        ];
        for l in layouts {
            l.validate().unwrap();
            let total = l.total_bytes().unwrap();
            let run = l.head_run_bytes().unwrap();
            let payload = l.block_size as usize * l.row_bytes().unwrap();
            assert!(run >= payload && run % ALIGN == 0, "{l:?}");
            let mut runs = Vec::new();
            let row = l.row_bytes().unwrap();
            for b in 0..l.n_blocks {
                let slot = b as usize % l.block_size as usize;
                let (first, stride) = l.slot_runs(BlockId(b), slot);
                for layer in 0..l.n_layer {
                    for h in 0..l.n_kv_head {
                        runs.push(l.k_offset(BlockId(b), layer, h));
                        runs.push(l.v_offset(BlockId(b), layer, h));
                        // A slot's rows found from the first run and the stride are the runs'.
                        let k = first + (layer * 2 * l.n_kv_head + h) as usize * stride;
                        assert_eq!(k, l.k_offset(BlockId(b), layer, h) + slot * row, "{l:?}");
                        assert_eq!(k + l.n_kv_head as usize * stride, l.v_offset(BlockId(b), layer, h) + slot * row, "{l:?}");
                    }
                }
            }
            let n = runs.len();
            assert_eq!(n, 2 * (l.n_blocks * l.n_layer * l.n_kv_head) as usize);
            runs.sort_unstable();
            runs.dedup();
            assert_eq!(runs.len(), n, "two runs share an offset in {l:?}");
            assert!(runs[0] >= l.header_bytes());
            assert!(runs.iter().all(|off| off % ALIGN == 0), "{l:?}");
            assert!(runs.windows(2).all(|w| w[0] + run <= w[1]), "runs overlap in {l:?}");
            assert!(runs[n - 1] + run <= total, "{l:?}");
            // Without padding the runs tile the blocks exactly.
            if run == payload {
                assert_eq!(total, l.header_bytes() + n * run);
            }
        }
    }

    #[test]
    #[should_panic(expected = "block 3 of 3")]
    fn offset_of_a_block_past_the_end_panics() {
        layout(1, 1, 8, 16, KvDtype::F16, 3).k_offset(BlockId(3), 0, 0);
    }

    #[test]
    #[should_panic(expected = "kv head 2 of 2")]
    fn offset_of_a_head_past_the_end_panics() {
        layout(1, 2, 8, 16, KvDtype::F16, 3).v_offset(BlockId(0), 0, 2);
    }

    #[test]
    fn zero_fields_and_overflow_are_refused() {
        let good = smollm2(10);
        for (field, bad) in [
            ("n_layer", ArenaLayout { n_layer: 0, ..good }),
            ("n_kv_head", ArenaLayout { n_kv_head: 0, ..good }),
            ("head_dim", ArenaLayout { head_dim: 0, ..good }),
            ("block_size", ArenaLayout { block_size: 0, ..good }),
            ("n_blocks", ArenaLayout { n_blocks: 0, ..good }),
        ] {
            assert_eq!(bad.validate(), Err(KvError::ZeroDimension { field }));
            assert_eq!(bad.encode_header(), Err(KvError::ZeroDimension { field }));
        }
        let huge =
            ArenaLayout { n_layer: u32::MAX, n_kv_head: u32::MAX, n_blocks: u32::MAX, ..good };
        assert_eq!(huge.block_bytes(), Err(KvError::SizeOverflow { what: "block" }));
        let many = ArenaLayout { n_layer: 1 << 20, n_blocks: u32::MAX, ..good };
        assert!(many.block_bytes().is_ok());
        assert_eq!(many.total_bytes(), Err(KvError::SizeOverflow { what: "arena" }));
    }

    #[test]
    fn blocks_for_a_byte_budget() {
        let l = smollm2(0);
        let block = l.block_bytes().unwrap();
        assert_eq!(l.n_blocks_for_bytes(0), Ok(0));
        assert_eq!(l.n_blocks_for_bytes(HEADER_BYTES + block - 1), Ok(0));
        assert_eq!(l.n_blocks_for_bytes(HEADER_BYTES + block), Ok(1));
        let budget = 1 << 30;
        let n = l.n_blocks_for_bytes(budget).unwrap();
        let fit = ArenaLayout { n_blocks: n, ..l };
        assert!(fit.total_bytes().unwrap() <= budget);
        assert!(ArenaLayout { n_blocks: n + 1, ..l }.total_bytes().unwrap() > budget);
        let tiny = layout(1, 1, 1, 1, KvDtype::F16, 0);
        assert_eq!(tiny.n_blocks_for_bytes(usize::MAX), Ok(u32::MAX));
        assert_eq!(
            ArenaLayout { head_dim: 0, ..l }.n_blocks_for_bytes(budget),
            Err(KvError::ZeroDimension { field: "head_dim" })
        );
    }

    #[test]
    fn header_round_trip() {
        for l in [
            smollm2(1234),
            layout(2, 3, 3, 5, KvDtype::BF16, 7),
            layout(4, 1, 17, 16, KvDtype::F32, 3),
        ] {
            let h = l.encode_header().unwrap();
            assert_eq!(&h[..8], b"DUETKVAR");
            assert!(h[56..].iter().all(|&b| b == 0));
            assert_eq!(ArenaLayout::decode_header(&h), Ok(l));
            // A whole arena decodes too: only the first HEADER_BYTES are read.
            let mut arena = h.to_vec();
            arena.extend_from_slice(&[0xAB; 100]);
            assert_eq!(ArenaLayout::decode_header(&arena), Ok(l));
        }
    }

    /// A valid header with `value` written at `off`.
    fn patched(off: usize, value: &[u8]) -> [u8; HEADER_BYTES] {
        let mut h = smollm2(10).encode_header().unwrap();
        h[off..off + value.len()].copy_from_slice(value);
        h
    }

    #[test]
    fn every_bad_header_gives_its_error() {
        let decode = |h: &[u8]| ArenaLayout::decode_header(h).unwrap_err();
        let good = smollm2(10).encode_header().unwrap();
        assert_eq!(
            decode(&good[..HEADER_BYTES - 1]),
            KvError::HeaderTruncated { len: HEADER_BYTES - 1, need: HEADER_BYTES }
        );
        assert_eq!(decode(&[]), KvError::HeaderTruncated { len: 0, need: HEADER_BYTES });
        assert_eq!(
            decode(&patched(0, b"GGUF")),
            KvError::BadMagic { found: *b"GGUFKVAR", expected: MAGIC }
        );
        assert_eq!(
            decode(&[0; HEADER_BYTES]),
            KvError::BadMagic { found: [0; 8], expected: MAGIC }
        );
        assert_eq!(
            decode(&patched(OFF_VERSION, &1u32.to_le_bytes())),
            KvError::UnsupportedVersion { found: 1, supported: 2 }
        );
        assert_eq!(
            decode(&patched(OFF_VERSION, &0u32.to_le_bytes())),
            KvError::UnsupportedVersion { found: 0, supported: 2 }
        );
        assert_eq!(
            decode(&patched(OFF_HEADER_BYTES, &8192u32.to_le_bytes())),
            KvError::HeaderMismatch { field: "header_bytes", stored: 8192, computed: 4096 }
        );
        assert_eq!(decode(&patched(OFF_DTYPE, &4u32.to_le_bytes())), KvError::UnknownDtype(4));
        for (field, off) in [
            ("n_layer", OFF_N_LAYER),
            ("n_kv_head", OFF_N_KV_HEAD),
            ("head_dim", OFF_HEAD_DIM),
            ("block_size", OFF_BLOCK_SIZE),
            ("n_blocks", OFF_N_BLOCKS),
        ] {
            assert_eq!(
                decode(&patched(off, &0u32.to_le_bytes())),
                KvError::ZeroDimension { field }
            );
        }
        let mut huge = patched(OFF_N_LAYER, &u32::MAX.to_le_bytes());
        huge[OFF_N_KV_HEAD..OFF_N_KV_HEAD + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&huge), KvError::SizeOverflow { what: "block" });
        let mut many = patched(OFF_N_LAYER, &(1u32 << 20).to_le_bytes());
        many[OFF_N_BLOCKS..OFF_N_BLOCKS + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&many), KvError::SizeOverflow { what: "arena" });
        // A field changed without its derived sizes: the stored sizes no longer agree.
        let block = smollm2(10).block_bytes().unwrap() as u64;
        assert_eq!(
            decode(&patched(OFF_HEAD_DIM, &128u32.to_le_bytes())),
            KvError::HeaderMismatch { field: "block_bytes", stored: block, computed: 2 * block }
        );
        assert_eq!(
            decode(&patched(OFF_N_BLOCKS, &11u32.to_le_bytes())),
            KvError::HeaderMismatch {
                field: "total_bytes",
                stored: 4096 + 10 * block,
                computed: 4096 + 11 * block
            }
        );
        assert_eq!(
            decode(&patched(OFF_BLOCK_BYTES, &1u64.to_le_bytes())),
            KvError::HeaderMismatch { field: "block_bytes", stored: 1, computed: block }
        );
    }
}
