"""`equarx-serve bench compare` on the tiny random-init model (TP = 2 fake devices), with a fake
llama.cpp side where one is needed: the workloads each side runs and in what order, the
report and its JSON, the model's FLOP count (by hand), the machine limits' arithmetic, what
happens without llama-cpp-python, and the llama.cpp side's batching against a fake C API (the
real one on the real GGUF when llama-cpp-python is installed). Never timings."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from equarx_serve import cli
from equarx_serve.bench import compare, served
from equarx_serve.collectives.registry import parse_method
from equarx_serve.generation.generator import Completion
from models.config import get_config

TINY = compare.CompareConfig(
    model="tiny",
    all_reduce=parse_method("psum"),
    seq_lens=(16, 32),
    batches=(1, 2),
    max_tokens=3,
    repeats=2,
    matmul_size=64,
    read_mib=1,
)


class FakeSide:
    """Stands in for llama.cpp: records its calls; a prefill of n tokens "takes" n ms and a
    decode step of a batch of B takes 10 ms (values, not timings: the report must carry them)."""

    name = "fake llama.cpp"

    def __init__(self, calls: list[tuple[str, str, int]]):
        self.calls = calls
        self.closed = False

    def prefill(self, tokens):
        self.calls.append((self.name, "prefill", len(tokens)))
        return len(tokens) / 1e3

    def decode(self, prompt, batch, max_tokens):
        self.calls.append((self.name, "decode", batch))
        return compare.DecodeRun(batch, batch * (max_tokens - 1), 0.01 * (max_tokens - 1))

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """One run with the fake beside the project; the project's calls are recorded too."""
    calls: list[tuple[str, str, int]] = []
    fakes: list[FakeSide] = []

    def factory(config, engine, context):
        assert context >= max(config.seq_lens)
        fakes.append(FakeSide(calls))
        return fakes[-1]

    original = compare.ProjectSide

    class RecordedProject(original):
        def prefill(self, tokens):
            calls.append(("project", "prefill", len(tokens)))
            return super().prefill(tokens)

        def decode(self, prompt, batch, max_tokens):
            calls.append(("project", "decode", batch))
            return super().decode(prompt, batch, max_tokens)

    def fake_servers(config, generator, tokenizer, gguf, llama_skipped):
        calls.append(("servers", "serve", len(config.serve_clients)))
        assert generator.max_batch == 1 and gguf is None and llama_skipped is None
        levels = [SERVED_LEVEL, dataclasses.replace(SERVED_LEVEL, server=served.LLAMA_SERVER)]
        return served.ServedComparison(levels, 20.0, None, 200)

    path = tmp_path_factory.mktemp("compare") / "compare.json"
    compare.ProjectSide, compare.compare_servers = RecordedProject, fake_servers
    try:
        config = dataclasses.replace(TINY, json_path=path, serve_clients=(1,))
        assert compare.run(config, llama=factory) == 0
    finally:
        compare.ProjectSide, compare.compare_servers = original, served.compare_servers
    return json.loads(path.read_text()), calls, fakes[0]


SERVED_LEVEL = served.ServedLevel(
    server=served.PROJECT, clients=1, requests=8, errors=0, output_tokens=512, wall_s=16.0,
    latency_p50_s=2.0, latency_p99_s=2.5, ttft_p50_s=0.1, ttft_p99_s=0.2,
    stream_decode_tokens_per_s=19.0,
)  # fmt: skip


def test_every_workload_runs_on_both_sides_interleaved(compared):
    _, calls, fake = compared
    assert calls.pop() == ("servers", "serve", 1)  # after the in-process sides
    workloads = [("prefill", 16), ("prefill", 32), ("decode", 1), ("decode", 2)]
    per_round = 2 * len(workloads)
    assert len(calls) == (TINY.repeats + 1) * per_round  # a warm-up round, then the timed ones
    for r in range(TINY.repeats + 1):
        done = calls[r * per_round : (r + 1) * per_round]
        assert [(kind, size) for _, kind, size in done[::2]] == workloads
        assert [(kind, size) for _, kind, size in done[1::2]] == workloads
        firsts = {side for side, _, _ in done[::2]}
        # The warm-up and the first timed round start with the project, the next with the fake.
        assert firsts == ({"fake llama.cpp"} if r == 2 else {"project"})
    assert fake.closed


