//! The KV cache between processes: its bookkeeping, apart from the memory it describes — the
//! byte layout of a cpu-worker's KV arena ([`layout`]), which blocks of which worker hold
//! which sequence's tokens ([`blocks`]) and where a sequence's range lies in an arena
//! ([`paged`]) — and the shared-memory transport that carries it ([`shm`]: segments, the
//! exchange ring, attention jobs).
//!
//! All three are pure (no shared memory, no I/O, no async; [`shm`] is the one module with memory) so that every rule is asserted
//! and unit-tested on its own, as llama.cpp keeps `llama-kv-cells.h` and vLLM keeps
//! `KVCacheBlocks` apart from the tensors. The shared-memory segments and the workers use
//! these types and never recompute an offset or a slot themselves; the attention kernels
//! take the rows as slices and know nothing of them.

pub mod blocks;
mod ids;
pub mod layout;
pub mod paged;
mod prefix_cache;
pub mod shm;

pub use blocks::{BlockId, BlockTable, KvPool, Placement, TokenSlot, WorkerId};

/// Positions per page of the gpu-worker's KV mirror on the GPU (the CUDA device's): a
/// sequence's share of the mirror occupies whole pages, so the gateway counts shares in them.
pub const GPU_KV_PAGE: usize = 16;
pub use layout::{parse_kv_type, ArenaLayout, KvDtype, KvShape};

/// Everything that can go wrong in KV bookkeeping: a bad arena header or layout, or a
/// request for more blocks than a worker has free.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("KV arena header is {len} bytes, shorter than the {need} bytes of a header")]
    HeaderTruncated { len: usize, need: usize },
    #[error("not a Duet KV arena: magic is {found:02x?}, expected {expected:02x?}")]
    BadMagic { found: [u8; 8], expected: [u8; 8] },
    #[error("unsupported KV arena version {found} (this build reads version {supported})")]
    UnsupportedVersion { found: u32, supported: u32 },
    #[error("unknown KV dtype code {0} (0 = f16, 1 = bf16, 2 = f32, 3 = q8_0)")]
    UnknownDtype(u32),
    #[error("a {dtype} KV row of {head_dim} values is not whole blocks of 32")]
    RowNotWholeBlocks { dtype: KvDtype, head_dim: u32 },
    #[error("KV layout field {field} is zero")]
    ZeroDimension { field: &'static str },
    #[error("KV layout is too large: its {what} overflows the address space")]
    SizeOverflow { what: &'static str },
    #[error("KV arena header field {field} says {stored} but the layout gives {computed}")]
    HeaderMismatch { field: &'static str, stored: u64, computed: u64 },
    #[error("out of KV blocks: {wanted} wanted, {free} free")]
    OutOfBlocks { wanted: usize, free: usize },
    #[error("no KV worker {worker} (the pool has {n_workers})")]
    UnknownWorker { worker: WorkerId, n_workers: usize },
}

/// A byte count: digits with an optional binary suffix K, M, G or T (`KiB`, `MB`, ... and
/// lower case accepted).
pub fn parse_bytes(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: usize = num.parse().map_err(|_| format!("{text:?} is not a byte count"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(format!("unknown unit in {text:?} (use K, M, G or T)")),
    };
    n.checked_mul(1usize << shift).ok_or_else(|| format!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("1M"), Ok(1 << 20));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert!(parse_bytes("1Q").is_err() && parse_bytes("").is_err() && parse_bytes("M").is_err());
        assert!(parse_bytes("99999999999T").is_err());
    }
}
