"""A plan: the rows of one forward call, as plain data the runner turns into tensors.

Rows come in groups: a group is a contiguous position range [start, end) of one request
at one depth. Every row of a group writes its K/V into the group's depth plane and attends
causally to that plane of its request over positions [0, position]. A group at the last
depth may end with a sample: the head runs on its last row and the sampled token goes to
the request's device-side next-token cell, which a later plan's depth-0 row embeds without
the CPU ever reading it (`token_ids is None`). Block speculation adds two kinds: a draft
sample at the draft depth (the candidate goes to the cell and the request's draft
buffer, never to the host) and a verification (the head runs on every row, acceptance
runs on the device, the accepted tokens and the correction go to the host).
"""

from __future__ import annotations

import dataclasses

from specloop.sampling_params import SamplingParams


@dataclasses.dataclass
class RowGroup:
    request_id: str
    incarnation: int
    arrival: int  # identifies the request object (its sampling generator)
    req_slot: int
    depth: int
    start: int
    end: int
    token_ids: list[int] | None  # depth 0: prompt ids for [start, end); None: the device next-token cell
    hidden_slots: list[int]  # token slot of each row
    block_table: list[int]  # pages of this depth's plane covering [0, end)
    plane_slots: list[list[int]]  # [plane][row]: flat KV slot of each row in every plane
    sample: SamplingParams | None = None  # sample from the last row's final state
    sample_index: int = -1  # which sample of the request this is (0-based)
    draft_index: int = -1  # >= 0: a draft sample (block speculation): candidate number
    verify: bool = False  # the group's rows are a speculation round's verification
    candidate_index: int = -1  # >= 0: verify the single candidate there (token pipeline)
    controlled: bool = False  # the speculation controller must see this sample's commit

    @property
    def num_rows(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class Plan:
    ticket_id: int
    groups: list[RowGroup]
    adaptive_exit: bool

    @property
    def num_rows(self) -> int:
        return sum(g.num_rows for g in self.groups)

    @property
    def samples(self) -> list[RowGroup]:
        """Groups whose result goes to the host: plain samples and verifications."""
        return [g for g in self.groups if g.sample is not None and g.draft_index < 0]

    @property
    def drafts(self) -> list[RowGroup]:
        return [g for g in self.groups if g.draft_index >= 0]
