"""The FlashLoop configuration groups: one frozen dataclass per lazy update, all off by
default, each parsed from a dict or a JSON object (the CLI's `--token-sparse-prefill JSON`)
and validated once at start-up with one clear line per problem.

The three groups: `token_sparse_prefill`, `sparse_decode_attention` and
`kv_residual_quantization`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from fractions import Fraction
from typing import Any

from specloop.errors import ConfigError

DEFAULT_RETENTION = (1.0, 1.0, 0.25, 0.10)  # the RFC's starting point for four-loop Ouro
DEFAULT_WINDOW = 512  # tokens; see docs/flashloop.md for the measurements behind it
SCORE_EPS = 1e-6  # the change score's floor on ||h_{r-1}||


@dataclasses.dataclass(frozen=True)
class TokenSparsePrefill:
    """Token-sparse prefill: loops 1-2 dense; before each later loop every complete window
    of `window` prompt tokens (absolute positions [k*window, (k+1)*window)) keeps the
    max(1, ceil(len * retention[loop])) tokens whose hidden state changed most; with
    `keep_last` the prompt's last token is always one of them (it runs every loop, so the
    first generated token comes from its full-depth state, as in the FlashLoop authors' code)."""

    enabled: bool = False
    window: int = DEFAULT_WINDOW
    retention: tuple[float, ...] = DEFAULT_RETENTION
    keep_last: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"token_sparse_prefill.enabled must be true or false, got {self.enabled!r}")
        if not isinstance(self.keep_last, bool):
            raise ConfigError(f"token_sparse_prefill.keep_last must be true or false, got {self.keep_last!r}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ConfigError(f"token_sparse_prefill.window must be a positive integer (tokens), got {self.window!r}")
        retention = self.retention
        if not isinstance(retention, (list, tuple)) or not retention or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) for r in retention):
            raise ConfigError(f"token_sparse_prefill.retention must be a list of numbers, one per loop, got {retention!r}")
        retention = tuple(float(r) for r in retention)
        object.__setattr__(self, "retention", retention)
        if any(not 0.0 < r <= 1.0 for r in retention):
            raise ConfigError(f"token_sparse_prefill.retention values must lie in (0, 1], got {list(retention)}")
        if len(retention) < 2 or retention[0] != 1.0 or retention[1] != 1.0:
            raise ConfigError("token_sparse_prefill.retention must keep loops 1 and 2 dense (1.0, 1.0, ...): the "
                              f"change score needs two completed loops, got {list(retention)}")
        if any(b > a for a, b in zip(retention, retention[1:])):
            raise ConfigError(f"token_sparse_prefill.retention must not increase from loop to loop (the active "
                              f"sets are nested), got {list(retention)}")

    @classmethod
    def parse(cls, value: Any) -> "TokenSparsePrefill":
        """From None (off), a dict, a JSON object string, or an instance. A given group
        without `enabled` is on: `{}` means the defaults, switched on."""
        return _parse_group(cls, "token_sparse_prefill", value)

    @property
    def active(self) -> bool:
        """Whether any loop is sparse (retention 1.0 everywhere takes the dense path)."""
        return self.enabled and any(r < 1.0 for r in self.retention)

    def check(self, num_loops: int) -> None:
        """Start-up checks that need the model."""
        if self.enabled and len(self.retention) != num_loops:
            raise ConfigError(f"token_sparse_prefill.retention has {len(self.retention)} values; the model runs "
                              f"{num_loops} loops")

    def bounds(self, position: int, prompt_len: int) -> tuple[int, int]:
        """The window [start, end) holding prompt `position`: anchored at absolute positions,
        so it never depends on chunking, batching or the request's other tokens; the last
        one ends with the prompt."""
        start = position - position % self.window
        return start, min(start + self.window, prompt_len)

    def sparse(self, depth: int, length: int) -> bool:
        """Whether a window of `length` tokens runs 0-based `depth` on a subset."""
        return depth >= 2 and self.budget(depth, length) < length

    def budget(self, depth: int, length: int) -> int:
        """Tokens a window of `length` keeps at 0-based `depth`: max(1, ceil(length * retention)),
        with the retention read as the decimal it was written as (0.1 is 1/10, exactly)."""
        return max(1, math.ceil(Fraction(repr(self.retention[depth])) * length))


