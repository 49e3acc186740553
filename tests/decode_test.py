"""Decoding from the KV cache on the "tiny" config, TP = 2 over fake CPU devices: parity with
re-running the full prefill every step, batching, stop conditions, sampling, streaming,
cancellation, validation, the chat template and the all-reduce each phase uses."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_of

from equarx_serve.generation.generator import (
    Completion,
    Generator,
    SamplingParams,
    byte_tokenizer,
    chat_prompt,
)
from equarx_serve.generation.prefill import PrefillEngine
from equarx_serve.generation.sampling import sample_tokens
from models.config import AttentionType, get_config
from models.gemma3 import init_params

CONFIG = get_config("tiny")
WINDOW = CONFIG.sliding_window_size  # 8
# Different lengths in two buckets; 21 and 30 are longer than the local layers' window.
PROMPT_LENGTHS = (3, 11, 21)
MAX_LENGTH = 64


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[2, *rng.integers(7, CONFIG.vocab_size, size=n - 1).tolist()] for n in lengths]


@functools.cache
def _params():
    return init_params(CONFIG, jax.random.PRNGKey(0))


@functools.cache
def _engine(all_reduce="psum-f32"):
    mesh_of(2)  # skips without 2 devices
    return PrefillEngine(CONFIG, _params(), tp=2, all_reduce=all_reduce, max_length=MAX_LENGTH)


@functools.cache
def _generator(all_reduce="psum-f32", max_batch=8):
    return Generator(_engine(all_reduce), max_batch=max_batch)


def _reference_greedy(prompts, steps, engine=None):
    """Greedy tokens and their logits from the full prefill of prompt + generated tokens at
    every step (no KV cache)."""
    engine = engine or _engine()
    seqs = [list(p) for p in prompts]
    tokens, logits = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(steps):
        out = np.asarray(engine.prefill(seqs).logits)  # [B, V]
        for i, row in enumerate(out):
            tokens[i].append(int(np.argmax(row)))
            logits[i].append(row)
            seqs[i].append(tokens[i][-1])
    return tokens, np.asarray(logits)  # [B, steps, V]


def test_tiny_config_has_local_layers_shorter_than_prompts():
    assert AttentionType.LOCAL_SLIDING in CONFIG.attention_types
    assert AttentionType.GLOBAL in CONFIG.attention_types
    assert max(PROMPT_LENGTHS) > WINDOW


@pytest.mark.parametrize("name", ["tiny", "tiny-mqa"])
def test_decode_step_matches_full_prefill(name):
    """The model's decode step on a grown cache gives the full prefill's logits, step by step,
    for a batch of different lengths (crossing the window and a bucket boundary); "tiny-mqa"
    has one KV head, replicated over TP = 2 (as in Gemma 3 270M)."""
    if name == "tiny":
        engine, steps = _engine(), 12  # 21 + 12 crosses the 32 bucket
    else:
        mqa = get_config(name)
        params = init_params(mqa, jax.random.PRNGKey(1))
        engine = PrefillEngine(mqa, params, tp=2, all_reduce="psum-f32", max_length=MAX_LENGTH)
        steps = 4
    prompts = _prompts(PROMPT_LENGTHS)
    ref_tokens, ref_logits = _reference_greedy(prompts, steps, engine)
    capacity = engine.bucket_for(max(PROMPT_LENGTHS) + steps)
    result = engine.prefill(prompts)
    pad = capacity - result.bucket
    cache = jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))), result.cache)
    lengths = np.array(PROMPT_LENGTHS, np.int32)
    logits = np.asarray(result.logits)
    for step in range(steps):
        np.testing.assert_allclose(logits, ref_logits[:, step], atol=5e-5, rtol=5e-5)
        tokens = np.argmax(logits, axis=-1).astype(np.int32)
        assert tokens.tolist() == [t[step] for t in ref_tokens]
        out = engine.model.decode(engine.params, cache, tokens, lengths)
        cache, logits, lengths = out.cache, np.asarray(out.logits), lengths + 1
    assert cache["layer_0"]["k"].shape[1] == capacity


def test_generator_greedy_matches_full_prefill():
    prompts = _prompts(PROMPT_LENGTHS, seed=1)
    gen = _generator()
    ref_tokens, _ = _reference_greedy(prompts, 10)
    completions = gen.generate(prompts, SamplingParams(max_tokens=10))
    for ref, c in zip(ref_tokens, completions, strict=True):
        stops = [i for i, t in enumerate(ref) if t in gen.stop_token_ids]
        expected = ref[: stops[0]] if stops else ref
        assert c.tokens == expected
        assert c.finish_reason == ("stop" if stops else "length")
        assert c.text == gen.tokenizer.decode(c.tokens)
        assert c.prompt_tokens == prompts[ref_tokens.index(ref)]


def test_requests_finish_independently_and_queue_beyond_max_batch():
    """Five requests on 2 slots, different max_tokens: each finishes on its own, later ones
    take freed slots, and every result equals the request run alone."""
    gen = _generator(max_batch=2)
    prompts = _prompts((5, 9, 4, 17, 6), seed=2)
    params = [SamplingParams(max_tokens=n) for n in (2, 7, 3, 5, 1)]
    together = gen.generate(prompts, params)
    for prompt, p, c in zip(prompts, params, together, strict=True):
        [alone] = _generator().generate([prompt], p)
        assert c.tokens == alone.tokens
        assert c.finish_reason == alone.finish_reason
        if c.finish_reason == "length":
            assert len(c.tokens) == p.max_tokens


def test_streaming_deltas_add_up_and_stop_strings_never_stream():
    gen = _generator()
    prompts = _prompts((6, 12), seed=3)
    [free] = gen.generate(prompts[:1], SamplingParams(max_tokens=12))
    assert len(free.text) > 4, free
    stop = free.text[2:4]  # a stop string the greedy text contains
    streamed: dict[int, str] = {0: "", 1: ""}

    def on_token(i, token, delta):
        streamed[i] += delta

    completions = gen.generate(
        prompts, SamplingParams(max_tokens=12, stop=(stop,)), on_token=on_token
    )
    c = completions[0]
    assert c.finish_reason == "stop"
    assert c.text == free.text[: free.text.index(stop)]
    assert stop not in streamed[0] and streamed[0] == c.text
    assert free.text.startswith(gen.tokenizer.decode(c.tokens))
    assert streamed[1] == completions[1].text


def test_stop_on_end_of_turn_token(monkeypatch):
    gen = Generator(_engine(), max_batch=2)
    prompt = _prompts((7,), seed=4)
    [free] = gen.generate(prompt, SamplingParams(max_tokens=6))
    # Pretend the third generated token is <end_of_turn>.
    stop_id = free.tokens[2]
    gen.stop_token_ids = frozenset({stop_id})
    [c] = gen.generate(prompt, SamplingParams(max_tokens=6))
    assert c.finish_reason == "stop" and c.tokens == free.tokens[: free.tokens.index(stop_id)]


def test_seeds_are_reproducible_and_differ():
    gen = _generator()
    prompts = _prompts((5, 5), seed=5)
    hot = dict(max_tokens=8, temperature=5.0)
    a = gen.generate(prompts, [SamplingParams(seed=1, **hot), SamplingParams(seed=2, **hot)])
    b = gen.generate(prompts[:1], SamplingParams(seed=1, **hot))  # alone, another batch
    assert a[0].tokens == b[0].tokens
    assert a[0].tokens != a[1].tokens


def test_top_k_1_is_greedy_and_top_p_tiny_is_greedy():
    gen = _generator()
    prompts = _prompts((9,), seed=6)
    [greedy] = gen.generate(prompts, SamplingParams(max_tokens=8))
    [top1] = gen.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0, top_k=1))
    [nucleus] = gen.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6))
    assert top1.tokens == greedy.tokens == nucleus.tokens


def test_sample_tokens_respects_top_k_and_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2))
    draws = {"top_k": set(), "top_p": set()}
    for step in range(200):
        args = (jnp.ones(2), jnp.array([2, 0]), jnp.array([1.0, 0.7]))
        keys = (jnp.array([7, 8], jnp.uint32), jnp.full(2, step, jnp.int32))
        k_row, p_row = np.asarray(sample_tokens(logits, *args, *keys, mode="top_p"))
        draws["top_k"].add(int(k_row))
        draws["top_p"].add(int(p_row))
    assert draws["top_k"] == {0, 1}  # the 2 most likely
    assert draws["top_p"] == {0, 1}  # 0.5 + 0.3 reaches 0.7


def test_cancellation_frees_the_slot():
    gen = _generator(max_batch=1)
    prompts = _prompts((5, 8), seed=7)
    seen: list[int] = []

    def on_token(i, token, delta):
        seen.append(i)
        return not (i == 0 and seen.count(0) == 2)  # cancel request 0 at its second token

    first, second = gen.generate(prompts, SamplingParams(max_tokens=6), on_token=on_token)
    assert first.finish_reason == "cancelled" and len(first.tokens) == 2
    assert second.finish_reason in ("length", "stop") and 1 in seen


def test_completion_timings():
    [c] = _generator().generate(_prompts((4,)), SamplingParams(max_tokens=5))
    assert isinstance(c, Completion)
    assert c.prefill_ms > 0 and c.time_to_first_token_ms >= c.prefill_ms
    assert c.decode_ms >= 0
    if len(c.tokens) == 5:
        assert c.decode_tokens_per_s > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(stop=("",)), "stop"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_generate_validation():
    gen = _generator()
    with pytest.raises(ValueError, match="empty prompt"):
        gen.generate([[2, 5], []], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="maximum context of 64"):
        gen.generate([[2] * 40], SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="token ids"):
        gen.generate([[2, CONFIG.vocab_size]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        gen.generate([[2, 5]], [SamplingParams(max_tokens=4)] * 2)
    with pytest.raises(ValueError, match="max_batch"):
        Generator(_engine(), max_batch=0)


def test_chat_prompt():
    text = chat_prompt(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "Why?"}]},
        ]
    )
    assert text == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nWhy?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    tok = byte_tokenizer(CONFIG.vocab_size)
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[1] == tok.start_of_turn_id
    assert tok.decode(ids) == text
    for bad, message in [
        ([], "at least one user"),
        ([{"role": "robot", "content": "x"}], "unknown role"),
        ([{"role": "assistant", "content": "x"}], "alternate"),
        ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "first"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "last"),
        ([{"content": "x"}], "role"),
        ("hello", "list"),
    ]:
        with pytest.raises(ValueError, match=message):
            chat_prompt(bad)


def test_all_reduce_usage_and_log(caplog):
    engine = _engine("psum").with_all_reduce("equarx-int8")  # default 1 MiB gate
    gen = Generator(engine)
    usage = gen.all_reduce_usage(batch=2, prompt_len=20)
    assert usage.prefill.shape == (2, 32, CONFIG.embed_dim)
    assert usage.prefill.message_bytes == 2 * 32 * CONFIG.embed_dim * 4
    assert usage.prefill.uses == usage.decode.uses == "psum (size gate)"
    with caplog.at_level(logging.INFO, logger="equarx_serve.generation.generator"):
        gen.generate(_prompts((4,)), SamplingParams(max_tokens=2))
        gen.generate(_prompts((5,)), SamplingParams(max_tokens=2))
    logs = [r.getMessage() for r in caplog.records if r.name == "equarx_serve.generation.generator"]
    assert len(logs) == 1 and "decode" in logs[0] and "psum (size gate)" in logs[0]


def test_equarx_int8_decoding_is_close_to_psum():
    from equarx_serve.collectives import get_all_reduce

    equarx = get_all_reduce("equarx-int8", min_size_bytes=0)
    gen = Generator(_engine().with_all_reduce(equarx))
    usage = gen.all_reduce_usage(3, 21)
    assert usage.prefill.uses == usage.decode.uses == "equarx-int8"
    prompts = _prompts(PROMPT_LENGTHS, seed=8)
    params = SamplingParams(max_tokens=6)
    quantized = gen.generate(prompts, params)
    exact = _generator().generate(prompts, params)
    # int8 partial sums change the logits by ~1%: the first greedy tokens agree.
    agree = [q.tokens[:2] == e.tokens[:2] for q, e in zip(quantized, exact, strict=True)]
    assert sum(agree) >= 2, (quantized, exact)
    assert all(len(q.tokens) >= 1 or q.finish_reason == "stop" for q in quantized)
