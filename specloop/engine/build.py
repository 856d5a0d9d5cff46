"""The composition root: the one module that names every FlashLoop feature.

`build` sizes and wires the engine's parts for one configuration: the KV budget and its
page pool, token slots, the scheduler, the KV storage, the attention backend, the forward
batch, the runner (with CUDA graphs), and the snapshotter with every part's share of a
request snapshot. Each FlashLoop feature (`specloop.flashloop.*`) sizes itself (device
bytes outside the page pool, token slots, the forward batch's integers, its share of the
byte budget) and brings its parts; the core modules it wires name none of them. With
tensor parallelism every rank's parts are wired here (`build_rank`), rank 0's in this
process and the others' in their worker processes.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from specloop.engine.config import EngineConfig
from specloop.engine.executor import Executor
from specloop.engine.snapshot import CellPart, KVPagesPart, SlotsPart, Snapshotter
from specloop.engine.tensor_parallel import ShardedPagesPart, TensorParallelRunner, WorkerSetup, Workers
from specloop.errors import ConfigError, SpecloopError
from specloop.flashloop.config import summary as group_summary
from specloop.flashloop.kv_residual.feature import KVResidualFeature
from specloop.flashloop.sparse_decode.feature import SparseDecodeFeature
from specloop.flashloop.token_sparse_prefill.feature import TokenSparsePrefillFeature
from specloop.model.ouro import OuroModel
from specloop.parallel.shard import check_divisible, shard_model
from specloop.pipeline.heads import SpeculationHeads, Verifier
from specloop.pipeline.rounds import RoundController
from specloop.pipeline.token_pipeline import TokenPipeline
from specloop.runtime.attention import backend_name, make_backend
from specloop.runtime.feature import Absent, Feature, Sizing
from specloop.runtime.forward_batch import ForwardBatchBuilder
from specloop.runtime.graphs import DEFAULT_BUCKETS, LoopGraphs
from specloop.runtime.kv_format import PagedKV
from specloop.runtime.runner import Runner
from specloop.runtime.slot_storage import SlotStorage
from specloop.scheduling.kv_manager import KVManager
from specloop.scheduling.prefix_cache import PrefixCache, identity_salt
from specloop.scheduling.request import Request
from specloop.scheduling.scheduler import Scheduler

log = logging.getLogger(__name__)
CPU_KV_BYTES = 256 << 20  # default KV budget on CPU; SPECLOOP_CPU_KV_BYTES overrides it (tests: 32 MiB)
CPU_KV_ENV = "SPECLOOP_CPU_KV_BYTES"
CUDA_ACTIVATION_RESERVE = 4 << 30  # bytes of free GPU memory kept out of the KV pool


@dataclasses.dataclass
class EngineParts:
    """What `build` wires for `EngineCore`."""

    kv: KVManager
    scheduler: Scheduler
    backend: Any
    executor: Executor
    speculation: RoundController | TokenPipeline | None
    speculation_heads: SpeculationHeads | None
    snapshots: Snapshotter
    features: list[Any]  # the FlashLoop features' device halves (`DeviceFeature`), as the runner calls them
    num_pages: int
    page_bytes: int
    graphed: bool


def build(config: EngineConfig, model: OuroModel, device: torch.device, max_model_len: int, threshold: float,
          verifier: Verifier | None, swap_out: Callable[[Request], None],
          swap_in: Callable[[Request], bool]) -> EngineParts:
    """`swap_out` / `swap_in`: the engine's halves of swap preemption (the scheduler calls them).

    With `tensor_parallel_size` N > 1 this process is rank 0: it starts ranks 1..N-1
    (`tensor_parallel.Workers`), each of which wires the same parts through `build_rank`
    from the same configuration, with the KV budget fixed to rank 0's so that every rank
    sizes the same pool; rank 0's runner hands each plan to them before running it."""
    size = config.tensor_parallel_size
    if size == 1:
        return build_rank(config, model, device, max_model_len, threshold, verifier, swap_out, swap_in)
    check_divisible(model.config, size)  # before any process starts
    workers = Workers(size, device)
    try:
        state = model.state_dict()
        shard = shard_model(state, model.config, 0, size, workers.group.all_reduce, device)
        if config.num_kv_pages is None:  # read once, here, after rank 0's shard took its memory
            config = dataclasses.replace(config, kv_cache_bytes=KVBudget(config, device).total())
        workers.setup(WorkerSetup(config, {k: v.cpu() for k, v in state.items()}, model.config, max_model_len,
                                  threshold, verifier, build_rank))
        parts = build_rank(config, shard, device, max_model_len, threshold, verifier, swap_out, swap_in)
        workers.wait_ready()
    except BaseException:
        workers.close()
        raise
    parts.executor = Executor(TensorParallelRunner(parts.executor.runner, workers))
    return parts