@dataclasses.dataclass(frozen=True)
class SparseDecodeAttention:
    """Sparse decode attention: at loop 2 a generated token's query keeps, per layer and query
    head, the top b = min(n, max(1, ceil(key_retention * n))) of its n causal keys by
    probability, their mass and weighted values and the full output (the reference state);
    at loops 3 and beyond it attends to those keys alone and corrects with that state. Loop 2
    is the reference (the algorithm's contract, not an option). The default keeps a fifth of
    the keys, not the RFC's tenth: on the shipped model that halves the loss cost (+0.71% /
    +0.81% of dense's held-out loss at 1024 / 4000 tokens, against +1.33% / +1.25%) for 1.6%
    of batch-1 decode speed after 8K on an H100 (docs/flashloop.md, the recipe's speed)."""

    enabled: bool = False
    key_retention: float = 0.20

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"sparse_decode_attention.enabled must be true or false, got {self.enabled!r}")
        r = self.key_retention
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0.0 < r <= 1.0:
            raise ConfigError(f"sparse_decode_attention.key_retention must lie in (0, 1] (the share of a query's "
                              f"keys kept at loops 3 and beyond), got {r!r}")
        object.__setattr__(self, "key_retention", float(r))

    @classmethod
    def parse(cls, value: Any) -> "SparseDecodeAttention":
        """From None (off), a dict, a JSON object string, or an instance; `{}` is on with the defaults."""
        return _parse_group(cls, "sparse_decode_attention", value)


RESIDUAL_POLICIES = ("serial", "execution")
RESIDUAL_BITS = 4  # two codes a byte: the only width the codec packs
RESIDUAL_GROUP = 64  # rows of a K group, channels of a V group: the codec's and the kernels' tile


@dataclasses.dataclass(frozen=True)
class KVResidualQuantization:
    """INT4 cross-loop KV residuals: plane 1 stored as an INT4 base, each later plane as an
    INT4 residual against the reconstruction before it, in affine groups of `group_size`
    with FP16 scale and minimum. A group of plane 1 seals `tail` positions after its last
    token (so the recent BF16 tail holds tail to tail + group_size - 1 tokens); before its
    seal a query reads the exact values. `policy` "serial": what a query reads depends only
    on its position (rounds, pipelines and chunked prefill read what serial decoding reads);
    "execution": a group seals at a safe point of the actual execution (the first pass whose
    first query lies `tail` past it), candidates included (a rollback unseals): approximate,
    what a query reads depends on chunking and batching.
    `tail_share`: with a byte budget, the share kept as BF16 pages (the tails, and a prompt's
    positions until its groups seal); the rest holds the packed records. None (the default):
    derived from the workload the engine is configured for, so that as many requests at the
    context length fit in the pages as in the records, beside one prompt's working set
    (`specloop.flashloop.kv_residual.feature.KVResidualFeature.split`)."""

    enabled: bool = False
    bits: int = RESIDUAL_BITS
    group_size: int = RESIDUAL_GROUP
    tail: int = 64
    policy: str = "serial"
    tail_share: float | None = None  # of a byte KV budget (kv_cache_bytes, gpu_memory_utilization); None: derived

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"kv_residual_quantization.enabled must be true or false, got {self.enabled!r}")
        share = self.tail_share
        if share is not None and (not isinstance(share, (int, float)) or isinstance(share, bool)
                                  or not 0.0 < share < 1.0):
            raise ConfigError(f"kv_residual_quantization.tail_share must lie in (0, 1) (the byte budget's share "
                              f"kept as BF16 pages for tails and prompts not sealed yet) or be null (derived from "
                              f"the workload), got {share!r}")
        if self.bits != RESIDUAL_BITS or isinstance(self.bits, bool):
            raise ConfigError(f"kv_residual_quantization.bits must be {RESIDUAL_BITS} (the packed format holds two "
                              f"codes a byte), got {self.bits!r}")
        if self.group_size != RESIDUAL_GROUP or isinstance(self.group_size, bool):
            raise ConfigError(f"kv_residual_quantization.group_size must be {RESIDUAL_GROUP} (the kernels' tile), "
                              f"got {self.group_size!r}")
        if not isinstance(self.tail, int) or isinstance(self.tail, bool) or self.tail < 1:
            raise ConfigError(f"kv_residual_quantization.tail must be a positive integer (tokens), got {self.tail!r}")
        if self.policy not in RESIDUAL_POLICIES:
            raise ConfigError(f"kv_residual_quantization.policy must be one of {', '.join(RESIDUAL_POLICIES)}, "
                              f"got {self.policy!r}")

    @classmethod
    def parse(cls, value: Any) -> "KVResidualQuantization":
        """From None (off), a dict, a JSON object string, or an instance; `{}` is on with the defaults."""
        return _parse_group(cls, "kv_residual_quantization", value)


def _parse_group(cls: type, name: str, value: Any) -> Any:
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{name} must be a JSON object, got {value!r} ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object (or a dict), got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{name} has no option {unknown[0]!r}; its options: {', '.join(sorted(known))}")
    return cls(**{"enabled": True, **value})


def summary(group: Any) -> dict[str, Any]:
    """A group as plain JSON data (lists, not tuples), for diagnostics and records."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(group).items()}