def test_report_carries_both_sides_values(compared):
    report, _, _ = compared
    project, fake = report["settings"]["sides"]
    assert project.startswith("this project (TP=2") and fake == "fake llama.cpp"
    assert report["settings"]["llama_cpp_skipped"] is None
    rows = {(r["workload"], r["side"]): r for r in report["rows"]}
    assert len(rows) == 8
    for n in (16, 32):
        assert rows[f"prefill {n}", fake]["median_ms"] == pytest.approx(n)
        assert rows[f"prefill {n}", project]["median_ms"] > 0
        assert len(rows[f"prefill {n}", project]["times_ms"]) == TINY.repeats
    for b in (1, 2):
        assert rows[f"decode batch {b}", fake]["tokens_per_s"] == pytest.approx(100 * b)
        ours = rows[f"decode batch {b}", project]
        assert ours["tokens_per_s"] > 0
        assert ours["tokens_per_s_per_sequence"] == pytest.approx(ours["tokens_per_s"] / b)
        for run in ours["runs"]:
            # Greedy on the tiny model may stop at EOS; never more than max_tokens - 1 a row.
            assert run["batch"] == b and 0 < run["tokens"] <= b * (TINY.max_tokens - 1)


def test_serving_comparison_is_reported(compared, capsys):
    report, _, _ = compared
    assert report["settings"]["serve_clients"] == [1]
    levels = report["served"]["levels"]
    assert [x["server"] for x in levels] == [served.PROJECT, served.LLAMA_SERVER]
    assert levels[0]["output_tokens_per_s"] == pytest.approx(512 / 16.0)
    assert report["served"]["generate_decode_tokens_per_s"] == 20.0


def test_serving_table():
    both = served.ServedComparison(
        [SERVED_LEVEL, dataclasses.replace(SERVED_LEVEL, server=served.LLAMA_SERVER, wall_s=32.0)],
        20.0, None, 200,
    )  # fmt: skip
    text = "\n".join(served.format_served(both))
    assert "A: equarx-serve, B: llama-cpp-python server" in text
    assert "32.0     16.0  2.00x" in text  # tokens/s: 512 / 16 s vs 512 / 32 s
    assert "decode 19.0 tokens/s vs the Generator's 20.0 on the same prompts" in text
    assert "0.95x" in text
    alone = served.ServedComparison([SERVED_LEVEL], 20.0, "no server here", 200)
    text = "\n".join(served.format_served(alone))
    assert "B: skipped: no server here" in text and "x  " not in text.split("\n")[-2]


def test_server_commands_carry_the_model_flags():
    config = dataclasses.replace(TINY, weights="gguf", dtype="float32")
    command = served.project_command(config, 8123)
    flags = {"--weights": "gguf", "--all-reduce": "psum", "--tp": "2", "--dtype": "float32"}
    for flag, value in (flags | {"--port": "8123", "--model": "tiny"}).items():
        assert command[command.index(flag) + 1] == value
    llama = served.llama_server_command(Path("/m.gguf"), "gemma3-270m", 3, 8124)
    assert llama[1:3] == ["-m", "llama_cpp.server"]
    assert llama[llama.index("--n_threads") + 1] == "3"
    assert llama[llama.index("--model_alias") + 1] == "gemma3-270m"


def test_machine_limits_are_reported(compared):
    report, _, _ = compared
    machine = report["machine"]
    assert set(machine["matmul_gflops"]) == {"float32", "bfloat16"}
    assert all(v > 0 for v in machine["matmul_gflops"].values()) and machine["read_gb_s"] > 0
    limits = report["limits"]
    assert limits["prefill 16"]["flops"] == compare.prefill_flops(get_config("tiny"), 16)
    assert limits["prefill 32"]["floor_ms"] > limits["prefill 16"]["floor_ms"] > 0
    assert limits["decode batch 2"]["ceiling_tokens_per_s"] > 0
    assert "ceiling_gguf_tokens_per_s" not in limits["decode batch 1"]  # no GGUF: random init


def test_prefill_flops_by_hand():
    """tiny: D 64, F 128, N 4, K 2, H 16, V 512, 6 layers (5 local, window 8, then global).
    Matrices a layer: q 4*64*16 + kv 2*2*64*16 + out 4*16*64 + gating 2*128*64 + linear
    128*64 = 36864. At 16 tokens: 2 * 6 * 36864 * 16 = 7077888; attention 2 * 2 * (N H = 64)
    * keys, keys = 5 * (1+...+8 + 8*8) + (1+...+16) = 636: 162816; head 2 * 512 * 64 = 65536."""
    assert compare.prefill_flops(get_config("tiny"), 16) == 7077888 + 162816 + 65536


