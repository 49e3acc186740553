"""Runs the device steps (`steps.py`) on a `PrefillEngine`'s mesh.

    runner = DeviceRunner(engine)
    output = runner.run(PrefillStep(...))  # StepOutput: sampled tokens, device ms, the program

Every process of a mesh that spans processes runs the same steps in the same order on the
same inputs: inputs are placed with `jax.make_array_from_callback` (each process supplies the
shards of its own devices) and results are read from a local replica, so nothing here assumes
that every device is addressable.

Programs are compiled ahead of time and cached: prefill per (bucket, rows) by the engine
(`PrefillEngine.compile`), decode per (rows, capacity, sampling mode, top-k width) here
(`decode_program`: the model's decode step with the sampling inside, one program and one
host read a step); a step's output names the program it ran, so its HLO (what it really
sends) can be read. Sampling runs on the vocab-parallel logits: the whole [B, V] never
crosses devices.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from equarx_serve.generation.kv_cache import DeviceKVCache
from equarx_serve.generation.prefill import CompiledPrefill, PrefillEngine
from equarx_serve.generation.sampling import (
    SamplingBatch,
    sampling_input_shapes,
    sampling_inputs,
)
from equarx_serve.generation.steps import DecodeStep, PrefillStep, ReleaseStep, Step, StopStep

__all__ = [
    "CacheLost",
    "CompiledDecode",
    "DeviceRunner",
    "FatalRunnerError",
    "StepOutput",
    "local_value",
]


class FatalRunnerError(RuntimeError):
    """The runner can run no further step (for example a process of its mesh is lost)."""


class CacheLost(RuntimeError):
    """A step failed after the KV cache was given to it: the cache is gone (released), and
    with it every running request's context."""


@dataclasses.dataclass(frozen=True)
class CompiledDecode:
    """One ahead-of-time compiled decode step (sampling included) of the first `rows` rows of a
    cache of `cache_rows` x `capacity`, sampling in `mode` with top-k width `max_k` (see
    `SamplingBatch`)."""

    rows: int
    cache_rows: int
    capacity: int
    mode: str
    max_k: int
    compiled: jax.stages.Compiled

    def hlo_text(self) -> str:
        return self.compiled.as_text()


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """tokens: [rows] int32, each row's sampled token (padding and idle rows included).
    device_ms: the prefill program (prefill), or decode and sampling (decode). program: the
    compiled model program the step ran (None for steps without one)."""

    tokens: np.ndarray
    device_ms: float = 0.0
    program: CompiledPrefill | CompiledDecode | None = None


def local_value(x: jax.Array) -> np.ndarray:
    """A replicated array's value from this process's first device."""
    return np.asarray(x.addressable_data(0))


class DeviceRunner:
    """Executes steps on `engine` (see module doc); holds the KV cache."""

    def __init__(self, engine: PrefillEngine):
        self.engine = engine
        self.cache = DeviceKVCache(engine)
        self._replicated = NamedSharding(engine.mesh, P())
        self._cache_sharding = NamedSharding(engine.mesh, engine.model.cache_spec)
        self._decode_programs: dict[tuple[int, int, int, str, int], CompiledDecode] = {}

    def run(self, step: Step) -> StepOutput:
        """Runs one step. If it fails after the KV cache was donated to a program, the cache is
        released and `CacheLost` raised (the next prefill allocates a new one)."""
        try:
            if isinstance(step, PrefillStep):
                return self._prefill(step)
            if isinstance(step, DecodeStep):
                return self._decode(step)
            if isinstance(step, ReleaseStep | StopStep):
                self.cache.release()
                return StepOutput(np.zeros(0, np.int32))
            raise TypeError(f"not a step: {step!r}")
        except Exception as e:
            if self.cache.arrays is not None or not self.cache.rows:
                raise
            self.cache.release()
            raise CacheLost(f"{type(e).__name__}: {e}") from e

    def place(self, value: np.ndarray) -> jax.Array:
        """A host array replicated on the mesh (every process passes the same value)."""
        return jax.make_array_from_callback(value.shape, self._replicated, lambda i: value[i])

    def decode_program(
        self,
        rows: int,
        capacity: int,
        mode: str = "greedy",
        max_k: int = 0,
        cache_rows: int | None = None,
    ) -> CompiledDecode:
        """The compiled decode step of the first `rows` rows of a cache of `cache_rows` (default
        `rows`) x `capacity`, sampling in `mode` (cached)."""
        key = (rows, cache_rows or rows, capacity, mode, max_k)
        if key not in self._decode_programs:
            engine = self.engine
            config = engine.config
            kv = jax.ShapeDtypeStruct(
                (cache_rows or rows, capacity, config.num_kv_heads, config.head_dim),
                engine.dtype,
                sharding=self._cache_sharding,
            )
            cache = {f"layer_{i}": {"k": kv, "v": kv} for i in range(config.num_layers)}
            ids = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=self._replicated)
            sampling = sampling_input_shapes(rows, self._replicated)
            model, params = engine.decoder(rows)
            step = model.sampling_decoder(mode, max_k)
            compiled = step.lower(params, cache, ids, ids, sampling).compile()
            self._decode_programs[key] = CompiledDecode(*key, compiled)
        return self._decode_programs[key]

    def _prefill(self, step: PrefillStep) -> StepOutput:
        self.cache.ensure(step.cache_rows, step.capacity)
        started = time.perf_counter()
        result = self.engine.prefill([list(p) for p in step.prompts])
        jax.block_until_ready(result)
        device_ms = (time.perf_counter() - started) * 1e3
        tokens = local_value(self._sample(result.logits, step.sampling))
        self.cache.insert(result.cache, self.place(np.asarray(step.slots, np.int32)))
        program = self.engine.compile(result.bucket, len(step.prompts))
        return StepOutput(tokens, device_ms, program)

    def _sample(self, logits: jax.Array, sampling: SamplingBatch) -> jax.Array:
        sampler = self.engine.model.sampler(sampling.mode, sampling.max_k)
        return sampler(logits, sampling_inputs(sampling, self.place))

    def _decode(self, step: DecodeStep) -> StepOutput:
        sampling = step.sampling
        program = self.decode_program(
            len(step.tokens), self.cache.capacity, sampling.mode, sampling.max_k, self.cache.rows
        )
        _, params = self.engine.decoder(len(step.tokens))
        started = time.perf_counter()
        out = program.compiled(
            params,
            self.cache.take(),
            self.place(np.asarray(step.tokens, np.int32)),
            self.place(np.asarray(step.lengths, np.int32)),
            sampling_inputs(sampling, self.place),
        )
        self.cache.put(out.cache)
        tokens = local_value(out.tokens)
        return StepOutput(tokens, (time.perf_counter() - started) * 1e3, program)
