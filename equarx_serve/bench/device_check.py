"""The checks that need an accelerator, in one short run: `scripts/device-check.sh`.

On the first device JAX finds (a GPU or TPU; on a CPU it says so and exits 2):
  1. bits: the compiled Pallas kernel (`block_quantize.accumulate_quantize`, no interpreter)
     against its jnp reference, alone and fed 2 payloads, f32 and bf16 scales, several row
     counts: every int8 code and every scale bit-identical;
  2. speed: the kernel's throughput (bytes it reads and writes per second, its docstring's
     count) beside the device's own copy rate (a jitted `x + 0` of the same bytes, read and
     written), both the median of `--repeats` timed runs after a warm-up;
  3. the engine: a TP = 1 Gemma 3 270M prefill (`PrefillEngine`, `equarx-int8` is moot at
     TP = 1 so `psum`) of `--tokens` tokens, compile time and median latency; real weights
     where the checkpoint package is installed, else the same architecture random-initialised
     (said in the output).
Exit code 0 when every bit check passed, 1 otherwise. Nothing here runs in the test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from equarx_serve.kernels import block_quantize

ROW_COUNTS = (32, 512, 8192)
BLOCK = 32


@dataclasses.dataclass(frozen=True)
class BitCheck:
    rows: int
    received: int
    scale_dtype: str
    mismatched_codes: int
    mismatched_scales: int

    @property
    def ok(self) -> bool:
        return self.mismatched_codes == 0 and self.mismatched_scales == 0


def _median_seconds(fn: Callable[[], jax.Array], repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _inputs(rows: int, received: int, scale_dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    local = jnp.asarray(rng.standard_normal((rows, BLOCK)) * 3, jnp.bfloat16)
    payloads = []
    for k in range(received):
        other = jnp.asarray(rng.standard_normal((rows, BLOCK)) * (k + 1), jnp.float32)
        payloads.append(
            block_quantize.accumulate_quantize_reference(other, scale_dtype=scale_dtype)
        )
    return local, tuple(payloads)


def _bits(a: jax.Array) -> np.ndarray:
    host = np.asarray(a)
    return host.view(np.uint16 if host.dtype.itemsize == 2 else np.uint32)


def check_bits() -> list[BitCheck]:
    checks = []
    for scale_dtype in (jnp.float32, jnp.bfloat16):
        for rows in ROW_COUNTS:
            for received in (0, 2):
                local, payloads = _inputs(rows, received, scale_dtype)
                kernel = block_quantize.accumulate_quantize(
                    local, payloads, interpret=False, scale_dtype=scale_dtype
                )
                reference = jax.jit(
                    block_quantize.accumulate_quantize_reference, static_argnames="scale_dtype"
                )(local, payloads, scale_dtype=scale_dtype)
                (q, s), (q_ref, s_ref) = kernel, reference
                checks.append(
                    BitCheck(
                        rows,
                        received,
                        jnp.dtype(scale_dtype).name,
                        int(np.sum(np.asarray(q) != np.asarray(q_ref))),
                        int(np.sum(_bits(s) != _bits(s_ref))),
                    )
                )
    return checks


def measure_speed(repeats: int, rows: int = 1 << 20) -> tuple[float, float]:
    """(kernel GB/s, copy GB/s) on rows x BLOCK bf16 elements, 2 payloads, bf16 scales."""
    local, payloads = _inputs(rows, 2, jnp.bfloat16)
    kernel = lambda: block_quantize.accumulate_quantize(
        local, payloads, interpret=False, scale_dtype=jnp.bfloat16
    )
    # Bytes read B*s + K*(B + c), written B + c per row (the kernel module's count).
    per_row = BLOCK * 2 + 2 * (BLOCK + 2) + BLOCK + 2
    kernel_gbps = rows * per_row / _median_seconds(kernel, repeats) / 1e9
    copy_source = jnp.zeros((rows * per_row // 4,), jnp.float32)  # the same bytes, read+written
    copy = jax.jit(lambda x: x + 0)
    copy_gbps = 2 * copy_source.nbytes / _median_seconds(lambda: copy(copy_source), repeats) / 1e9
    return kernel_gbps, copy_gbps


def measure_prefill(tokens: int, repeats: int) -> str:
    from equarx_serve.generation.prefill import PrefillEngine

    try:
        engine = PrefillEngine.from_name("gemma3-270m", tp=1, max_length=tokens)
        weights = "real weights"
    except (ImportError, FileNotFoundError) as error:
        from models.config import get_config
        from models.gemma3 import init_params

        weights = f"random-init weights ({type(error).__name__}: {error})"
        params = init_params(get_config("gemma3-270m"), jax.random.PRNGKey(0))
        engine = PrefillEngine(
            get_config("gemma3-270m"), params, tp=1, dtype=jnp.bfloat16, max_length=tokens
        )
    prompt = [[2 + i % 1000 for i in range(tokens)]]
    start = time.perf_counter()
    jax.block_until_ready(engine.prefill(prompt).logits)
    first = time.perf_counter() - start
    median = _median_seconds(lambda: engine.prefill(prompt).logits, repeats)
    return (
        f"prefill gemma3-270m TP = 1, {tokens} tokens, {weights}: first call (compile) "
        f"{first:.2f} s, median {median * 1e3:.1f} ms ({tokens / median:.0f} tokens/s)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
    if device.platform == "cpu":
        print("no accelerator: nothing to check here (the suite covers the CPU)")
        return 2
    checks = check_bits()
    for c in checks:
        status = "ok" if c.ok else "MISMATCH"
        print(
            f"bits rows={c.rows:>5} received={c.received} scales={c.scale_dtype:<8} "
            f"codes differing {c.mismatched_codes}, scales differing {c.mismatched_scales}: "
            f"{status}"
        )
    kernel_gbps, copy_gbps = measure_speed(args.repeats)
    print(
        f"speed: kernel {kernel_gbps:.0f} GB/s, device copy {copy_gbps:.0f} GB/s "
        f"({kernel_gbps / copy_gbps:.2f}x of the copy)"
    )
    print(measure_prefill(args.tokens, max(3, args.repeats // 4)))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
