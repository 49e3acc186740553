"""The step-wise engine's parts, each alone: sampling settings, the detokenizer with stop
strings, batch padding and all-reduce accounting, KV-cache slots, step messages, and the step
engine's scheduling on a scripted runner (no model: every token is a function of its
sequence, so the expected output is computed independently)."""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest

from equarx_serve.collectives import get_all_reduce
from equarx_serve.generation import steps as steps_lib
from equarx_serve.generation.batching import BatchPolicy, Phase, StepShape
from equarx_serve.generation.detokenizer import Detokenizer
from equarx_serve.generation.engine import StepEngine
from equarx_serve.generation.events import ErrorEvent, FinishedEvent, FinishReason, TokenEvent
from equarx_serve.generation.kv_cache import SlotTable
from equarx_serve.generation.prefill import length_buckets
from equarx_serve.generation.runner import CacheLost, FatalRunnerError, StepOutput
from equarx_serve.generation.sampling import SamplingBatch, SamplingParams
from equarx_serve.generation.steps import DecodeStep, PrefillStep, ReleaseStep, StopStep
from equarx_serve.generation.text import byte_tokenizer
from models.config import get_config

CONFIG = get_config("tiny")  # vocab 512, embed_dim 64, 6 layers
VOCAB = CONFIG.vocab_size
TOKENIZER = byte_tokenizer(VOCAB)
EOS = TOKENIZER.eos_id


def fake_engine(all_reduce="psum", tp=2, max_length=64, dtype=jnp.bfloat16):
    """What the policy and the step engine read of a PrefillEngine."""
    buckets = length_buckets(max_length)
    return types.SimpleNamespace(
        config=CONFIG,
        tp=tp,
        dtype=jnp.dtype(dtype),
        all_reduce=get_all_reduce(all_reduce) if isinstance(all_reduce, str) else all_reduce,
        max_length=max_length,
        bucket_for=lambda n: next(b for b in buckets if b >= n),
    )


# -- sampling ------------------------------------------------------------------------------------
def test_sampling_batch_bounds_values_before_the_device():
    rows = [
        (SamplingParams(temperature=1.0, top_k=2**40, seed=-1), 3),
        (SamplingParams(temperature=1.0, top_k=5, seed=2**40 + 7), 0),
        None,
    ]
    batch = SamplingBatch.for_rows(rows, VOCAB)
    assert batch.top_k == (VOCAB, 5, 0)  # a k beyond the vocabulary keeps every token
    assert batch.seeds == (0xFFFFFFFF, 7, 0)  # the low 32 bits
    assert batch.steps == (3, 0, 0)
    assert (batch.mode, batch.max_k) == ("top_k", VOCAB)


@pytest.mark.parametrize(
    "params, mode, max_k",
    [
        ([SamplingParams()], "greedy", 0),
        ([SamplingParams(), SamplingParams(temperature=0.5)], "temperature", 0),
        ([SamplingParams(temperature=0.5, top_k=3)], "top_k", 4),
        ([SamplingParams(temperature=0.5, top_k=33), SamplingParams(top_k=100)], "top_k", 64),
        ([SamplingParams(temperature=0.5, top_k=3, top_p=0.9)], "top_p", 0),
    ],
)
def test_sampling_mode_is_the_cheapest_program_for_the_rows(params, mode, max_k):
    """Greedy rows never need sampling; top-k widths are powers of two (few programs)."""
    batch = SamplingBatch.for_rows([(p, 0) for p in params], VOCAB)
    assert (batch.mode, batch.max_k) == (mode, max_k)


def test_sampling_batch_survives_a_json_round_trip():
    batch = SamplingBatch.for_rows([(SamplingParams(temperature=0.7, top_p=0.5), 4), None], VOCAB)
    step = DecodeStep((1, 0), (9, 0), batch)
    assert steps_lib.decode(steps_lib.encode(step)) == step


# -- detokenizer ---------------------------------------------------------------------------------
def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_bos=False)


def _feed(detok: Detokenizer, ids: list[int]) -> tuple[str, bool]:
    streamed, stopped = "", False
    for i, token in enumerate(ids):
        delta = detok.add(token, last=i == len(ids) - 1)
        streamed += delta.text
        if delta.stopped:
            stopped = True
            break
    return streamed, stopped


