"""Sampling parameters, with vLLM's ``SamplingParams`` field names and meanings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.structured_output import StructuredOutputsParams

MAX_LOGPROBS = 20
# Temperatures below this are greedy: dividing logits by a tiny temperature overflows to inf and
# the sampling distribution to NaN (vLLM uses the same threshold).
GREEDY_EPSILON = 1e-5


@dataclass
class SamplingParams:
    """How to pick output tokens for one request.

    ``temperature`` 0 is greedy. ``top_k`` 0 or -1 and ``top_p`` 1 disable those filters. ``seed``
    gives the request its own random stream, so its output does not depend on batch neighbours.
    ``logprobs`` N returns the chosen token's logprob and the top-N per output position (of the raw
    logits, as vLLM's default); ``prompt_logprobs`` N the same for every prompt position after the first.
    Before a token is chosen (greedy too): ``logit_bias`` (token id -> added to its logit), then the
    penalties: ``repetition_penalty`` (> 1 discourages every token already in the prompt or output:
    positive logits divided by it, negative ones multiplied), ``frequency_penalty`` (subtracted once per
    occurrence in the output) and ``presence_penalty`` (subtracted once if in the output). When sampling,
    ``min_p`` drops tokens less likely than ``min_p`` times the most likely one (after temperature).
    ``structured_outputs`` constrains the output to a grammar (a JSON schema, a regex, a choice...):
    tokens it does not allow next are masked out before the choice (``engine.structured_output``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n must be 1 (parallel sampling is not supported), got {self.n}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0 < self.repetition_penalty <= 2 ** 16 \
                or not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for t, b in (self.logit_bias or {}).items():
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (>= 0), got {t!r}")
            if not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for token {t}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stop_list = stops

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def changes_logits(self) -> bool:
        """Whether a bias or a penalty applies before the token is chosen."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list
