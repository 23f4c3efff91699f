# Writes the small valid GGUF files in fuzz/seeds/ (the fuzzer's starting corpus) with gguf-py.
"""Run from the repository root: python3 fuzz/make_seeds.py"""

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as T
from gguf import GGUFWriter

OUT = Path(__file__).resolve().parent / "seeds"


def write(name: str, fill, version: int = 3) -> None:
    path = OUT / name
    w = GGUFWriter(path, "llama")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if version != 3:
        # v2 and v3 share the little-endian layout; only the version field differs.
        data = bytearray(path.read_bytes())
        data[4:8] = version.to_bytes(4, "little")
        path.write_bytes(bytes(data))
    print(f"{path}: {path.stat().st_size} bytes")


def raw(n_bytes: int, seed: int) -> np.ndarray:
    """Quantised tensor bytes (gguf-py takes a uint8 array shaped rows x bytes-per-row)."""
    return ((np.arange(n_bytes) * 31 + seed * 7 + 1) % 256).astype(np.uint8)


def every_value(w: GGUFWriter) -> None:
    w.add_uint8("t.u8", 254)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 0xBEEF)
    w.add_int16("t.i16", -12345)
    w.add_uint32("t.u32", 0xDEADBEEF)
    w.add_int32("t.i32", -(2**31))
    w.add_float32("t.f32", -1.5e-3)
    w.add_bool("t.bool", True)
    w.add_string("t.string", "héllo ✓")
    w.add_uint64("t.u64", 2**64 - 2)
    w.add_int64("t.i64", -(2**63) + 7)
    w.add_float64("t.f64", 3.141592653589793)
    w.add_key_value("a.u8", [1, 2, 255], T.ARRAY, T.UINT8)
    w.add_key_value("a.i16", [-1, 7], T.ARRAY, T.INT16)
    w.add_key_value("a.u64", [0, 2**64 - 1], T.ARRAY, T.UINT64)
    w.add_key_value("a.f64", [1e300, -2.25], T.ARRAY, T.FLOAT64)
    w.add_array("a.bool", [True, False])
    w.add_array("a.string", ["<s>", "Ġthe", "日本"])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_array("a.nested3", [[["a", "bc"]], [["d"]]])


def tensors(w: GGUFWriter) -> None:
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_tensor("f32", np.arange(8, dtype=np.float32).reshape(2, 4))
    w.add_tensor("f16", np.arange(7, dtype=np.float16))
    w.add_tensor("q8_0", raw(34 * 2, 1).reshape(2, 34), raw_dtype=Q.Q8_0)
    w.add_tensor("q4_0", raw(18, 2).reshape(1, 18), raw_dtype=Q.Q4_0)
    w.add_tensor("q6_k", raw(210, 3).reshape(1, 210), raw_dtype=Q.Q6_K)


def aligned8(w: GGUFWriter) -> None:
    w.add_custom_alignment(8)
    w.add_tensor("a", np.ones(3, dtype=np.float16))
    w.add_tensor("b", np.zeros((3, 1), dtype=np.float32))
    w.add_tensor("c", raw(20, 4).reshape(1, 20), raw_dtype=Q.Q4_1)


def vocab(w: GGUFWriter) -> None:
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "a", "b", "ab"])
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -0.5])
    w.add_token_types([2, 3, 3, 1, 1, 1])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", raw(22 * 6, 5).reshape(6, 22), raw_dtype=Q.Q5_0)


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    write("every_value_v3.gguf", every_value)
    write("every_value_v2.gguf", every_value, version=2)
    write("tensors_v3.gguf", tensors)
    write("aligned8_v2.gguf", aligned8, version=2)
    write("vocab_v3.gguf", vocab)
