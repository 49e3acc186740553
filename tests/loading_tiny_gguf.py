"""A tiny Gemma 3 GGUF file written with `gguf.GGUFWriter`, laid out like llama.cpp's (numpy
(out, in) matrices, norms stored as 1 + scale, the tokenizer quirks of the real file), for
fast tests of the loader, the tokenizer rebuild and the cache."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np

from models.gguf import Gemma3Hparams

CONTROL, USER_DEFINED, BYTE, NORMAL = (
    int(gguf.TokenType.CONTROL),
    int(gguf.TokenType.USER_DEFINED),
    int(gguf.TokenType.BYTE),
    int(gguf.TokenType.NORMAL),
)

# As in the real file: <unk> typed CONTROL, the chat tokens CONTROL, the whitespace-run piece
# stored with plain spaces.
VOCAB: list[tuple[str, int]] = [
    ("<pad>", CONTROL),
    ("<eos>", CONTROL),
    ("<bos>", CONTROL),
    ("<unk>", CONTROL),
    ("<start_of_turn>", CONTROL),
    ("<end_of_turn>", CONTROL),
    ("  ", USER_DEFINED),
    ("\n", USER_DEFINED),
    *[(f"<0x{b:02X}>", BYTE) for b in range(256)],
    *[(p, NORMAL) for p in ["▁", "a", "b", "c", "h", "i", "▁a", "ab", "hi", "▁hi", "▁ab"]],
]

TINY = Gemma3Hparams(
    num_layers=2,
    embed_dim=8,
    hidden_dim=16,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    vocab_size=len(VOCAB),
    context_length=64,
    sliding_window=4,
    global_rope_base=1_000_000.0,
    local_rope_base=10_000.0,
    rms_norm_eps=1e-6,
)


def tiny_tensors(hp: Gemma3Hparams = TINY, seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 numpy array (llama.cpp layout, norms stored as 1 + s)."""
    rng = np.random.default_rng(seed)
    d, f, n, k, h = hp.embed_dim, hp.hidden_dim, hp.num_heads, hp.num_kv_heads, hp.head_dim

    def mat(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    t = {"token_embd.weight": mat(hp.vocab_size, d), "output_norm.weight": 1 + mat(d)}
    for i in range(hp.num_layers):
        b = f"blk.{i}."
        t |= {
            b + "attn_q.weight": mat(n * h, d),
            b + "attn_k.weight": mat(k * h, d),
            b + "attn_v.weight": mat(k * h, d),
            b + "attn_output.weight": mat(d, n * h),
            b + "ffn_gate.weight": mat(f, d),
            b + "ffn_up.weight": mat(f, d),
            b + "ffn_down.weight": mat(d, f),
            b + "attn_q_norm.weight": 1 + mat(h),
            b + "attn_k_norm.weight": 1 + mat(h),
            b + "attn_norm.weight": 1 + mat(d),
            b + "post_attention_norm.weight": 1 + mat(d),
            b + "ffn_norm.weight": 1 + mat(d),
            b + "post_ffw_norm.weight": 1 + mat(d),
        }
    return t


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "gemma3",
    hp: Gemma3Hparams = TINY,
    tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF file; returns the tensors written."""
    tensors = tiny_tensors(hp) if tensors is None else tensors
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.block_count", hp.num_layers)
    w.add_uint32(f"{arch}.embedding_length", hp.embed_dim)
    w.add_uint32(f"{arch}.feed_forward_length", hp.hidden_dim)
    w.add_uint32(f"{arch}.attention.head_count", hp.num_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", hp.num_kv_heads)
    w.add_uint32(f"{arch}.attention.key_length", hp.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", hp.head_dim)
    w.add_uint32(f"{arch}.context_length", hp.context_length)
    w.add_uint32(f"{arch}.attention.sliding_window", hp.sliding_window)
    w.add_float32(f"{arch}.rope.freq_base", hp.global_rope_base)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", hp.rms_norm_eps)
    w.add_tokenizer_model("llama")
    w.add_token_list([p for p, _ in VOCAB])
    w.add_token_scores([-1000.0 if t != NORMAL else -float(i) for i, (_, t) in enumerate(VOCAB)])
    w.add_token_types([t for _, t in VOCAB])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(False)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def with_layers(hp: Gemma3Hparams, num_layers: int) -> Gemma3Hparams:
    return dataclasses.replace(hp, num_layers=num_layers)
