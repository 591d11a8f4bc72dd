"""What a generation is asked for (``SamplingParams``) and what it returns (``Generation``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from contextkit.core.errors import ConfigError
from contextkit.core.plan import ReuseReport


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy (deterministic)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None  # None = the model's EOS tokens
    min_new_tokens: int = 0  # no stop token or stop string ends the answer before this many (vLLM's min_tokens)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(f"min_new_tokens must be in 0..max_new_tokens ({self.max_new_tokens}), "
                              f"got {self.min_new_tokens}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")


@dataclass(frozen=True, slots=True)
class Generation:
    """The result of one request on the built-in engine."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    prefill_ms: float  # time to first token: prefill + first sample
    decode_ms_per_token: float  # mean over tokens after the first (0 if only one)
    reuse: ReuseReport | None = None  # what span reuse did (set by the facade when it assembled spans)


GREEDY_BELOW = 1e-5
