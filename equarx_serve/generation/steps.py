"""The device steps: plain data that says everything a step does on the mesh.

Process 0 decides each step (`engine.StepEngine`); every process runs it (`runner.DeviceRunner`)
on the same inputs, so a mesh may span processes. A step encodes to JSON (no pickle on the
wire) for the followers (`replicated.py`).

    PrefillStep   prefill padded prompts, copy their KV caches into slots, sample first tokens
    DecodeStep    one token for every row of the cache, then sample
    ReleaseStep   free the KV cache (the engine is idle)
    StopStep      followers leave their loop (the leader is done)
"""

from __future__ import annotations

import dataclasses
import json

from equarx_serve.generation.sampling import SamplingBatch

__all__ = ["DecodeStep", "PrefillStep", "ReleaseStep", "Step", "StopStep", "decode", "encode"]


@dataclasses.dataclass(frozen=True)
class PrefillStep:
    """prompts: the batch's rows (padding rows included); slots: the cache row each row's KV
    goes to (padding rows: `cache_rows`, out of range, dropped). The cache is first made
    `cache_rows` x at least `capacity` positions."""

    prompts: tuple[tuple[int, ...], ...]
    slots: tuple[int, ...]
    cache_rows: int
    capacity: int
    sampling: SamplingBatch


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """tokens and lengths: one per cache row (each row's newest token, and the tokens already
    in its cache)."""

    tokens: tuple[int, ...]
    lengths: tuple[int, ...]
    sampling: SamplingBatch


@dataclasses.dataclass(frozen=True)
class ReleaseStep:
    pass


@dataclasses.dataclass(frozen=True)
class StopStep:
    pass


Step = PrefillStep | DecodeStep | ReleaseStep | StopStep
_KINDS: dict[str, type] = {
    "prefill": PrefillStep,
    "decode": DecodeStep,
    "release": ReleaseStep,
    "stop": StopStep,
}


def encode(step: Step) -> bytes:
    kind = next(k for k, cls in _KINDS.items() if isinstance(step, cls))
    return json.dumps({"kind": kind, **dataclasses.asdict(step)}, separators=(",", ":")).encode()


def decode(data: bytes) -> Step:
    """The step `encode` gave (ValueError for anything else)."""
    try:
        fields = json.loads(data)
        cls = _KINDS[fields.pop("kind")]
        if cls is PrefillStep:
            fields["prompts"] = tuple(tuple(p) for p in fields["prompts"])
        for name in ("slots", "tokens", "lengths"):
            if name in fields:
                fields[name] = tuple(fields[name])
        if "sampling" in fields:
            fields["sampling"] = SamplingBatch.from_dict(fields["sampling"])
        return cls(**fields)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a step message: {e}") from None
