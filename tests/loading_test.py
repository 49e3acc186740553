"""Weight and tokenizer loading: GGUF -> gemma params, the rebuilt SentencePiece tokenizer,
the on-disk cache, orbax checkpoints, and end-to-end proof with gemma's own model that the
weights and the tokenizer are right (greedy continuation, perplexity)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest
from loading_tiny_gguf import TINY, VOCAB, tiny_tensors, with_layers, write_tiny_gguf

from models import cache as cache_mod
from models.cache import load_gemma3_270m, load_gguf_cached, params_sha256
from models.checkpoints import (
    check_param_shapes,
    load_checkpoint,
    load_orbax_params,
    load_tokenizer,
)
from models.gguf import (
    GEMMA3_270M,
    expected_param_shapes,
    load_gguf_params,
    open_gguf,
    read_gguf_hparams,
)
from models.tokenizer import Tokenizer, sentencepiece_proto_from_gguf

# ~325 tokens of ordinary English prose (written for this test).
PROSE = """\
The town library opens at nine o'clock every morning, and by ten most of the tables near the \
windows are taken. Students come to study for their exams, retired teachers read the \
newspapers, and parents bring small children to the picture books in the corner. The building \
is more than a hundred years old. It was paid for by a local family who made their money in \
the railway business, and their portrait still hangs above the main staircase.

Last spring the town council decided to repair the roof, which had been leaking for several \
years. The work took four months and cost more than anyone had expected, but when it was \
finished the librarians said that the reading room had never looked better. New lights were \
installed, the old wooden shelves were cleaned and painted, and a small cafe was opened on the \
ground floor.

Not everyone was happy with the changes. Some people complained that the cafe was too noisy \
and that the smell of coffee reached the quiet study area upstairs. Others said that the \
library should spend its money on books rather than on furniture. The head librarian listened \
to these complaints and promised to find a solution. In the end, the cafe was moved to a room \
at the back of the building, and a glass door was added to keep the noise out.