def build_rank(config: EngineConfig, model: OuroModel, device: torch.device, max_model_len: int, threshold: float,
               verifier: Verifier | None, swap_out: Callable[[Request], None],
               swap_in: Callable[[Request], bool]) -> EngineParts:
    """One rank's parts for `model` (with tensor parallelism, the rank's shard, whose
    `model.config` has the local heads: the KV pages, backend and features size themselves
    for them)."""
    mcfg = model.config
    page_bytes = PagedKV.page_bytes(mcfg.num_hidden_layers, config.block_size, mcfg.num_key_value_heads,
                                    mcfg.head_dim, model.dtype)
    rows = config.max_num_batched_tokens
    num_token_slots = (mcfg.num_loops + config.max_inflight_tickets + 1) * rows
    speculation = _speculation(config, mcfg.num_loops)
    triton = backend_name(config.attention_backend, device) == "triton"
    s = Sizing(config, mcfg, max_model_len, model.dtype, device, speculation, triton)
    config.token_sparse_prefill.check(mcfg.num_loops)
    features = [_make(cls, config, s) for cls in FEATURES if cls.enabled(config)]
    budget = KVBudget(config, device)
    decode_slots = sum(f.decode_slots() for f in features)
    num_pages = budget.pages(page_bytes, sum(f.reserved_bytes() for f in features), features)
    heads: dict[type, Any] = {}
    if speculation is not None:
        # A round verifies k+1 rows in one call and a pipeline advances up to R live
        # tokens together; each request may hold that many slots twice (a guessed round).
        per_request = speculation.rows_per_request
        if rows < per_request:
            raise ConfigError(f"max_num_batched_tokens ({rows}) must be at least {per_request} for "
                              f"{config.speculation} speculation with these settings")
        if not decode_slots:  # (with sparse decode its generated tokens take decode slots)
            num_token_slots += 2 * per_request * config.max_num_seqs
        heads = SpeculationHeads(config.max_num_seqs, speculation.draft_width, mcfg.vocab_size,
                                 model.dtype, device, verifier).registry()
    general_slots = num_token_slots  # prompt windows take general slots only
    num_token_slots += decode_slots  # slots [0, decode_slots): generated tokens' (sparse decode attention)
    kv = KVManager(mcfg.num_loops, config.block_size, num_pages, page_bytes)
    for f in features:
        f.attach_kv(kv, num_pages, budget.total)
    prompts = [p for p in (f.prompts() for f in features) if p is not None]
    assert len(prompts) <= 1, "one feature plans prompts"
    prefix_cache, salt = None, ""
    if config.prefix_caching:
        prefix_cache = kv.cache = PrefixCache(kv.allocator, mcfg.num_loops, config.block_size)
        salt = identity_salt(prefix_identity(config, model, backend_name(config.attention_backend, device), threshold))
    scheduler = Scheduler(kv, mcfg.num_loops, rows, config.max_num_seqs, num_token_slots,
                          adaptive_exit=threshold < 1.0, speculation=speculation,
                          preemption_mode=config.preemption_mode, prompts=prompts[0] if prompts else None,
                          decode_slots=decode_slots, prefix_cache=prefix_cache, prefix_salt=salt)
    scheduler.swap_out, scheduler.swap_in = swap_out, swap_in
    # One page past the KV manager's: the sink padding rows of a CUDA graph write.
    shape = (mcfg.num_hidden_layers, num_pages + 1, config.block_size, mcfg.num_key_value_heads, mcfg.head_dim,
             model.dtype, device)
    formats = [k for k in (f.kv_format(shape) for f in features) if k is not None]
    assert len(formats) <= 1, "one feature stores the keys"
    store = formats[0] if formats else PagedKV(*shape)
    rows_attention = [r for r in (f.row_attention() for f in features) if r is not None]
    assert len(rows_attention) <= 1, "one feature replaces rows' attention"
    backend = make_backend(config.attention_backend, store, device, mcfg.num_attention_heads,
                           mcfg.num_key_value_heads, rows_attention[0] if rows_attention else None)
    # (CUDA graphs of all-reduces across ranks are not captured yet: tensor parallelism runs eagerly)
    graphed = (device.type == "cuda" and backend.name == "triton" and not config.enforce_eager
               and config.tensor_parallel_size == 1)
    buckets = tuple(b for b in DEFAULT_BUCKETS if b <= rows) if graphed else ()
    batch_parts = [p for p in (f.batch_part(general_slots, num_token_slots) for f in features) if p is not None]
    batches = ForwardBatchBuilder(rows, config.max_num_seqs, mcfg.num_loops, -(-max_model_len // config.block_size),
                                  config.block_size, device, tile_rows=backend.tile_rows, buckets=buckets,
                                  pad_slot=num_token_slots, parts=batch_parts,
                                  contiguous_min_rows=backend.contiguous_min_rows)
    slots = SlotStorage(num_token_slots + 1, mcfg.hidden_size, model.dtype, device,
                        keep_previous=any(f.keeps_previous() for f in features))
    devices = [d for d in (f.device(slots, store) for f in features) if d is not None]  # in the order they run
    runner = Runner(model, backend, batches, slots, config.max_num_seqs, threshold, config.seed, heads, devices)
    if graphed:
        runner.use_graphs(LoopGraphs(runner.run_pass, batches, mcfg.hidden_size, model.dtype, threshold < 1.0,
                                     mcfg.num_key_value_heads, max_model_len, num_pages, device, store))
    speculation_heads = next(iter(heads.values())) if heads else None
    draft = (speculation_heads.draft_tokens, speculation_heads.draft_probs) if speculation_heads else None
    on = {type(f): f for f in features}
    pages = KVPagesPart(kv, store) if config.tensor_parallel_size == 1 else ShardedPagesPart()
    parts = [pages, SlotsPart(runner.slots), CellPart(runner.next_token, draft)]
    parts += [on[cls].snapshot_part(kv, store) if cls in on else Absent(cls.snapshot_key, cls.option)
              for cls in FEATURES if cls.snapshot_key is not None]
    snapshots = Snapshotter(fingerprint(config, model, store.name, threshold), config.summary(), scheduler, parts)
    return EngineParts(kv, scheduler, backend, Executor(runner), speculation, speculation_heads, snapshots, devices,
                       num_pages, page_bytes, graphed)


# The FlashLoop features, in the order their halves run (device halves, batch parts).
FEATURES = (KVResidualFeature, TokenSparsePrefillFeature, SparseDecodeFeature)


def _make(cls: type, config: EngineConfig, s: Sizing) -> Feature:
    """A feature from its configuration group (INT4 residuals also read token-sparse
    prefill's: its sparse planes hold fewer rows)."""
    if cls is KVResidualFeature:
        return cls(config.kv_residual_quantization, config.token_sparse_prefill, s)
    return cls(getattr(config, cls.option), s)


def fingerprint(config: EngineConfig, model: OuroModel, kv_format: str, threshold: float) -> dict[str, Any]:
    """What a restoring engine must share with the snapshotting one for exact resumption."""
    spec = config.speculation
    return {
        "model": model.config.to_hf_dict(),
        "dtype": str(model.dtype),
        "kv_format": kv_format,
        "block_size": config.block_size,
        "exit_threshold": threshold,
        "speculation": spec,
        "draft_loops": config.draft_loops if spec != "none" else None,
        "num_speculative_tokens": config.num_speculative_tokens if spec == "block" else None,
        "seed": config.seed,
        "token_sparse_prefill": group_summary(config.token_sparse_prefill),
        # (tail_share sizes the pool, like num_kv_pages: a snapshot moves between pool sizes)
        "kv_residual_quantization": {k: v for k, v in group_summary(config.kv_residual_quantization).items()
                                     if k != "tail_share"},
        "sparse_decode_attention": group_summary(config.sparse_decode_attention),
    }


def prefix_identity(config: EngineConfig, model: OuroModel, backend: str, threshold: float) -> dict[str, Any]:
    """The prefix cache's identity (`identity_salt`): what a prompt block's KV depends on
    besides its tokens, so that differently configured engines never share a block: the
    model (as named and its shape), dtype, attention backend (kernels round differently),
    page size, loops, the exit threshold in force, and the effective FlashLoop groups."""
    return {
        "model": str(config.model),
        "model_config": model.config.to_hf_dict(),
        "dtype": str(model.dtype),
        "attention_backend": backend,
        "block_size": config.block_size,
        "num_loops": model.config.num_loops,
        "exit_threshold": float(threshold),
        "token_sparse_prefill": group_summary(config.token_sparse_prefill),
        "sparse_decode_attention": group_summary(config.sparse_decode_attention),
        "kv_residual_quantization": group_summary(config.kv_residual_quantization),
    }


class KVBudget:
    """The bytes for KV storage: `kv_cache_bytes`, or what the device leaves (read once,
    before any KV storage is allocated)."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self._bytes: int | None = None

    def total(self) -> int:
        if self._bytes is None:
            self._bytes = self._read()
        return self._bytes

    def _read(self) -> int:
        cfg = self.config
        if cfg.kv_cache_bytes is not None:
            return cfg.kv_cache_bytes
        if self.device.type == "cuda":
            gc.collect()  # an earlier engine's pool (its graphs hold a reference cycle) goes first
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            # Leave room for activations (a 1 GiB reserve measured 22% slower decode on an
            # H200 than this one; allocator retries are the suspected cause, not profiled).
            return int(free * cfg.gpu_memory_utilization) - CUDA_ACTIVATION_RESERVE
        return _cpu_kv_bytes()

    def pages(self, page_bytes: int, reserved: int, features: list[Feature]) -> int:
        """Pages of the KV pool: `num_kv_pages`, or what the byte budget holds after `reserved`
        bytes a feature keeps outside the pool (sparse decode attention's reference state):
        all of it, or the pages a feature's `split` of it leaves them (INT4 residuals: the
        rest holds their records; one feature splits)."""
        cfg = self.config
        if cfg.num_kv_pages is not None:
            return cfg.num_kv_pages
        budget = self.total() - reserved
        if budget <= 0:
            raise SpecloopError(f"the KV budget of {self.total()} bytes leaves no room for pages after "
                                f"{reserved} bytes of sparse decode reference state; lower max_num_seqs or "
                                f"max_model_len")
        splits = [p for p in (f.split(budget, page_bytes) for f in features) if p is not None]
        assert len(splits) <= 1, "one feature shares the byte budget with the pages"
        pages = splits[0] if splits else budget // page_bytes
        if pages < 1:
            raise SpecloopError(f"the KV budget of {budget} bytes holds no page of {page_bytes} bytes")
        return pages


def _cpu_kv_bytes() -> int:
    """The default KV budget on CPU: $SPECLOOP_CPU_KV_BYTES, else CPU_KV_BYTES (read per engine)."""
    text = os.environ.get(CPU_KV_ENV)
    if text is None:
        return CPU_KV_BYTES
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{CPU_KV_ENV} must be a positive number of bytes, got {text!r}")
    return int(text)


def _speculation(config: EngineConfig, num_loops: int) -> RoundController | TokenPipeline | None:
    """The speculation controller the configuration asks for."""
    if config.speculation == "none":
        return None
    if not 1 <= config.draft_loops < num_loops:
        raise ConfigError(f"draft_loops must lie in 1..{num_loops - 1} for a {num_loops}-loop "
                          f"model, got {config.draft_loops}")
    if config.speculation == "block":
        return RoundController(num_loops, config.draft_loops, config.num_speculative_tokens)
    return TokenPipeline(num_loops, config.draft_loops)