def test_detokenizer_streams_everything_without_stop_strings():
    ids = _ids("hello world")
    detok = Detokenizer(TOKENIZER)
    assert _feed(detok, ids) == ("hello world", False)
    assert detok.tokens == ids and detok.text == "hello world"


def test_stop_string_is_cut_and_never_streamed_even_across_tokens():
    detok = Detokenizer(TOKENIZER, stop=("o w",))
    streamed, stopped = _feed(detok, _ids("hello world"))
    assert stopped and streamed == "hell" == detok.text
    assert TOKENIZER.decode(detok.tokens) == "hell"


def test_possible_stop_prefix_is_held_back_then_released():
    detok = Detokenizer(TOKENIZER, stop=("xyz",))
    deltas = [detok.add(t).text for t in _ids("ax")]
    assert "".join(deltas) == "a" and detok.unsent() == "x"  # "x" may begin "xyz"
    assert detok.add(_ids("b")[0]).text == "xb"  # it did not


def test_incomplete_utf8_is_held_back():
    ids = _ids("é!")  # byte pieces: 0xC3 0xA9, then "!"
    detok = Detokenizer(TOKENIZER)
    assert detok.add(ids[0]).text == ""  # half a character
    rest = "".join(detok.add(t, last=t == ids[-1]).text for t in ids[1:])
    assert rest == "é!"


# -- batch padding and all-reduce accounting -----------------------------------------------------
@pytest.mark.parametrize(
    "lengths, rows, bucket",
    [([5], 2, 16), ([5, 9, 3], 4, 16), ([40], 2, 64), ([5] * 5, 8, 16)],
)
def test_prefill_shape(lengths, rows, bucket):
    shape = BatchPolicy(fake_engine()).prefill_shape(lengths)
    assert shape == StepShape(Phase.PREFILL, rows, bucket)


def test_long_prompts_are_prefilled_without_padding_rows():
    policy = BatchPolicy(fake_engine(max_length=512))
    assert policy.prefill_shape([200]) == StepShape(Phase.PREFILL, 1, 256)
    assert policy.prefill_shape([200, 3, 3]) == StepShape(Phase.PREFILL, 4, 256)


def test_decode_shape_has_at_least_two_rows():
    policy = BatchPolicy(fake_engine())
    assert policy.decode_shape(1).rows == 2 and policy.decode_shape(5).rows == 5


def test_a_decode_step_computes_the_caches_first_rows_up_to_the_last_running_slot():
    policy = BatchPolicy(fake_engine())
    rows = [policy.running_decode_shape(last, 8).rows for last in range(8)]
    assert rows == [2, 2, 4, 4, 8, 8, 8, 8]
    assert policy.running_decode_shape(2, 3).rows == 3  # never more than the cache has
    with pytest.raises(ValueError, match="not one of 8 rows"):
        policy.running_decode_shape(8, 8)


@pytest.mark.parametrize("weights", ["gguf", "auto"])
def test_decode_on_gguf_blocks_runs_one_row_for_one_request(weights):
    """Every decode matmul a native kernel there (and "auto" runs 1-row steps on the blocks):
    no 2-row padding for XLA's GEMV."""
    policy = BatchPolicy(types.SimpleNamespace(**vars(fake_engine()), weights=weights))
    rows = [policy.running_decode_shape(last, 8).rows for last in range(8)]
    assert rows == [1, 2, 4, 4, 8, 8, 8, 8]


