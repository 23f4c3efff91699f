#!/usr/bin/env python3
# Generates testdata/quant/: a GGUF of every weight type Duet loads, and gguf-py's dequantisation of it.
"""Fixtures for `model/tests/dequant_vs_gguf_py.rs`.

Writes, deterministically (fixed seed), into `testdata/quant/`:

* `quant_fixtures.gguf`  -- written with `gguf.GGUFWriter`: for each of F32, F16, BF16, Q8_0,
  Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K a few tensors of odd shapes (1-D, 2-D, 3-D; odd
  block counts per row, 3..7 rows). Where gguf-py can quantise the type, one tensor is
  `gguf.quants.quantize(random data)`; every type also gets tensors of random *valid raw block
  bytes* (gguf-py 0.19 cannot quantise Q4_K/Q5_K/Q6_K, and random bytes reach bit patterns a
  quantiser never writes: all qh bits, all 6-bit scales, negative d). The f16 scale fields of
  raw blocks are random finite f16 (subnormals, zero, 65504 and negative values included).
* `quant_expected.bin`   -- `gguf.quants.dequantize(bytes, type)` of every tensor, as
  little-endian f32, tensors one after another in file order.
* `quant_expected.json`  -- the index: for each tensor its name, type, ggml dims (dims[0] is
  the row), source (quantize/raw), and the byte offset/length of its values in the .bin.

Usage: `python3 scripts/gen_quant_fixtures.py` (needs `pip install gguf numpy`).

gguf-py's formulas against ggml's reference C (`ggml-quants.c`, `dequantize_row_*`), checked in
gguf 0.19 `gguf/quants.py`; every step is a separate IEEE f32 operation in both (numpy never
fuses a multiply-add), so the results are the same bits:

* F32: a view of the bytes. F16: `view(float16).astype(float32)`, exact like ggml's
  `GGML_FP16_TO_FP32`, except for *signalling* NaNs: numpy keeps them signalling, ggml's
  conversions (F16C, or the float multiply of `ggml_compute_fp16_to_fp32`) quieten them. No
  formula is involved and no model holds one, so F16 fixtures avoid signalling NaNs (quiet NaNs,
  infinities and subnormals are included).
* BF16: `int16 << 16` viewed as f32, exactly ggml's `GGML_BF16_TO_FP32` (a shift: even a
  signalling NaN keeps its bits). The fixtures include signalling NaNs on purpose.
* Q4_0 / Q5_0: `d * (q - 8|16)`   == ggml `y = x0*d` (x0 the signed int, d the f16 scale as f32).
* Q8_0:        `q * d`            == ggml `y = x[i].qs[j]*d`.
* Q4_1 / Q5_1: `(d * q) + m`      == ggml `y = x0*d + m` (a product then a sum, not an fma).
* Q4_K / Q5_K: `(d * sc) * q - (dmin * m)` with `sc`, `m` from the same 6-bit unpacking as
  `get_scale_min_k4`; ggml: `d1 = d * sc; m1 = min * m; y = d1 * q - m1`. Q5_K's fifth bit is
  `qh[l] >> j & 1` for sub-block j, ggml's `qh[l] & u1` with `u1 = 1 << j`.
* Q6_K: `(d * scale) * (q - 32)`  == ggml `y = d * sc[is] * q1` (evaluated left to right).

For the k-quants most of these steps cannot round at all: an f16 scale has 11 significant bits,
`sc` at most 7 (|sc| <= 128) and `q` at most 5 (|q| <= 32), so `d * sc` and then `* q` stay within
f32's 24; only the final `- m1` of Q4_K/Q5_K rounds. For the 32-element types `d * q` is exact
and only `+ m` rounds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

SEED = 20240917
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "testdata" / "quant"

# Byte offsets of the f16 fields inside one block (ggml's block_* structs).
F16_FIELDS = {
    T.Q4_0: [0],          # d
    T.Q4_1: [0, 2],       # d, m
    T.Q5_0: [0],          # d
    T.Q5_1: [0, 2],       # d, m
    T.Q8_0: [0],          # d
    T.Q4_K: [0, 2],       # d, dmin
    T.Q5_K: [0, 2],       # d, dmin
    T.Q6_K: [208],        # d (after ql[128], qh[64], scales[16])
}

QUANTIZABLE = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]
K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]


def random_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random finite f16 values as uint16 bits: magnitudes 2^-24 (subnormal) .. 2^6, both signs,
    plus a sprinkling of the extremes (0, -0, smallest subnormal, 65504)."""
    exp = rng.uniform(-24.0, 6.0, size=n)
    val = (np.exp2(exp) * rng.choice([-1.0, 1.0], size=n)).astype(np.float16)
    special = np.array([0.0, -0.0, 2.0**-24, 65504.0, -65504.0, 1.0], dtype=np.float16)
    pick = rng.random(n) < 0.06
    val[pick] = rng.choice(special, size=int(pick.sum()))
    assert np.isfinite(val).all()
    return val.view(np.uint16)