def test_limits_arithmetic():
    machine = compare.MachineLimits({"float32": 100.0, "bfloat16": 50.0}, 10.0, 2048, 256)
    assert machine.prefill_floor_ms(2e9) == pytest.approx(20.0)  # at the faster, 100 GFLOP/s
    # 1 GB a step at 10 GB/s: 10 steps/s; batch 8 needs 8 * 1 GFLOP at 100 GFLOP/s: 0.08 s.
    assert machine.decode_ceiling(1e9, 1e9, 1) == pytest.approx(10.0)
    assert machine.decode_ceiling(1e9, 1e9, 8) == pytest.approx(8 / 0.1)
    assert machine.decode_ceiling(1e9, 1e9, 64) == pytest.approx(64 / 0.64)  # FLOP-bound


def test_decode_run_from_completions():
    def done(ttft, decode_ms, rate):
        return Completion([2], [5, 6], "", "length", 1.0, ttft, decode_ms, rate)

    run = compare.decode_run_from_completions([done(100.0, 400.0, 10.0), done(120.0, 300.0, 10.0)])
    assert run == compare.DecodeRun(batch=2, tokens=4 + 3, seconds=0.4, first_sequence=(5, 6))
    assert run.tokens_per_s == pytest.approx(7 / 0.4)


def test_without_llama_cpp_python_it_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    engine = types.SimpleNamespace(info={"gguf_path": "/nowhere/model.gguf"})
    config = dataclasses.replace(TINY, model="gemma3-270m")
    reason = compare.open_llama_cpp(config, engine, 4096)
    assert reason == f"llama-cpp-python is not installed: {compare.INSTALL_HINT}"
    assert "packaged gemma3-270m GGUF only" in compare.open_llama_cpp(TINY, engine, 4096)