def test_traffic_counted_by_hand():
    """psum on CPU sends f32 (XLA widens bf16) in a ring: 2 (N-1)/N of the operand, per
    message, 2 messages per layer."""
    policy = BatchPolicy(fake_engine("psum", tp=2))
    traffic = policy.traffic(StepShape(Phase.PREFILL, 2, 16))
    elements = 2 * 16 * 64
    assert traffic.shape == (2, 16, 64) and traffic.count == 12
    assert traffic.message_bytes == elements * 2  # bf16
    assert traffic.wire_bytes == 12 * (2 * 1 * elements * 4 // 2)
    assert traffic.uses == "psum"


def test_traffic_says_when_the_size_gate_sends_messages_to_psum():
    gated = BatchPolicy(fake_engine(get_all_reduce("equarx-int8", min_size_bytes=4096)))
    small = gated.traffic(StepShape(Phase.DECODE, 2, 1))  # 256 B messages
    large = gated.traffic(StepShape(Phase.PREFILL, 2, 16))  # 4 KiB messages
    assert small.uses == "psum (size gate)" and large.uses == "equarx-int8"
    usage = gated.usage(batch=1, prompt_len=10)
    assert usage.min_size_bytes == 4096
    assert usage.prefill.shape == (2, 16, 64) and usage.decode.shape == (2, 1, 64)


# -- slots ---------------------------------------------------------------------------------------
def test_slot_table():
    table: SlotTable[str] = SlotTable(slots=2, rows=3)
    table.capacity = 16
    assert table.free() == [0, 1]
    table.assign(1, "b", length=5)
    table.set_next_token(1, 42)
    table.advance(1, 43)
    assert table.running() == [(1, "b")] and table.free() == [0]
    assert table.decode_inputs() == ([0, 43, 0], [0, 6, 0])
    with pytest.raises(ValueError, match="taken"):
        table.assign(1, "c", length=1)
    with pytest.raises(ValueError, match="capacity"):
        table.assign(0, "c", length=16)
    table.release(1)
    assert table.decode_inputs() == ([0, 0, 0], [0, 0, 0]) and table.free() == [0, 1]


# -- step messages -------------------------------------------------------------------------------
def test_steps_round_trip_and_garbage_is_refused():
    sampling = SamplingBatch.for_rows([(SamplingParams(), 0), None], VOCAB)
    for step in (
        PrefillStep(((2, 5, 6), (2, 5, 6)), (0, 2), 2, 32, sampling),
        DecodeStep((7, 0), (4, 0), sampling),
        ReleaseStep(),
        StopStep(),
    ):
        assert steps_lib.decode(steps_lib.encode(step)) == step
    for garbage in (b"{}", b'{"kind": "format-disk"}', b"not json", b'{"kind": "decode"}'):
        with pytest.raises(ValueError, match="not a step"):
            steps_lib.decode(garbage)


# -- the step engine on a scripted runner --------------------------------------------------------
def next_token(sequence: list[int]) -> int:
    """The scripted model: the next token of a sequence (EOS now and then)."""
    value = (sum(sequence) * 31 + 7 * len(sequence)) % 97
    return EOS if value == 0 else 300 + value


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    """The tokens a request gets by itself (EOS not included)."""
    sequence, out = list(prompt), []
    for _ in range(max_tokens):
        token = next_token(sequence)
        if token == EOS:
            break
        out.append(token)
        sequence.append(token)
    return out


class ScriptedRunner:
    """Runs steps on per-row sequences with `next_token`, checking the engine's bookkeeping
    (lengths, last tokens, cache rows) as a device would need it."""

    def __init__(self, engine):
        self.engine = engine
        self.sequences: dict[int, list[int]] = {}
        self.steps: list = []
        self.fail_next: Exception | None = None
        self.cache = None  # (rows, capacity)

    def run(self, step):
        self.steps.append(step)
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        if isinstance(step, PrefillStep):
            if self.cache is None or self.cache[0] != step.cache_rows:
                self.cache, self.sequences = (step.cache_rows, step.capacity), {}
            self.cache = (step.cache_rows, max(step.capacity, self.cache[1]))
            tokens = []
            for prompt, slot in zip(step.prompts, step.slots, strict=True):
                assert len(prompt) <= self.cache[1]
                if slot < step.cache_rows:
                    self.sequences[slot] = list(prompt)
                tokens.append(next_token(list(prompt)))
            return StepOutput(np.array(tokens, np.int32))
        if isinstance(step, DecodeStep):
            # the cache's first rows, a power of two of them (or all), covering every running slot
            rows = len(step.tokens)
            assert self.cache is not None and rows <= self.cache[0]
            assert rows == self.cache[0] or rows & (rows - 1) == 0, rows
            tokens = []
            for row, (token, length) in enumerate(zip(step.tokens, step.lengths, strict=True)):
                if length == 0:  # idle
                    tokens.append(0)
                    continue
                sequence = self.sequences[row]
                assert length == len(sequence) < self.cache[1], (row, length, len(sequence))
                sequence.append(token)
                tokens.append(next_token(sequence))
            return StepOutput(np.array(tokens, np.int32))
        self.cache, self.sequences = None, {}
        return StepOutput(np.zeros(0, np.int32))


def make_engine(slots=2, **kwargs) -> tuple[StepEngine, ScriptedRunner]:
    runner = ScriptedRunner(fake_engine(**kwargs))
    records: list = []
    engine = StepEngine(
        runner, tokenizer=TOKENIZER, slots=slots, stop_token_ids=[EOS], on_step=records.append
    )
    engine.records = records
    return engine, runner


def run_all(engine: StepEngine) -> dict:
    """Steps until done; every request's events in order."""
    events: dict = {}
    while engine.has_unfinished:
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    return events


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[2, *rng.integers(7, 250, size=n - 1).tolist()] for n in lengths]


