"""`eval.decode_weights`: teacher-forced decode logits and their scores, on the tiny model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_of

from equarx_serve.generation.prefill import PrefillEngine
from eval import decode_weights


@pytest.fixture(scope="module")
def engines():
    mesh_of(2)
    load = lambda dtype: PrefillEngine.from_name("tiny", 2, "psum", dtype=dtype, max_length=64)
    return load(jnp.bfloat16), load(jnp.float32)


def _prompts_and_continuations(vocab: int, batch: int = 3, length: int = 20, steps: int = 6):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, (batch, length + steps))
    return tokens[:, :length].tolist(), tokens[:, length:]


def test_teacher_forced_steps_predict_what_the_whole_sequence_prefill_predicts(engines):
    """Step k's logits (after feeding continuation token k) are the prefill's at that
    position of the whole sequence, within bf16 roundings."""
    bf16, _ = engines
    prompts, continuations = _prompts_and_continuations(bf16.config.vocab_size)
    logits = decode_weights.teacher_forced_logits(bf16, prompts, continuations)
    assert logits.shape == (3, 6, bf16.config.vocab_size) and logits.dtype == np.float32
    whole = [p + c.tolist() for p, c in zip(prompts, continuations, strict=True)]
    full = np.asarray(bf16.prefill(whole, last_only=False).logits, np.float32)[:, 20:26]
    np.testing.assert_allclose(logits, full, atol=0.05 * np.abs(full).max())
    assert np.mean(logits.argmax(-1) == full.argmax(-1)) >= 0.9


def test_scores_of_an_engine_against_itself_and_against_another(engines):
    bf16, f32 = engines
    prompts, continuations = _prompts_and_continuations(bf16.config.vocab_size)
    same = decode_weights.compare(np.ones((2, 8)), np.ones((2, 8)))
    assert same.kl == 0 and same.top1 == 1 and same.max_abs == 0 and same.steps == 2
    scores = decode_weights.score_decode_weights(
        {"bf16": bf16, "gguf": bf16, "float32": f32}, prompts, continuations
    )
    assert scores["vs_bf16"]["gguf"] == {"kl": 0.0, "top1": 1.0, "max_abs": 0.0, "steps": 18}
    floor = scores["vs_float32"]["bf16"]
    assert floor == scores["vs_float32"]["gguf"] and 0 < floor["kl"] < 0.05
    assert scores["gguf_kl_to_float32_over_floor"] == 1.0


def test_an_engine_without_a_gguf_file_has_no_blocks(engines):
    with pytest.raises(ValueError, match="loaded from a GGUF file"):
        engines[0].with_gguf_blocks()