def random_blocks(rng: np.random.Generator, qtype: T, n_blocks: int) -> np.ndarray:
    """Random valid blocks of `qtype`: random bytes with finite random f16 scale fields; block 1
    (when there is one) is all zeros and block 2 has sane small-magnitude scales."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        blocks[:, off:off + 2] = random_f16_bits(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    if n_blocks > 1:
        blocks[1, :] = 0
    if n_blocks > 2:
        for off in F16_FIELDS[qtype]:
            blocks[2, off:off + 2] = np.array([rng.uniform(-0.05, 0.05)], dtype=np.float16).view(np.uint8)
    return blocks


def random_data(rng: np.random.Generator, shape: tuple[int, ...], block: int) -> np.ndarray:
    """f32 data with a different magnitude per block (1e-7 .. 2e4), negatives, an all-zero
    block, a block with one huge outlier, and exact ties for the quantisers' rounding."""
    x = rng.standard_normal(size=shape).astype(np.float32)
    flat = x.reshape(-1, block)
    scales = np.float32(10.0) ** rng.uniform(-7.0, 4.3, size=(flat.shape[0], 1)).astype(np.float32)
    flat *= scales
    flat[0, :] = 0.0
    if flat.shape[0] > 1:
        flat[1, :] = -np.abs(flat[1, :])                      # all negative
    if flat.shape[0] > 2:
        flat[2, 5] = np.float32(3.0e4)                        # outlier
    if flat.shape[0] > 3:
        flat[3, :] = np.arange(block, dtype=np.float32) - block / 2  # small integers: ties
    return np.clip(flat, -6.0e4, 6.0e4).reshape(shape)


def float_specials(dtype) -> np.ndarray:
    v = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 65504.0, 6.0e-8, -6.0e-8, 1.0e-5, 3.14159]
    return np.array(v, dtype=dtype)


def bf16_bits_from_f32(x: np.ndarray) -> np.ndarray:
    return gguf.quants.quantize(x.astype(np.float32), T.BF16).view(np.uint16)


def build(rng: np.random.Generator) -> list[tuple[str, T, str, np.ndarray]]:
    """(name, type, source, bytes shaped (..., row_bytes) as uint8) for every fixture tensor."""
    out: list[tuple[str, T, str, np.ndarray]] = []

    # --- F32: quantize() is the identity; specials include a signalling NaN (bits kept).
    x = random_data(rng, (5, 33), 33)
    x.reshape(-1)[:12] = float_specials(np.float32)
    x.view(np.uint32).reshape(-1)[12] = 0x7F800001       # signalling NaN
    x.view(np.uint32).reshape(-1)[13] = 0xFFC12345       # negative quiet NaN with payload
    x.view(np.uint32).reshape(-1)[14] = 0x00000001       # smallest subnormal
    out.append(("f32.quant_2d", T.F32, "quantize", gguf.quants.quantize(x, T.F32).view(np.uint8)))
    out.append(("f32.raw_3d", T.F32, "raw",
                rng.standard_normal(size=(3, 2, 7)).astype(np.float32).view(np.uint8)))
    out.append(("f32.raw_1d", T.F32, "raw", (rng.standard_normal(37) * 1e3).astype(np.float32).view(np.uint8)))

    # --- F16: quantize() is astype(float16); raw random bits with signalling NaNs made quiet.
    x = random_data(rng, (7, 17), 17)
    x.reshape(-1)[:12] = float_specials(np.float32)
    out.append(("f16.quant_2d", T.F16, "quantize", gguf.quants.quantize(x, T.F16).view(np.uint8)))
    bits = rng.integers(0, 1 << 16, size=(3, 5, 9), dtype=np.uint16)
    snan = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x03FF) != 0) & ((bits & 0x0200) == 0)
    bits[snan] |= 0x0200
    bits.reshape(-1)[:4] = [0x7C00, 0xFC00, 0x7E00, 0x0001]
    out.append(("f16.raw_3d", T.F16, "raw", bits.view(np.uint8)))

    # --- BF16: gguf-py's quantizer (round to nearest even, NaN made quiet) and raw random bits
    # (signalling NaNs included: ggml's bf16 -> f32 is a plain shift).
    x = random_data(rng, (5, 31), 31)
    x.reshape(-1)[:12] = float_specials(np.float32)
    out.append(("bf16.quant_2d", T.BF16, "quantize", bf16_bits_from_f32(x).view(np.uint8)))
    bits = rng.integers(0, 1 << 16, size=(2, 3, 11), dtype=np.uint16)
    bits.reshape(-1)[:6] = [0x7F81, 0xFF81, 0x7FC0, 0x7F80, 0xFF80, 0x0001]
    out.append(("bf16.raw_3d", T.BF16, "raw", bits.view(np.uint8)))

    # --- The 32-element types: one quantised tensor of each, and random raw blocks.
    for qt in QUANTIZABLE:
        name = qt.name.lower()
        x = random_data(rng, (5, 32 * 3), 32)
        q = gguf.quants.quantize(x, qt)
        assert q.dtype == np.uint8
        out.append((f"{name}.quant_2d", qt, "quantize", q))
        x = random_data(rng, (3, 2, 32 * 7), 32)
        out.append((f"{name}.quant_3d", qt, "quantize", gguf.quants.quantize(x, qt)))
        _, ts = GGML_QUANT_SIZES[qt]
        out.append((f"{name}.raw_2d", qt, "raw", random_blocks(rng, qt, 7 * 5).reshape(7, 5 * ts)))

    # --- k-quants: gguf-py 0.19 has no quantize for them, so random raw blocks only.
    for qt in K_QUANTS:
        name = qt.name.lower()
        _, ts = GGML_QUANT_SIZES[qt]
        try:
            gguf.quants.quantize(np.zeros((1, 256), dtype=np.float32), qt)
            print(f"note: gguf-py can now quantize {qt.name}; consider adding a quantised tensor", file=sys.stderr)
        except NotImplementedError:
            pass
        out.append((f"{name}.raw_2d", qt, "raw", random_blocks(rng, qt, 5 * 3).reshape(5, 3 * ts)))
        out.append((f"{name}.raw_3d", qt, "raw", random_blocks(rng, qt, 3 * 7).reshape(3, 7, ts)))
        out.append((f"{name}.raw_1d", qt, "raw", random_blocks(rng, qt, 5).reshape(5 * ts)))
    return out


