"""INT4 residuals as a `Feature`: the record pool beside the BF16 pages (its share of a byte
budget), the device planes and the packed KV format over them, their share of the forward
batch, the device half and the snapshot part."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from specloop.errors import ConfigError
from specloop.flashloop.config import KVResidualQuantization, TokenSparsePrefill
from specloop.flashloop.kv_residual.batch import ResidualBatch
from specloop.flashloop.kv_residual.device import ResidualDevice
from specloop.flashloop.kv_residual.format import PackedPlanes
from specloop.flashloop.kv_residual.planes import PackedResiduals
from specloop.flashloop.kv_residual.records import GROUP as RECORD_ROWS, ResidualRecords
from specloop.flashloop.kv_residual.snapshot import ResidualPart
from specloop.runtime.feature import FeatureDefaults, Sizing
from specloop.scheduling.kv_manager import KVManager


class KVResidualFeature(FeatureDefaults):
    option = "kv_residual_quantization"
    snapshot_key = ResidualPart.key

    @staticmethod
    def enabled(config: Any) -> bool:
        return config.kv_residual_quantization.enabled

    def __init__(self, group: KVResidualQuantization, windows: TokenSparsePrefill, s: Sizing) -> None:
        """`windows`: token-sparse prefill's group (its sparse planes hold fewer rows)."""
        self.group, self.windows, self.s = group, windows, s
        self.planes: PackedResiduals | None = None  # `attach_kv`
        self.upload_ints = 0  # the forward batch's room for its integers (`attach_kv`)
        self._batch: ResidualBatch | None = None
        cfg, spec = s.config, s.speculation
        if spec is not None and group.policy == "serial":
            # Candidates never seal, and the host learns what committed one ticket late: a
            # query at a seal must find its group's rows committed, so the tail must outrun the
            # positions the tickets in flight can hold past the committed ones.
            ahead = (cfg.max_inflight_tickets + 1) * spec.rows_per_request
            if group.tail <= ahead:
                raise ConfigError(f"kv_residual_quantization.tail ({group.tail}) must exceed {ahead} with "
                                  f"{cfg.speculation} speculation here ((max_inflight_tickets + 1) x "
                                  f"{spec.rows_per_request} rows a request may run past its committed "
                                  f"tokens): under the serial policy only committed tokens seal")

    def page_share(self) -> float:
        """The share of a byte budget kept as BF16 pages (the rest holds the records)."""
        return self.group.tail_share

    @property
    def execution_tail(self) -> int | None:
        """The tail under the execution policy (None: the serial policy)."""
        return self.group.tail if self.group.policy == "execution" else None

    def attach_kv(self, kv: KVManager, num_pages: int, budget: Callable[[], int]) -> None:
        """The planes and their host records (set on `kv`, with its span limit) and the
        forward batch's room for their integers; `budget()`: the KV byte budget."""
        cfg, m, s, group = self.s.config, self.s.model, self.s, self.group
        planes, seqs = m.num_loops, cfg.max_num_seqs
        record_bytes = PackedResiduals.record_bytes(m.num_hidden_layers, m.num_key_value_heads, m.head_dim)
        if cfg.num_kv_pages is not None:
            # a record per 64 positions the pages cover (a request's last one may cover less),
            # and at least one request's at the context length (its pages go back behind its
            # tail, its records stay)
            num_records = max(-(-num_pages * cfg.block_size // RECORD_ROWS) + planes * seqs,
                              planes * (-(-s.max_model_len // RECORD_ROWS) + 1))
        else:  # the rest of the byte budget, after the BF16 pages' share
            num_records = int(budget() * (1 - group.tail_share)) // record_bytes
        store = PackedResiduals(m.num_hidden_layers, num_records, seqs, planes, s.max_model_len,
                                m.num_key_value_heads, m.head_dim, group.tail, s.dtype, s.device, group.policy)
        kv.records = ResidualRecords(planes, num_records, record_bytes, self.windows)
        kv.span_limit = self.span()
        groups = -(-(s.max_model_len + cfg.block_size) // RECORD_ROWS)
        # resets, records, truncates, release scans
        self.upload_ints = seqs + 4 * planes * groups * seqs + 2 * seqs + (2 + 2 * planes) * seqs
        self.planes = store

    def span(self) -> int:
        """The most positions of one plane a request holds BF16 pages for at once
        (`KVManager.span_limit`), tested by tests/test_kv_residual_engine.py.

        A plane's pages go back behind its release frontier less the tail and up to two
        groups (the one the frontier is in, one not sealed yet). A prompt grows its tables
        to its depth-0 frontier plus one plan's rows, and the deepest plane trails depth 0
        by one plan's rows in a wavefront (a token-sparse depth by one window more, as it
        waits for whole windows, and its groups of rows span more positions); the tickets in
        flight delay releases by a plan each past the second. Speculation runs at most
        (tickets in flight + 1) x rows per request past the committed tokens, behind which
        it releases."""
        cfg = self.s.config
        rows, inflight = cfg.max_num_batched_tokens, cfg.max_inflight_tickets
        span = max(2, inflight) * rows + self.group.tail + 2 * RECORD_ROWS
        sparse = self.windows
        if sparse.active:  # and a sparse plane's group of 64 rows spans up to 64 / retention prompt positions
            span += (self.s.model.num_loops - 1) * sparse.window + math.ceil(RECORD_ROWS / min(sparse.retention))
        if self.s.speculation is not None:
            span += (inflight + 1) * self.s.speculation.rows_per_request
        return span

    def kv_format(self, shape: tuple) -> PackedPlanes:
        return PackedPlanes(*shape, self.planes)

    def batch_part(self, general_slots: int, pad_slot: int) -> ResidualBatch:
        cfg = self.s.config
        max_len = -(-self.s.max_model_len // cfg.block_size) * cfg.block_size
        self._batch = ResidualBatch(self.upload_ints, self.s.model.num_loops, cfg.max_num_seqs, cfg.block_size,
                                    max_len, self.execution_tail)
        return self._batch

    def device(self, slots: Any, store: Any) -> ResidualDevice:
        cfg = self.s.config
        return ResidualDevice(self.planes, cfg.max_num_seqs, cfg.block_size, self.s.device)

    def snapshot_part(self, kv: KVManager, store: Any) -> ResidualPart:
        return ResidualPart(kv, kv.records, self.planes, self._batch.forget_backlog)
