"""The engine's one immutable configuration, validated at start-up.

Option names follow vLLM where vLLM has the same option. Values discovered at start-up
(the number of KV pages, stop token ids) are passed to the components explicitly and are
never written back here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specloop.errors import ConfigError
from specloop.flashloop.config import (KVResidualQuantization, SparseDecodeAttention, TokenSparsePrefill,
                                      summary as group_summary)

SPECULATION_MODES = ("none", "block", "pipeline")
PREEMPTION_MODES = ("recompute", "swap")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"  # auto: cuda when available
    seed: int = 0
    block_size: int = 16  # tokens per KV page
    num_kv_pages: int | None = None  # explicit KV budget in pages (all planes share one pool)
    kv_cache_bytes: int | None = None  # explicit KV budget in bytes
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of free memory after weights for KV
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 2048  # rows (token, depth) per forward call
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_waiting_requests: int = 1024  # bounded FCFS queue; more is rejected
    max_stop_strings: int = 64  # stop strings one request may give
    max_stop_chars: int = 4096  # characters over all of one request's stop strings
    exit_threshold: float | None = None  # Q-exit threshold; None: the checkpoint's
    max_inflight_tickets: int = 2  # tickets submitted before the oldest is committed
    speculation: str = "none"  # none | block (self-speculation rounds) | pipeline (token pipelines)
    draft_loops: int = 2  # draft depth d: loops 1..d draft, d+1..R verify
    num_speculative_tokens: int = 4  # k: candidates drafted per round
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch (the readable reference) | triton
    enforce_eager: bool = False  # no CUDA graphs (they need CUDA and the triton backend)
    preemption_mode: str = "recompute"  # KV pages ran out: recompute (re-enter its tokens) | swap (snapshot to host)
    enable_prefix_caching: bool | None = None  # share full prompt blocks' KV between requests; unset:
    # on, except with INT4 residuals or a token-sparse window that is not a multiple of block_size
    # (`prefix_caching`, which says why)
    tensor_parallel_size: int = 1  # ranks the model's heads and MLP columns are split over (gloo on CPU, NCCL on CUDA)
    # FlashLoop groups (off by default): a dict, a JSON object string or the group's dataclass.
    token_sparse_prefill: TokenSparsePrefill = dataclasses.field(default_factory=TokenSparsePrefill)
    sparse_decode_attention: SparseDecodeAttention = dataclasses.field(default_factory=SparseDecodeAttention)
    kv_residual_quantization: KVResidualQuantization = dataclasses.field(default_factory=KVResidualQuantization)

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_sparse_prefill", TokenSparsePrefill.parse(self.token_sparse_prefill))
        object.__setattr__(self, "sparse_decode_attention", SparseDecodeAttention.parse(self.sparse_decode_attention))
        object.__setattr__(self, "kv_residual_quantization",
                           KVResidualQuantization.parse(self.kv_residual_quantization))

        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        for name in ("block_size", "num_kv_pages", "kv_cache_bytes", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len", "max_waiting_requests",
                     "max_stop_strings", "max_stop_chars",
                     "max_inflight_tickets", "draft_loops", "num_speculative_tokens", "tensor_parallel_size"):
            positive(name)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                              f"got {self.attention_backend!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                              f"got {self.preemption_mode!r}")
        if self.speculation not in SPECULATION_MODES:
            raise ConfigError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {self.speculation!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.exit_threshold is not None and not 0.0 <= self.exit_threshold <= 1.0:
            raise ConfigError(f"exit_threshold must lie in [0, 1], got {self.exit_threshold}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "float64"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.device, str) or not self.device.split(":")[0] in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        self._check_prefix_caching()
        if self.tensor_parallel_size > 1 and self.preemption_mode == "swap":
            raise ConfigError("preemption_mode 'swap' does not work with tensor_parallel_size > 1 yet (a snapshot "
                              "would hold rank 0's heads of the KV only); use 'recompute'")

    @property
    def prefix_caching(self) -> bool:
        """Whether automatic prefix caching is on: as set, or, unset, on unless it would cost
        more than it saves without a shared prefix (measured: bench/results/prefix_cache_*.json).
        Unset it stays off with INT4 residuals: an INT4 prompt then keeps its BF16 pages at
        every plane until its blocks are offered, giving up the prefill capacity INT4 exists
        for; and off with a token-sparse window that is not a multiple of block_size (only
        whole windows could be shared)."""
        if self.enable_prefix_caching is not None:
            return self.enable_prefix_caching
        tsp = self.token_sparse_prefill
        return not self.kv_residual_quantization.enabled and not (tsp.active and tsp.window % self.block_size)

    def _check_prefix_caching(self) -> None:
        """Prefix caching shares prompt blocks: with token-sparse prefill whole windows of
        them; with INT4 residuals the BF16 pages (each reader encodes its own records)."""
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be true, false or unset, got {self.enable_prefix_caching!r}")
        if not self.enable_prefix_caching:
            return
        tsp = self.token_sparse_prefill
        if tsp.active and tsp.window % self.block_size:
            raise ConfigError(f"enable_prefix_caching with token_sparse_prefill needs a window that is a multiple of "
                              f"block_size ({self.block_size}), got {tsp.window}: only whole windows are shared (a "
                              f"window's selection depends on every token of it)")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        """Build from keyword options; an unknown option is one clear error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine option {unknown[0]!r}; known options: {', '.join(sorted(known - {'model'}))}")
        return cls(model=model, **kwargs)

    def summary(self) -> dict[str, Any]:
        """Every option, for diagnostics and benchmark records (plain JSON data)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["token_sparse_prefill"] = group_summary(self.token_sparse_prefill)
        out["sparse_decode_attention"] = group_summary(self.sparse_decode_attention)
        out["kv_residual_quantization"] = group_summary(self.kv_residual_quantization)
        return out


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """What start-up made of the options left to it (`auto`, unset): discovered values, kept
    beside the configuration, never written back into it."""

    dtype: str  # the model's weights: float32, bfloat16, ...
    device: str  # cpu, cuda:0, ...
    max_model_len: int  # the context length served
    num_kv_pages: int  # the KV pool, all planes together
    kv_page_bytes: int  # one page of one plane, as the KV format stores it
    attention_backend: str  # torch | triton
    cuda_graphs: bool  # loop passes replayed as CUDA graphs
    exit_threshold: float  # the Q-exit threshold in force (1.0: every loop runs)
    prefix_caching: bool  # automatic prefix caching on (`EngineConfig.prefix_caching`)

    def summary(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