Today the library is busier than ever. On weekends there are reading groups, language classes, \
and free computer lessons for older people who want to learn how to send emails to their \
grandchildren. Many visitors say that the library is the heart of the town, a place where \
everyone is welcome and where nobody has to pay to learn something new.
"""

CODE = 'def f(x):\n    if x > 0:\n        return x * 2\n    return -x\n\n\nname = "a  b"\n'

ROUND_TRIP_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces,   three inside,\tand a tab\t\t",
    "line one\nline two\n\n\nafter three newlines\r\n",
    CODE,
    "Unicode: héllo wörld, Ærøskøbing, naïve café, 日本語のテキスト, Привет, مرحبا, ﬁ \uff21",
    "Emoji: 😀 🦀 👩‍👩‍👧 🇫🇷 ❤️",
    "Digits 0123456789, 3.14159, 1,000,000 and -42",
    "Rare characters: \U0001d4b3 \U000e0001 \ue000 \u0f3a\u0f3b",
    "",
]


def _flatten(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """A fresh cache root (deleted afterwards: it holds ~1.3 GB)."""
    root = tmp_path_factory.mktemp("equarx-cache")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def gemma270m(cache_root):
    """The first load of the packaged GGUF (converts it and fills the cache)."""
    params, tokenizer, info = load_gemma3_270m(cache_dir=cache_root)
    assert not info.from_cache
    return params, tokenizer, info


@pytest.fixture(scope="module")
def tok(gemma270m) -> Tokenizer:
    return gemma270m[1]


@pytest.fixture(scope="module")
def gguf_path(gemma270m) -> Path:
    return gemma270m[2].gguf_path


@pytest.fixture
def tiny(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


# -- tokenizer (real vocabulary) -----------------------------------------------------------
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id
    assert tok.unk_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids)) == text


def test_special_ids(tok):
    assert tok.vocab_size == 262_144
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
    assert (tok.start_of_turn_id, tok.end_of_turn_id) == (105, 106)
    assert tok.special_tokens["start_of_image"] == 255_999
    assert tok.encode("hi", add_bos=False) == tok.encode("hi")[1:]
    assert tok.encode("hi", add_eos=True)[-1] == tok.eos_id
    # Control tokens decode to nothing and cannot be produced by typed text.
    assert tok.decode([tok.bos_id, *tok.encode("hi", add_bos=False), tok.eos_id]) == "hi"
    assert tok.bos_id not in tok.encode("<bos>", add_bos=False)


def test_chat_tokens_are_single_tokens(tok):
    text = "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text)
    assert ids.count(105) == 2 and ids.count(106) == 1
    assert tok.pieces("<start_of_turn>user") == ["<start_of_turn>", "user"]
    assert tok.decode(ids) == text


def test_pieces_match_gemma_settings(tok):
    # No dummy prefix: "Hello" is the piece "Hello", not "▁Hello".
    assert tok.pieces("Hello world") == ["Hello", "▁world"]
    assert tok.encode("Hello world") == [2, 9259, 1902]
    # Runs of spaces / newlines / tabs are single pieces (whitespace pieces restored to "▁").
    assert tok.pieces("a   b") == ["a", "▁▁▁", "b"]
    assert tok.pieces("a\n\nb") == ["a", "\n\n", "b"]
    assert tok.pieces("\t\t") == ["\t\t"]
    # Digits are split; identity normalization (no NFKC): "ﬁ" and full-width letters survive.
    assert tok.pieces("2024") == ["2", "0", "2", "4"]
    assert tok.decode(tok.encode("ﬁ \uff21")) == "ﬁ \uff21"
    assert tok.pieces("ﬁ") == ["ﬁ"]


def test_byte_fallback(tok):
    text = "\U000e0001"  # a tag character: not in the vocabulary
    ids = tok.encode(text, add_bos=False)
    assert [tok.id_to_piece(i) for i in ids] == ["<0xF3>", "<0xA0>", "<0x80>", "<0x81>"]
    assert tok.decode(ids) == text


def test_tokenizer_model_file(tok, tmp_path):
    path = tmp_path / "tokenizer.model"
    tok.save(path)
    again = load_tokenizer(path)
    for text in ROUND_TRIP_TEXTS:
        assert again.encode(text) == tok.encode(text)
    with pytest.raises(FileNotFoundError, match=r"missing\.model"):
        Tokenizer.from_file(tmp_path / "missing.model")
    bad = tmp_path / "corrupt.model"
    bad.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"corrupt\.model"):
        Tokenizer.from_file(bad)
    bad.write_bytes(b"")
    with pytest.raises(ValueError, match="not a valid SentencePiece model"):
        Tokenizer.from_file(bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([262_144])


# -- tokenizer rebuild (tiny vocabulary with the real file's quirks) -------------------------
def test_tokenizer_rebuild_fixes(tiny):
    from sentencepiece import sentencepiece_model_pb2 as pb

    path, _ = tiny
    proto = pb.ModelProto()
    proto.ParseFromString(sentencepiece_proto_from_gguf(path))
    types = {p.piece: p.type for p in proto.pieces}
    assert types["<unk>"] == pb.ModelProto.SentencePiece.UNKNOWN
    assert (
        types["<start_of_turn>"]
        == types["<end_of_turn>"]
        == pb.ModelProto.SentencePiece.USER_DEFINED
    )
    assert types["<bos>"] == pb.ModelProto.SentencePiece.CONTROL
    assert proto.pieces[6].piece == "▁▁"  # was "  " in the file
    assert proto.trainer_spec.byte_fallback
    assert proto.trainer_spec.model_type == pb.TrainerSpec.BPE
    ns = proto.normalizer_spec
    assert (ns.name, ns.add_dummy_prefix, ns.remove_extra_whitespaces) == ("identity", False, False)

    t = Tokenizer.from_gguf(path)
    assert t.pieces("hi  ab") == ["hi", "▁▁", "ab"]
    assert t.encode("<start_of_turn>hi<end_of_turn>", add_bos=False) == [4, 272, 5]
    assert t.pieces("é") == ["<0xC3>", "<0xA9>"]
    assert t.decode(t.encode("é hi  a\n")) == "é hi  a\n"
    assert len(VOCAB) == t.vocab_size


def test_tokenizer_rejects_other_models(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"gpt2\.gguf.*'gpt2'"):
        Tokenizer.from_gguf(path)


# -- GGUF params -----------------------------------------------------------------------------
def test_params_match_gemma_tree(gemma270m):
    import jax
    import jax.numpy as jnp
    from gemma import gm

    model = gm.nn.Gemma3_270M()
    abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))[
        "params"
    ]
    want = {k: tuple(v.shape) for k, v in _flatten(abstract).items()}
    got = _flatten(gemma270m[0])
    assert set(got) == set(want)
    assert {k: v.shape for k, v in got.items()} == want
    assert {v.dtype for v in got.values()} == {np.dtype(np.float32)}
    assert {k: tuple(v) for k, v in _flatten(expected_param_shapes()).items()} == want
    check_param_shapes(gemma270m[0], abstract)  # the checkpoint loader's check agrees


def test_hparams_match_gemma_config(gemma270m):
    from gemma import gm

    c = gm.nn.Gemma3_270M.config
    hp = GEMMA3_270M
    assert (c.num_layers, c.embed_dim, c.hidden_dim) == (hp.num_layers, hp.embed_dim, hp.hidden_dim)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (hp.num_heads, hp.num_kv_heads, hp.head_dim)
    assert (c.num_embed, c.sliding_window_size) == (hp.vocab_size, hp.sliding_window)
    assert c.local_base_frequency == hp.local_rope_base
    assert c.global_base_frequency == hp.global_rope_base
    assert gemma270m[2].hparams == dataclasses.replace(hp, rms_norm_eps=np.float32(1e-6).item())


def test_norm_scales_are_shifted(gemma270m):
    """llama.cpp stores gemma's 1 + scale. The released weights are bf16, so the true scales
    are exactly bf16 numbers: after subtracting 1 every one of them is; the stored values (or
    the values shifted the wrong way) are not."""
    norms = [v for k, v in _flatten(gemma270m[0]).items() if "norm" in k]
    assert len(norms) == 18 * 6 + 1
    s = np.concatenate(norms)

    def bf16_exact(x):
        return np.mean(x.astype(ml_dtypes.bfloat16).astype(np.float32) == x)

    assert bf16_exact(s) == 1.0
    assert bf16_exact(s + 1) < 0.9 and bf16_exact(s - 1) < 0.9
    # QK-norm scales sit around 1 (gemma: x * (1 + scale) ~ 2x), not around 2.
    qk = np.concatenate([v for k, v in _flatten(gemma270m[0]).items() if "_query_norm" in k])
    assert 0.5 < np.median(qk) < 1.5


def test_layout_matches_linear_algebra(tiny):
    """Each gemma einsum on the loaded params equals the llama.cpp (x @ W.T) computation."""
    path, t = tiny
    p = load_gguf_params(path, TINY)["layer_1"]
    n, k, h, d = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim, TINY.embed_dim
    x = np.random.default_rng(1).standard_normal((3, d)).astype(np.float32)
    b = "blk.1."
    q = np.einsum("TD,NDH->TNH", x, p["attn"]["q_einsum"]["w"])
    np.testing.assert_allclose(q, (x @ t[b + "attn_q.weight"].T).reshape(3, n, h), rtol=1e-5)
    key, val = np.einsum("SD,CKDH->CSKH", x, p["attn"]["kv_einsum"]["w"])
    np.testing.assert_allclose(key, (x @ t[b + "attn_k.weight"].T).reshape(3, k, h), rtol=1e-5)
    np.testing.assert_allclose(val, (x @ t[b + "attn_v.weight"].T).reshape(3, k, h), rtol=1e-5)
    out = np.einsum("TNH,NHD->TD", q, p["attn"]["attn_vec_einsum"]["w"])
    want = q.reshape(3, n * h) @ t[b + "attn_output.weight"].T
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    gate = np.einsum("...F,NHF->...NH", x, p["mlp"]["gating_einsum"])  # gemma's equation
    np.testing.assert_allclose(gate[:, 0], x @ t[b + "ffn_gate.weight"].T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gate[:, 1], x @ t[b + "ffn_up.weight"].T, rtol=1e-5, atol=1e-5)
    hid = gate[:, 1]
    np.testing.assert_allclose(
        hid @ p["mlp"]["linear"], hid @ t[b + "ffn_down.weight"].T, rtol=1e-4, atol=1e-4
    )
    np.testing.assert_array_equal(p["pre_attention_norm"]["scale"], t[b + "attn_norm.weight"] - 1)
    np.testing.assert_array_equal(p["pre_ffw_norm"]["scale"], t[b + "ffn_norm.weight"] - 1)
    np.testing.assert_array_equal(p["attn"]["_key_norm"]["scale"], t[b + "attn_k_norm.weight"] - 1)


# -- bad inputs -------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    for fn in (load_gguf_params, open_gguf, Tokenizer.from_gguf, load_gguf_cached):
        with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
            fn(missing)


def test_truncated_copy(gguf_path, tmp_path):
    cut = tmp_path / "first-mib.gguf"
    with gguf_path.open("rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match=r"first-mib\.gguf.*truncated or corrupt"):
        load_gguf_params(cut)


def test_truncated_tensor_data(tiny):
    path, _ = tiny
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"tiny\.gguf.*truncated"):
        load_gguf_params(path, TINY)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not GGUF" * 10)
    with pytest.raises(ValueError, match=r"weights\.bin: not a GGUF file"):
        load_gguf_params(path)
    with pytest.raises(ValueError, match="not a regular file"):
        load_gguf_params(tmp_path)


def test_wrong_architecture(tmp_path):
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path, arch="llama")
    with pytest.raises(
        ValueError, match=r"llama\.gguf: architecture is 'llama', expected 'gemma3'"
    ):
        load_gguf_params(path, TINY)


def test_hparams_mismatch(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match=r"num_layers=2 \(expected 18\).*embed_dim=8"):
        load_gguf_params(path)  # the 270M is expected by default
    with pytest.raises(ValueError, match=r"num_layers=2 \(expected 3\)"):
        read_gguf_hparams(path, with_layers(TINY, 3))
    assert read_gguf_hparams(path, None).num_layers == 2


def test_missing_extra_and_misshapen_tensors(tmp_path):
    from models.gguf import load_gguf_blocks

    t = tiny_tensors()
    del t["blk.1.ffn_up.weight"]
    t["output.weight"] = t["token_embd.weight"]
    write_tiny_gguf(tmp_path / "a.gguf", tensors=t)
    for load in (load_gguf_params, load_gguf_blocks):  # the same check of the names
        with pytest.raises(
            ValueError, match=r"missing \['blk\.1\.ffn_up\.weight'\].*output\.weight"
        ):
            load(tmp_path / "a.gguf", TINY)
    t = tiny_tensors()
    t["blk.0.ffn_down.weight"] = t["blk.0.ffn_down.weight"].T.copy()
    write_tiny_gguf(tmp_path / "b.gguf", tensors=t)
    with pytest.raises(ValueError, match=r"b\.gguf: tensor 'blk\.0\.ffn_down\.weight' has shape"):
        load_gguf_params(tmp_path / "b.gguf", TINY)


# -- the cache ------------------------------------------------------------------------------
def _file_stamps(folder: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime in ns) of every file under `folder`: changes when a file is rewritten."""
    return {
        str(f.relative_to(folder)): (f.stat().st_ino, f.stat().st_mtime_ns)
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


def test_second_load_reads_the_cache_without_converting(gemma270m, cache_root, monkeypatch):
    params, tokenizer, info = gemma270m
    stamps = _file_stamps(info.cache_dir)

    def no_conversion(*args, **kwargs):
        raise AssertionError("the second load converted the GGUF file again")

    monkeypatch.setattr(cache_mod, "load_gguf_params", no_conversion)
    monkeypatch.setattr(cache_mod, "sentencepiece_proto_from_gguf", no_conversion)
    params2, tokenizer2, info2 = load_gemma3_270m(cache_dir=cache_root)
    assert info2.from_cache
    assert _file_stamps(info.cache_dir) == stamps, "the cache was rewritten"
    assert {p.name for p in cache_root.iterdir()} == {"gguf", info.cache_dir.name}
    assert info2.weights_sha256 == info.weights_sha256 == params_sha256(params2)
    assert info2.cache_dir == cache_root / info.gguf_sha256[:16]
    assert info2.tokenizer_path.is_file() and info2.manifest_path.is_file()
    a, b = _flatten(params), _flatten(params2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert tokenizer2.serialized_model_proto == tokenizer.serialized_model_proto


def test_cache_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(cache_mod.CACHE_ENV, str(tmp_path / "c"))
    assert cache_mod.default_cache_root() == tmp_path / "c"
    monkeypatch.delenv(cache_mod.CACHE_ENV)
    assert cache_mod.default_cache_root() == Path.home() / ".cache" / "equarx-serve"


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 + 64] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip", "truncate", "no-manifest", "tokenizer", "manifest"])
def test_damaged_cache_is_rebuilt(tiny, tmp_path, damage, caplog):
    path, _ = tiny
    root = tmp_path / "cache"
    _, tokenizer, info = load_gguf_cached(path, cache_dir=root, expected=TINY)
    assert not info.from_cache
    assert load_gguf_cached(path, cache_dir=root, expected=TINY)[2].from_cache
    npy = info.params_dir / "layer_0.mlp.gating_einsum.npy"
    if damage == "flip":
        _flip_byte(npy)
    elif damage == "truncate":
        npy.write_bytes(npy.read_bytes()[:-7])
    elif damage == "no-manifest":
        info.manifest_path.unlink()
    elif damage == "tokenizer":
        _flip_byte(info.tokenizer_path)
    elif damage == "manifest":
        m = json.loads(info.manifest_path.read_text())
        m["arrays"]["final_norm/scale"]["shape"] = [9]
        info.manifest_path.write_text(json.dumps(m))
    with caplog.at_level(logging.WARNING, logger="models.cache"):
        params2, tokenizer2, info2 = load_gguf_cached(path, cache_dir=root, expected=TINY)
    assert not info2.from_cache, "damage went unnoticed"
    assert "rebuilding" in caplog.text
    assert info2.weights_sha256 == info.weights_sha256 == params_sha256(params2)
    assert tokenizer2.serialized_model_proto == tokenizer.serialized_model_proto
    assert load_gguf_cached(path, cache_dir=root, expected=TINY)[2].from_cache
    assert sorted(p.name for p in root.iterdir()) == [info.cache_dir.name]  # no leftovers


def test_cached_file_still_checked_against_expected(tiny, tmp_path):
    path, _ = tiny
    assert not load_gguf_cached(path, cache_dir=tmp_path, expected=TINY)[2].from_cache
    with pytest.raises(ValueError, match=r"tiny\.gguf: hyper-parameters differ.*num_layers=2"):
        load_gguf_cached(path, cache_dir=tmp_path)  # expects the 270M


# -- orbax checkpoints ------------------------------------------------------------------------
def test_orbax_checkpoint(tmp_path, tiny):
    from gemma import gm

    tree = {
        "embedder": {"input_embedding": np.arange(32, dtype=np.float32).reshape(8, 4)},
        "final_norm": {"scale": np.ones(4, np.float32)},
    }
    ckpt = tmp_path / "ckpt"
    gm.ckpts.save_params(tree, ckpt, wait_until_finished=True)
    shapes = {"embedder": {"input_embedding": (8, 4)}, "final_norm": {"scale": (4,)}}
    params = load_orbax_params(ckpt, expected=shapes, to_numpy=True)
    np.testing.assert_array_equal(
        params["embedder"]["input_embedding"], tree["embedder"]["input_embedding"]
    )
    with pytest.raises(ValueError, match=r"wrong shape: embedder/input_embedding: \(8, 4\)"):
        load_orbax_params(ckpt, expected={**shapes, "embedder": {"input_embedding": (8, 5)}})
    with pytest.raises(ValueError, match=r"missing: layer_0/mlp/linear.*unexpected: final_norm"):
        load_orbax_params(
            ckpt,
            expected={
                "embedder": {"input_embedding": (8, 4)},
                "layer_0": {"mlp": {"linear": (2,)}},
            },
        )
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        load_orbax_params(tmp_path / "nothing-here")
    # With the checkpoint's SentencePiece tokenizer.
    Tokenizer.from_gguf(tiny[0]).save(tmp_path / "tokenizer.model")
    params, tokenizer = load_checkpoint(ckpt, tmp_path / "tokenizer.model", expected=shapes)
    assert tokenizer.pieces("hi  ab") == ["hi", "▁▁", "ab"]
    assert set(params) == {"embedder", "final_norm"}
    with pytest.raises(FileNotFoundError, match="no-tokenizer"):
        load_checkpoint(ckpt, tmp_path / "no-tokenizer.model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: cannot restore a Gemma checkpoint"):
        load_orbax_params(tmp_path / "empty")


# -- end to end with gemma's own model -------------------------------------------------------
@pytest.mark.slow
def test_gemma_model_generates_and_predicts_english(gemma270m):
    """gm.nn.Gemma3_270M with the GGUF weights: greedy continuation and perplexity. A wrong
    transpose, a missing norm shift or a tokenizer mismatch all wreck both."""
    import jax
    import jax.numpy as jnp
    from gemma import gm

    params, tok, _ = gemma270m
    model = gm.nn.Gemma3_270M(dtype=jnp.float32)
    jparams = jax.tree.map(jnp.asarray, params)
    forward = jax.jit(lambda p, x: model.apply({"params": p}, x).logits)

    # Greedy: a fixed-length, zero-padded (PAD = 0, masked) window so it compiles once; the
    # model is causal, so the logits at the last real token ignore the padding.
    prompt = tok.encode("The quick brown fox")
    ids = list(prompt)
    window = 16
    for _ in range(7):
        x = np.zeros((1, window), np.int32)
        x[0, : len(ids)] = ids
        ids.append(int(jnp.argmax(forward(jparams, x)[0, len(ids) - 1])))
    continuation = tok.decode(ids[len(prompt) :])
    print(f"greedy continuation: {continuation!r}")
    assert continuation.strip().startswith("jumps over the lazy dog"), continuation

    def perplexity(p, text):
        x = np.asarray([tok.encode(text)], np.int32)
        logp = jax.nn.log_softmax(forward(p, x)[0, :-1].astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, x[0, 1:, None], axis=-1).mean()
        return float(jnp.exp(nll)), x.shape[1]

    ppl, n = perplexity(jparams, PROSE)
    print(f"perplexity of {n} tokens of prose: {ppl:.2f}")
    assert n >= 250
    print(f"TP=2 engine: {continuation!r}, perplexity {ppl:.2f} over {len(x)} tokens")
    assert ppl < 30, ppl
    # Negative control: the norms as stored in the file (without the -1) break the model.
    unshifted = jax.tree_util.tree_map_with_path(
        lambda path, a: a + 1 if "norm" in jax.tree_util.keystr(path) else a, jparams
    )
    assert perplexity(unshifted, PROSE)[0] > 1000


@pytest.mark.slow
def test_our_tensor_parallel_model_on_the_real_weights(gemma270m):
    """The 270M sanity checks again, on this project's TP=2 model through the prefill engine."""
    import jax
    import jax.numpy as jnp

    from equarx_serve.generation.prefill import PrefillEngine
    from models.config import get_config

    params, tok, _ = gemma270m
    engine = PrefillEngine(
        get_config("gemma3-270m"), params, tp=2, all_reduce="psum-f32", dtype=jnp.float32
    )
    prompt = tok.encode("The quick brown fox")
    ids = list(prompt)
    for _ in range(7):  # greedy, one full prefill per token (same 16-token bucket each time)
        ids.append(int(jnp.argmax(engine.prefill([ids]).logits[0])))
    continuation = tok.decode(ids[len(prompt) :])
    assert continuation.strip().startswith("jumps over the lazy dog"), continuation

    x = tok.encode(PROSE)
    logits = engine.prefill([x], last_only=False).logits[0, : len(x) - 1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    ppl = float(jnp.exp(-jnp.take_along_axis(logp, np.asarray(x[1:])[:, None], axis=-1).mean()))
    print(f"TP=2 engine: {continuation!r}, perplexity {ppl:.2f} over {len(x)} tokens")
    assert ppl < 30, ppl