def test_continuous_batching_gives_every_request_its_own_tokens():
    """Seven requests on 2 slots, different lengths and max_tokens: each gets exactly the
    tokens it gets alone, its text streams in full, and it ends with the right reason."""
    engine, runner = make_engine(slots=2)
    prompts = prompts_of((3, 9, 4, 17, 6, 12, 2), seed=1)
    max_tokens = (5, 20, 1, 8, 30, 3, 12)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(i, prompt, SamplingParams(max_tokens=n))
    events = run_all(engine)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        *tokens, finished = events[i]
        assert isinstance(finished, FinishedEvent)
        expected = alone(prompt, n)
        assert finished.completion.tokens == expected == [t.token for t in tokens]
        assert "".join(t.text for t in tokens) + finished.unsent == finished.completion.text
        reason = FinishReason.LENGTH if len(expected) == n else FinishReason.STOP
        assert finished.completion.finish_reason == reason
    assert isinstance(runner.steps[-1], ReleaseStep) and runner.cache is None


def test_admission_is_first_come_first_served_into_free_slots():
    engine, runner = make_engine(slots=2)
    for i, n in enumerate((4, 1, 3)):
        engine.add_request(i, [2, 50 + i], SamplingParams(max_tokens=n))
    engine.step()
    first = runner.steps[0]
    assert first.prompts[:2] == ((2, 50), (2, 51)) and first.slots == (0, 1)
    # Request 1 finished at its first token: its slot is free for request 2, at the next step.
    assert engine.num_waiting == 1 and engine.num_running == 1 and engine.room == 0
    engine.step()
    assert isinstance(runner.steps[1], PrefillStep) and runner.steps[1].slots[0] == 1


def test_prefill_pads_to_the_policys_shape_and_records_the_step():
    engine, runner = make_engine(slots=4)
    for i in range(3):
        engine.add_request(i, [2, 60, 61 + i], SamplingParams(max_tokens=2))
    engine.step()
    step = runner.steps[0]
    assert len(step.prompts) == 4 and step.prompts[3] == step.prompts[0]  # a padding copy
    assert step.slots == (0, 1, 2, 4)  # the padding row goes out of range (dropped)
    assert step.sampling.steps == (0, 0, 0, 0)
    [record] = engine.records
    assert record.shape == StepShape(Phase.PREFILL, 4, 16) and record.requests == 3
    assert record.traffic == engine.policy.traffic(record.shape)


def test_cache_capacity_covers_every_known_request_and_grows():
    engine, runner = make_engine(slots=2, max_length=256)
    engine.add_request("a", [2] * 5, SamplingParams(max_tokens=5))
    engine.add_request("b", [2] * 5, SamplingParams(max_tokens=20))
    engine.step()
    assert runner.steps[0].capacity == 32  # bucket of 5 + 20
    engine.add_request("c", [2] * 30, SamplingParams(max_tokens=70))
    run_all(engine)
    capacities = [s.capacity for s in runner.steps if isinstance(s, PrefillStep)]
    assert capacities == [32, 128]


def test_abort_waiting_and_running_requests():
    engine, runner = make_engine(slots=1)
    engine.add_request("a", [2, 9], SamplingParams(max_tokens=50))
    engine.add_request("b", [2, 8], SamplingParams(max_tokens=50))
    engine.step()
    waiting = engine.abort("b")
    assert waiting.completion.finish_reason == FinishReason.CANCELLED
    assert waiting.completion.tokens == [] and engine.num_waiting == 0
    engine.step()
    running = engine.abort("a")
    assert running.completion.finish_reason == FinishReason.CANCELLED
    assert len(running.completion.tokens) == 2
    assert engine.abort("a") is None and not engine.has_unfinished
    assert isinstance(runner.steps[-1], ReleaseStep)


