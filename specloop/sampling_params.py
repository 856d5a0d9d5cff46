"""Per-request sampling parameters, validated once when the request arrives.

Names and defaults follow the OpenAI / vLLM request fields so that server requests map
onto them one to one. Every bad value raises `InvalidRequestError` naming the field, so
the server can answer 400 with that field and the engine never sees an invalid request.

Bounds are those of the representation a value is used in, not only of its meaning:
integers must fit the device's int64, floats must be finite in the fp32 the sampler
computes in, and `top_p` must still be above 0 once rounded to fp32 (1e-300 is 0 there,
which would drop every token). Limits that depend on the served model or the engine's
configuration (top_k and token ids against the vocabulary, how many stop strings) are
checked by `EngineCore.add_request`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from specloop.errors import InvalidRequestError

GREEDY_BELOW = 1e-5  # temperatures under this sample as greedy: dividing by them overflows fp32
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FP32_MAX = 3.4028234663852886e38
FP32_TINY = 1.401298464324817e-45  # the smallest positive fp32 (subnormal): anything below rounds to 0


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop.

    After construction `stop` is a tuple of non-empty strings, `stop_token_ids` a tuple,
    `temperature`, `top_p` and `min_p` are floats, and a disabled `top_k` is -1.
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # return the logprob of each chosen token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _require(_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX, "max_tokens", self.max_tokens,
                 "an integer >= 1")
        self._set_float("temperature", lambda t: 0 <= t <= FP32_MAX, "a finite number >= 0 (within fp32)")
        self._set_float("top_p", lambda p: FP32_TINY / 2 < p <= 1, "a number in (0, 1] that is not 0 in fp32")
        self._set_float("min_p", lambda p: 0 <= p <= 1, "a number in [0, 1]")
        _require(_is_int(self.top_k) and -1 <= self.top_k <= INT64_MAX, "top_k", self.top_k,
                 "-1 or 0 (disabled) or an integer >= 1")
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        _require(self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX), "seed",
                 self.seed, "an integer in [-2^63, 2^63) or null")
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids))
        for name in ("ignore_eos", "logprobs", "skip_special_tokens"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")

    @property
    def is_greedy(self) -> bool:
        """Take the most likely token; temperatures below `GREEDY_BELOW` count as 0."""
        return self.temperature < GREEDY_BELOW

    def _set_float(self, name: str, in_range: Callable[[float], bool], expected: str) -> None:
        value = getattr(self, name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        _require(ok and in_range(value), name, value, expected)
        object.__setattr__(self, name, float(value))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise InvalidRequestError(f"{name} must be {expected}, got {shown}", param=name)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    ok = isinstance(items, (list, tuple)) and all(isinstance(s, str) and s for s in items)
    _require(ok, "stop", stop, "a non-empty string or a list of non-empty strings")
    return tuple(items)


def _token_ids(ids: Any) -> tuple[int, ...]:
    ok = isinstance(ids, (list, tuple)) and all(_is_int(i) and 0 <= i <= INT64_MAX for i in ids)
    _require(ok, "stop_token_ids", ids, "a list of non-negative integers")
    return tuple(ids)