def ggml_dims(qtype: T, raw: np.ndarray) -> list[int]:
    """ggml order (dims[0] the row in elements) of a (..., row_bytes) byte array."""
    block, ts = GGML_QUANT_SIZES[qtype]
    shape = list(raw.shape)
    shape[-1] = shape[-1] // ts * block
    return shape[::-1]


def main() -> None:
    rng = np.random.default_rng(SEED)
    tensors = build(rng)
    OUT.mkdir(parents=True, exist_ok=True)
    gguf_path = OUT / "quant_fixtures.gguf"

    w = gguf.GGUFWriter(gguf_path, arch="duet-quant-fixtures")
    w.add_uint32("duet.fixtures.seed", SEED)
    for name, qt, _, raw in tensors:
        w.add_tensor(name, np.ascontiguousarray(raw, dtype=np.uint8), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # Read the file back with gguf-py's own reader: the stored bytes are what we dequantise.
    reader = gguf.GGUFReader(gguf_path)
    stored = {t.name: t for t in reader.tensors}

    index = []
    blob = bytearray()
    types_seen = set()
    for name, qt, source, raw in tensors:
        t = stored[name]
        assert t.tensor_type == qt, (name, t.tensor_type, qt)
        assert bytes(np.asarray(t.data).view(np.uint8).tobytes()) == raw.tobytes(), name
        dims = ggml_dims(qt, raw)
        assert [int(d) for d in t.shape] == dims, (name, list(t.shape), dims)
        values = gguf.quants.dequantize(raw, qt).astype("<f4", copy=False)
        assert values.size == int(np.prod(dims)), name
        offset = len(blob)
        blob += values.tobytes()
        index.append({
            "name": name,
            "type": qt.name,
            "type_id": int(qt),
            "dims": dims,
            "source": source,
            "offset": offset,
            "nbytes": values.nbytes,
        })
        types_seen.add(qt.name)

    want = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
    assert types_seen == want, types_seen ^ want

    (OUT / "quant_expected.bin").write_bytes(bytes(blob))
    meta = {
        "about": "gguf.quants.dequantize of each tensor of quant_fixtures.gguf as little-endian f32; "
                 "written by scripts/gen_quant_fixtures.py",
        "seed": SEED,
        "generator": {"gguf": getattr(gguf, "__version__", None) or _pkg_version("gguf"), "numpy": np.__version__},
        "tensors": index,
    }
    (OUT / "quant_expected.json").write_text(json.dumps(meta, indent=1) + "\n")
    total = sum(os.path.getsize(OUT / f) for f in ("quant_fixtures.gguf", "quant_expected.bin", "quant_expected.json"))
    print(f"wrote {len(index)} tensors of {len(types_seen)} types to {OUT} ({total} bytes)")


def _pkg_version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


if __name__ == "__main__":
    main()