def test_bad_requests_are_refused_before_they_reach_a_batch():
    engine, _ = make_engine(max_length=64)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request(1, [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(1, [2, VOCAB], SamplingParams())
    with pytest.raises(ValueError, match="maximum context of 64"):
        engine.add_request(1, [2] * 40, SamplingParams(max_tokens=30))
    engine.add_request(1, [2, 5], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already here"):
        engine.add_request(1, [2, 5], SamplingParams(max_tokens=4))


def test_a_failed_prefill_fails_only_its_requests():
    engine, runner = make_engine(slots=2)
    engine.add_request("a", [2, 9], SamplingParams(max_tokens=8))
    engine.step()
    engine.add_request("b", [2, 8], SamplingParams(max_tokens=8))
    runner.fail_next = RuntimeError("out of memory")
    [error] = engine.step()
    assert isinstance(error, ErrorEvent) and error.request_id == "b"
    assert "out of memory" in error.message
    events = run_all(engine)
    assert events["a"][-1].completion.tokens == alone([2, 9], 8)


def test_a_failed_decode_fails_every_running_request():
    engine, runner = make_engine(slots=2)
    for name in "ab":
        engine.add_request(name, [2, ord(name)], SamplingParams(max_tokens=8))
    engine.step()
    runner.fail_next = RuntimeError("device lost")
    errors = engine.step()
    assert {e.request_id for e in errors} == {"a", "b"}
    assert all(isinstance(e, ErrorEvent) for e in errors) and not engine.has_unfinished
    engine.add_request("c", [2, 3], SamplingParams(max_tokens=2))
    assert engine.step()  # the engine serves on


def test_a_prefill_that_lost_the_cache_fails_the_running_requests_too():
    engine, runner = make_engine(slots=3)
    for name in "cd":
        engine.add_request(name, [2, ord(name)], SamplingParams(max_tokens=8))
    engine.step()
    engine.add_request("e", [2, 5], SamplingParams(max_tokens=2))
    runner.fail_next = CacheLost("insert failed")
    errors = engine.step()
    assert {e.request_id for e in errors} == {"c", "d", "e"} and not engine.has_unfinished


def test_a_fatal_runner_error_propagates():
    engine, runner = make_engine()
    engine.add_request("a", [2, 9], SamplingParams(max_tokens=4))
    runner.fail_next = FatalRunnerError("process 1 exited")
    with pytest.raises(FatalRunnerError):
        engine.step()


def test_decode_rows_follow_the_running_requests_not_the_slots():
    """On 8 slots, one request decodes 2 rows; five at once decode 8; once only the first
    is left, 2 again; every request still gets the tokens it gets alone."""
    engine, runner = make_engine(slots=8)
    engine.add_request("solo", [2, 40], SamplingParams(max_tokens=3))
    run_all(engine)
    decodes = [s for s in runner.steps if isinstance(s, DecodeStep)]
    assert decodes and {len(s.tokens) for s in decodes} == {2}
    assert {r.shape.rows for r in engine.records if r.shape.phase == Phase.DECODE} == {2}
    runner.steps.clear()
    engine.add_request(0, [2, 41], SamplingParams(max_tokens=12))
    for i in range(1, 5):
        engine.add_request(i, [2, 41 + i], SamplingParams(max_tokens=2))
    events = run_all(engine)
    rows = [len(s.tokens) for s in runner.steps if isinstance(s, DecodeStep)]
    assert rows[0] == 8 and rows[-1] == 2, rows
    for i in range(5):
        tokens = [e.token for e in events[i] if isinstance(e, TokenEvent)]
        assert tokens == alone([2, 41 + i], 12 if i == 0 else 2)


def test_decode_steps_sample_each_row_with_its_own_step_count():
    engine, runner = make_engine(slots=3)
    params = SamplingParams(max_tokens=6, temperature=0.5, seed=11)
    engine.add_request("a", [2, 9], params)
    engine.step()
    engine.step()
    engine.add_request("b", [2, 8], dataclasses.replace(params, seed=12))
    engine.step()  # b's prefill
    engine.step()  # a decode step for both
    decode = runner.steps[-1]
    assert isinstance(decode, DecodeStep)
    assert decode.sampling.steps == (2, 1) and decode.sampling.seeds == (11, 12)  # rows 0, 1
    assert decode.sampling.mode == "temperature"
    assert [isinstance(e, TokenEvent) for e in engine.step()]
