"""A request's state while the step engine runs it."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

from equarx_serve.generation.detokenizer import Detokenizer
from equarx_serve.generation.events import Completion, FinishReason
from equarx_serve.generation.sampling import SamplingParams

__all__ = ["Request"]


@dataclasses.dataclass(eq=False)
class Request:
    """One request: its prompt and settings, its text so far, its timings (seconds, from the
    engine's clock)."""

    request_id: Hashable
    prompt: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    arrived: float
    produced: int = 0  # tokens sampled, EOS included: the sampler's step for the next one
    prefill_ms: float = 0.0
    first_token_at: float | None = None
    slot: int | None = None  # its KV-cache row while it runs

    @property
    def context(self) -> int:
        """The most positions it may need: prompt + max_tokens."""
        return len(self.prompt) + self.params.max_tokens

    def completion(self, reason: FinishReason, now: float) -> Completion:
        first = self.first_token_at
        decode_s = 0.0 if first is None else now - first
        produced = self.produced
        return Completion(
            prompt_tokens=self.prompt,
            tokens=list(self.detokenizer.tokens),
            text=self.detokenizer.text,
            finish_reason=reason,
            prefill_ms=self.prefill_ms,
            time_to_first_token_ms=0.0 if first is None else (first - self.arrived) * 1e3,
            decode_ms=decode_s * 1e3,
            decode_tokens_per_s=(produced - 1) / decode_s if produced > 1 and decode_s else 0.0,
        )