def test_cli_runs_the_project_alone_when_llama_cpp_cannot(tmp_path, capsys):
    path = tmp_path / "compare.json"
    argv = ["bench", "compare", "--model", "tiny", "--all-reduce", "psum", "--seq-lens", "16"]
    argv += ["--batches", "1", "--max-tokens", "2", "--repeats", "1", "--json", str(path)]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "llama.cpp skipped: llama.cpp runs beside the packaged gemma3-270m GGUF" in err
    assert "prefill, one prompt" in out and "decode, greedy" in out
    report = json.loads(path.read_text())
    assert len(report["settings"]["sides"]) == 1 and len(report["rows"]) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-lens", "5000"], "at most 4096"),
        (["--max-tokens", "1"], "must be an integer >= 2"),
        (["--batches", "0"], "must be an integer >= 1"),
        (["--all-reduce", "nope"], "unknown all-reduce 'nope'"),
        (["--checkpoint", "/x"], "--checkpoint and --tokenizer go together"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "compare", "--model", "tiny", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# -- The llama.cpp side against a fake C API -----------------------------------------------------


class FakeLlamaCpp(types.ModuleType):
    """The parts of llama-cpp-python's C API that `LlamaCppSide` calls. Its "model" predicts
    the token after t as t + 1; it checks that every sequence's positions run 0, 1, 2, ...
    without gaps and records each sequence's tokens and every `llama_decode` batch."""

    VOCAB = 1000
    __version__ = "fake"

    def __init__(self):
        super().__init__("llama_cpp")
        self.sequences: dict[int, list[int]] = {}
        self.batches: list[list[tuple[int, int, int, bool]]] = []
        self.context = None
        self.status = 0
        self._logits = (ctypes.c_float * self.VOCAB)()

    def llama_backend_init(self):
        pass

    def llama_model_default_params(self):
        return types.SimpleNamespace()

    def llama_model_load_from_file(self, path, params):
        return 1

    def llama_context_default_params(self):
        return types.SimpleNamespace(n_batch=512, n_ubatch=512)

    def llama_init_from_model(self, model, params):
        self.context = params
        return 1

    def llama_model_get_vocab(self, model):
        return 1

    def llama_vocab_n_tokens(self, vocab):
        return self.VOCAB

    def llama_batch_init(self, n_tokens, embd, n_seq_max):
        size = n_tokens
        return types.SimpleNamespace(
            n_tokens=0, token=[0] * size, pos=[0] * size, n_seq_id=[0] * size,
            seq_id=[[0] for _ in range(size)], logits=[False] * size,
        )  # fmt: skip

    def llama_batch_free(self, batch):
        pass

    def llama_free(self, ctx):
        pass

    def llama_model_free(self, model):
        pass

    def llama_get_memory(self, ctx):
        return 1

    def llama_memory_clear(self, memory, data):
        self.sequences = {}

    def llama_synchronize(self, ctx):
        pass

    def llama_decode(self, ctx, batch):
        entries = []
        for i in range(batch.n_tokens):
            token, pos, seq = batch.token[i], batch.pos[i], batch.seq_id[i][0]
            assert batch.n_seq_id[i] == 1
            seen = self.sequences.setdefault(seq, [])
            assert pos == len(seen), f"sequence {seq}: position {pos} after {len(seen)} tokens"
            seen.append(token)
            entries.append((token, pos, seq, bool(batch.logits[i])))
        self.batches.append(entries)
        return self.status

    def llama_get_logits_ith(self, ctx, i):
        row = self.batches[-1][i]
        assert row[3], "logits of a row that did not ask for them"
        values = np.zeros(self.VOCAB, np.float32)
        values[(row[0] + 1) % self.VOCAB] = 1.0
        ctypes.memmove(self._logits, values.ctypes.data, values.nbytes)
        return ctypes.cast(self._logits, ctypes.POINTER(ctypes.c_float))


@pytest.fixture
def fake_llama(monkeypatch):
    fake = FakeLlamaCpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    return fake


def test_llama_side_prefills_in_chunks_with_logits_at_the_end(fake_llama):
    side = compare.LlamaCppSide(Path("m.gguf"), threads=3, context=2048, n_seq_max=2)
    assert fake_llama.context.n_threads == fake_llama.context.n_threads_batch == 3
    assert fake_llama.context.n_batch == 512  # llama.cpp's own default is kept
    assert fake_llama.context.n_seq_max == 2 and fake_llama.context.n_ctx == 2 * 2048
    prompt = list(range(1, 1201))
    assert side.prefill(prompt) >= 0
    assert [len(b) for b in fake_llama.batches] == [512, 512, 176]
    assert [e[3] for b in fake_llama.batches for e in b].count(True) == 1
    assert fake_llama.batches[-1][-1] == (1200, 1199, 0, True)
    side.prefill(prompt[:10])  # the cache is cleared: positions restart at 0
    assert fake_llama.sequences == {0: prompt[:10]}


def test_llama_side_decodes_a_batch_greedily_one_step_per_token(fake_llama):
    side = compare.LlamaCppSide(Path("m.gguf"), threads=2, context=64, n_seq_max=3)
    prompt = [2, 40, 41]
    run = side.decode(prompt, batch=3, max_tokens=4)
    assert run.first_sequence == (42, 43, 44, 45)
    # The fake continues t with t + 1: each sequence is the prompt, then 42, 43, 44 fed back.
    assert fake_llama.sequences == {s: [*prompt, 42, 43, 44] for s in range(3)}
    steps = fake_llama.batches[3:]  # after the three prompts
    assert len(steps) == 3 and all(len(b) == 3 and all(e[3] for e in b) for b in steps)
    assert run.batch == 3 and run.tokens == 3 * 3 and run.seconds >= 0


def test_llama_side_reports_a_failed_decode(fake_llama):
    side = compare.LlamaCppSide(Path("m.gguf"), threads=2, context=64, n_seq_max=1)
    fake_llama.status = 1
    with pytest.raises(RuntimeError, match="llama_decode returned 1"):
        side.prefill([2, 3])


def test_real_llama_cpp_continues_the_quick_brown_fox():
    """With llama-cpp-python installed: the real C API on the packaged GGUF, greedily, gives
    the continuation the project's model gives (README)."""
    pytest.importorskip("llama_cpp")
    from models.cache import load_gemma3_270m, packaged_gguf_path

    path, _ = packaged_gguf_path()
    tokenizer = load_gemma3_270m(verify=False)[1]
    side = compare.LlamaCppSide(path, threads=2, context=128, n_seq_max=2)
    try:
        run = side.decode(tokenizer.encode("The quick brown fox"), batch=2, max_tokens=6)
    finally:
        side.close()
    assert tokenizer.decode(list(run.first_sequence)) == " jumps over the lazy dog."
    assert run.tokens == 2 * 5
