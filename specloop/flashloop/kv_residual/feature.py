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
from specloop.scheduling.kv_manager import KVManager, span_pages


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
        self._device: ResidualDevice | None = None  # `device`
        self.prompt_pages = 0  # the pages one prompt's working set may take (`KVManager.prompt_pages`)
        self.num_records = 0  # records of a byte budget (`split`)
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

    def _record_bytes(self) -> int:
        m = self.s.model
        return PackedResiduals.record_bytes(m.num_hidden_layers, m.num_key_value_heads, m.head_dim)

    def split(self, budget: int, page_bytes: int) -> int:
        """The pages of a byte budget; the rest holds the records (`attach_kv`).

        `tail_share` when given; else derived from the workload the engine is configured for,
        its context length T (or the longest request BF16 pages alone would hold in this
        budget, if shorter) and `max_num_seqs`: one prompt's working set of pages at once
        (`spans` at the prompt chunk `ahead`, which keeps it within a quarter of the budget),
        then the budget shared so that as many requests of T tokens find their decode tails
        (`spans` at one position a plan) in the pages as their groups in the records; and
        never fewer pages than the tails of `max_num_seqs` requests need, while those take at
        most a quarter of the budget (a context length far above the requests served would
        otherwise leave pages for few of them). A lone request of up to T
        tokens always fits both (`KVManager.fits_ever`), so INT4 serves every prompt BF16
        pages would in the same budget."""
        record_bytes = self._record_bytes()
        cfg, planes, bs = self.s.config, self.s.model.num_loops, self.s.config.block_size
        pool = ResidualRecords(planes, 0, record_bytes, self.windows)
        least = self.spans(self._aheads()[-1])

        def alone(t: int) -> int:  # bytes a lone request of t tokens holds at once, at the smallest chunk
            return span_pages(least, t, bs) * page_bytes + pool.records_for(None, t, t) * record_bytes

        # the longest request that fits alone, at most what BF16 pages alone would hold (the
        # spans make that shorter only where they cover most of such a request: tiny budgets)
        longest = min(self.s.max_model_len, budget // (planes * page_bytes) * bs)
        lo, hi = 0, longest
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if alone(mid) <= budget else (lo, mid - 1)
        longest = max(lo, 1)
        records = pool.records_for(None, longest, longest)
        fits = [a for a in self._aheads() if span_pages(self.spans(a), longest, bs) * page_bytes <= budget // 4]
        prompt = span_pages(self.spans(fits[0] if fits else self._aheads()[-1]), longest, bs)
        if self.group.tail_share is not None:
            pages = int(budget * self.group.tail_share) // page_bytes
        else:
            decode = span_pages(self.spans(1), longest, bs)  # a decoding request's tails
            each = decode * page_bytes + records * record_bytes
            room = budget - prompt * page_bytes + decode * page_bytes  # the prompt's request decodes in its own
            n = max(1, min(cfg.max_num_seqs, room // each))
            pages = prompt + (n - 1) * decode
            left = max(0, budget - pages * page_bytes - n * records * record_bytes)
            pages += left * decode * page_bytes // each // page_bytes  # the rest in the same proportion
            # and the tails of every request that may run (shorter ones than T), within a quarter
            every = prompt + (cfg.max_num_seqs - 1) * decode
            pages = max(pages, min(every, budget // 4 // page_bytes,
                                   (budget - records * record_bytes) // page_bytes))  # (T's records stay)
        self.num_records = max(0, budget - pages * page_bytes) // record_bytes
        self.prompt_pages = min(prompt, pages)
        return pages

    def _aheads(self) -> list[int]:
        """Prompt chunks to choose from, largest first: a plan's rows, halved down to one block."""
        rows, bs = self.s.config.max_num_batched_tokens, self.s.config.block_size
        out = [rows]
        while out[-1] > bs:
            out.append(max(bs, out[-1] // 2))
        return out

    @property
    def execution_tail(self) -> int | None:
        """The tail under the execution policy (None: the serial policy)."""
        return self.group.tail if self.group.policy == "execution" else None

    def attach_kv(self, kv: KVManager, num_pages: int, budget: Callable[[], int]) -> None:
        """The planes and their host records (set on `kv`, with its spans) and the forward
        batch's room for their integers; `budget()`: the KV byte budget."""
        cfg, m, s, group = self.s.config, self.s.model, self.s, self.group
        planes, seqs = m.num_loops, cfg.max_num_seqs
        record_bytes = self._record_bytes()
        if cfg.num_kv_pages is not None:
            # a record per 64 positions the pages cover (a request's last one may cover less),
            # and at least one request's at the context length (its pages go back behind its
            # tail, its records stay)
            num_records = max(-(-num_pages * cfg.block_size // RECORD_ROWS) + planes * seqs,
                              planes * (-(-s.max_model_len // RECORD_ROWS) + 1))
            self.prompt_pages = num_pages  # a lone prompt may take them all
        else:  # the rest of the byte budget (`split`)
            num_records = self.num_records
        store = PackedResiduals(m.num_hidden_layers, num_records, seqs, planes, s.max_model_len,
                                m.num_key_value_heads, m.head_dim, group.tail, s.dtype, s.device, group.policy,
                                num_pages + 1 if cfg.prefix_caching else 0, cfg.block_size)
        kv.records = ResidualRecords(planes, num_records, record_bytes, self.windows)
        kv.plane_spans, kv.aheads, kv.prompt_pages = self.spans, tuple(self._aheads()), self.prompt_pages
        groups = -(-(s.max_model_len + cfg.block_size) // RECORD_ROWS)
        # resets, records, truncates, release scans
        self.upload_ints = seqs + 4 * planes * groups * seqs + 2 * seqs + (2 + 2 * planes) * seqs
        if cfg.prefix_caching:  # cached prefixes adopted (a cell's length and offsets, its pages),
            # and the prompt blocks a plan finishes (cell, position, a page per plane; at most a block per row)
            self.upload_ints += (2 + planes) * seqs + planes * -(-s.max_model_len // cfg.block_size) * seqs
            self.upload_ints += (2 + planes) * (cfg.max_num_batched_tokens + seqs)
        self.planes = store

    def spans(self, ahead: int) -> list[int]:
        """Per plane, the most positions a request holds BF16 pages for at once
        (`KVManager.plane_spans`) when a plan enters at most `ahead` prompt positions at depth
        0; tested by tests/test_kv_residual_engine.py.

        A plane's pages go back behind its release frontier less the tail and up to two
        groups (the one the frontier is in, one not sealed yet). A prompt grows its tables
        to its depth-0 frontier plus `ahead`; planned deepest first, each depth advances a
        plan at most as far as the one before it did in the last, so plane p trails depth 0
        by at most (p + 1) x `ahead` (one more than its own lag: with token-sparse prefill a
        plane releases behind the next one too) and at most a plan's rows; the tickets in
        flight delay releases by a plan's advance each past the second. A token-sparse depth
        waits for whole windows, and its groups of rows span more positions. Speculation runs
        at most (tickets in flight + 1) x rows per request past the committed tokens, behind
        which it releases. With prefix caching every plane keeps its prompt pages until the
        deepest plane's ticket that finished them is back."""
        cfg = self.s.config
        rows, inflight, planes = cfg.max_num_batched_tokens, cfg.max_inflight_tickets, self.s.model.num_loops
        extra = self.group.tail + 2 * RECORD_ROWS
        sparse = self.windows
        if sparse.active:  # and a sparse plane's group of 64 rows spans up to 64 / retention prompt positions
            extra += (planes - 1) * sparse.window + math.ceil(RECORD_ROWS / min(sparse.retention))
        if self.s.speculation is not None:
            extra += (inflight + 1) * self.s.speculation.rows_per_request
        spans = [min(rows, (p + 1) * ahead) + max(1, inflight - 1) * ahead + extra for p in range(planes)]
        if cfg.prefix_caching:
            # every plane holds its prompt pages until the deepest finished them and the ticket
            # that did came back (`Scheduler._unpublished`): the deepest plane's span, and the
            # plans in flight past it
            spans = [spans[-1] + (inflight + 1) * ahead] * planes
        return spans

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
        self._device = ResidualDevice(self.planes, cfg.max_num_seqs, cfg.block_size, self.s.device, store)
        return self._device

    def snapshot_part(self, kv: KVManager, store: Any) -> ResidualPart:
        return ResidualPart(kv, kv.records, self.planes, self._batch.forget_backlog, self._device.adopt)
