"""How prompt positions are planned: which may enter depth 0 now, and how a request's
prompt moves through the depths (its dense controller).

The scheduler asks a `PromptPlanning` and names no FlashLoop feature: `DensePrompts` plans
every position on its own; token-sparse prefill (`specloop.flashloop.token_sparse_prefill`)
plans a prompt in windows, chosen by the composition root.
"""

from __future__ import annotations

from typing import Protocol

from specloop.scheduling.controller import Controller
from specloop.scheduling.dense import DenseController
from specloop.scheduling.request import Request
from specloop.scheduling.token_slots import TokenSlotPool


class PromptPlanning(Protocol):
    def controller(self, num_loops: int, handoff: Controller | None) -> DenseController:
        """The controller that plans a request until speculation (`handoff`) takes it over."""

    def entry_rows(self, pool: TokenSlotPool, req: Request, start: int, rows: int, may_start: bool) -> int:
        """How many of `rows` positions from `start` can enter depth 0 now (each needs a token
        slot, which this may take). `may_start` False: an older request is waiting for slots
        of a unit this planning takes all at once, and nobody younger may start one."""

    def single_loop(self, req: Request, start: int) -> bool:
        """Whether a row entering at `start` must stop after one loop (it waits for others)."""

    def release_frontiers(self, frontiers: list[int]) -> list[int]:
        """Where a release scan may look per plane, from the planes' frontiers."""

    def stats(self) -> dict[str, int]:
        """Its `EngineStats` fields (token-sparse prefill: `prefill_rows_skipped`)."""

    def shared_prefix(self, req: Request, tokens: int) -> int:
        """How many of the first `tokens` (<= its prompt's) prompt positions a request may
        share with another whose prompt starts the same (prefix caching): a leading span
        whose KV at every depth depends on its own tokens alone, however either prompt goes on."""


class DensePrompts:
    """Every prompt position planned on its own: it enters when a token slot is free."""

    def controller(self, num_loops: int, handoff: Controller | None) -> DenseController:
        return DenseController(num_loops, handoff)

    def entry_rows(self, pool: TokenSlotPool, req: Request, start: int, rows: int, may_start: bool) -> int:
        """Prompt positions from the general pool, then generated ones (a recompute's replay)
        from the decode sub-pool, if there is one."""
        leading = min(rows, max(0, len(req.prompt_ids) - start))
        enter = min(leading, pool.free_for(False))
        if enter < leading:
            return enter
        generated = pool.free_for(True) - (0 if pool.decode_size else enter)
        return enter + min(rows - leading, generated)

    def single_loop(self, req: Request, start: int) -> bool:
        return False

    def release_frontiers(self, frontiers: list[int]) -> list[int]:
        return frontiers

    def stats(self) -> dict[str, int]:
        return {}

    def shared_prefix(self, req: Request, tokens: int) -> int:
        return tokens
