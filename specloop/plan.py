"""A plan: the rows of one forward call, as plain data (no torch) that the runner turns
into one forward batch.

Rows come in groups: a group is a contiguous position range [start, end) of one request
that runs `loops` consecutive loops from `depth` (depths depth .. depth + loops - 1) in the
call. At each of those depths every row writes its K/V into that depth's plane and
attends causally to the plane over positions [0, position]. Multi-loop groups are how
the CPU prepares one plan per token (a plain decode token runs loops 1..R in one call, a
verification d+1..R); groups of one loop return to the scheduler after each loop (a
wavefront prefill, a token pipeline). A group ends in a head, run after its last loop,
one of:

- `None`: the rows only advance (a prompt chunk, a token between loops);
- `Sample`: the head runs on the last row and samples the request's next token, which
  goes to the host and to the request cell (a later depth-0 row embeds it from there
  without the CPU reading it: `token_ids is None`);
- `Draft`: the last row, at the draft depth, drafts a candidate into the request cell
  and the request's draft buffer, never to the host;
- `Verify`: a round's k+1 rows at full depth check the k drafted candidates; the
  accepted ones and a correction (or bonus) token go to the host;
- `VerifyCandidate`: one row at full depth checks one drafted candidate (a token
  pipeline's oldest live token checks the next).

A group at a sparse loop of token-sparse prefill (`window` set) covers one prompt window
[start, end) logically but runs only `window.rows` of the tokens the window keeps at that
depth; which ones is decided on the device (the runner scores the window when the first
of its groups runs), so its rows' positions and token slots are filled in there.

The scheduler is the plan's one writer; controllers describe the groups they want and
the scheduler builds them.
"""

from __future__ import annotations

import dataclasses

from specloop.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Sample:
    params: SamplingParams
    index: int  # which output token of the request (0-based)
    controlled: bool = False  # a speculation controller owns the request and sees the commit


@dataclasses.dataclass(frozen=True)
class Draft:
    params: SamplingParams
    position: int  # entry of the request's draft buffer that receives the candidate


@dataclasses.dataclass(frozen=True)
class Verify:
    params: SamplingParams
    index: int  # output index of the first token the verification emits
    num_candidates: int  # k: rows 0..k check draft buffer entries 0..k-1


@dataclasses.dataclass(frozen=True)
class VerifyCandidate:
    params: SamplingParams
    index: int  # output index of the token it emits
    position: int  # the draft buffer entry holding the candidate

    num_candidates = 1


@dataclasses.dataclass(frozen=True)
class SparseWindow:
    """A window's rows at a sparse loop: ranks [first, first + rows) of the `budget` tokens it
    keeps there, in position order. The group with first == 0 selects them (and makes the
    others inherit their previous-loop K/V); the one reaching `budget` completes the window."""

    budget: int
    first: int
    rows: int
    inherit_table: list[int]  # pages of the previous depth's plane covering [0, end)

    @property
    def completes(self) -> bool:
        return self.first + self.rows == self.budget


Head = Sample | Draft | Verify | VerifyCandidate | None
HOST_HEADS = (Sample, Verify, VerifyCandidate)  # heads whose tokens go to the host


@dataclasses.dataclass(frozen=True)
class RecordUpdate:
    """INT4 residual group records of one request the device learns with this plan:
    `tables[plane]` names the records of groups first, first + 1, ...; `fresh`: the
    request's cell starts over (its rows, maps and records are reset first); `truncate`:
    speculation rolled back, so rows at positions >= it are dropped before anything else.
    `first[plane]`: planes grow by different counts (token-sparse planes hold fewer rows).
    `adopt`: the request starts with that many positions of cached prefix pages
    (`adopt_tables[plane]`, their pages) whose rows and groups its planes take and encode
    first (prefix caching)."""

    fresh: bool
    first: list[int]
    tables: list[list[int]]
    truncate: int | None = None  # rejected candidates: rows at positions >= it leave every plane first
    adopt: int = 0
    adopt_tables: list[list[int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RowGroup:
    request_id: str
    incarnation: int
    arrival: int  # identifies the request object (its sampling draws)
    cell: int  # the request cell: per-request device state (next token, draft buffer)
    depth: int
    start: int
    end: int
    token_ids: list[int] | None  # depth 0: prompt ids for [start, end); None: the request cell
    token_slots: list[int]  # token slot of each row
    page_table: list[int]  # pages of this depth's plane covering [0, end)
    deeper_tables: list[list[int]] = dataclasses.field(default_factory=list)  # the pages of planes
    # depth+1.. covering [0, end): those its later loops write and read (loops > 1) and, with
    # adaptive exit, every deeper plane (where an exiting token's K/V is inherited)
    head: Head = None
    loops: int = 1  # consecutive loops the rows run in this call
    window: SparseWindow | None = None  # a sparse loop of token-sparse prefill (token_slots: the window's)
    records: RecordUpdate | None = None  # INT4 residual records the device has not seen yet
    decode_from: int = 2**62  # the request's first generated position (its prompt's length): rows at or
    # past it are generated-token queries (sparse decode attention's sources and corrections)

    @property
    def num_rows(self) -> int:
        return self.window.rows if self.window is not None else self.end - self.start

    @property
    def completes(self) -> bool:
        """Whether the group's positions [start, end) are done at its depths after it runs."""
        return self.window is None or self.window.completes

    @property
    def last_depth(self) -> int:
        """The depth of the group's last loop (where its head reads the rows)."""
        return self.depth + self.loops - 1

    @property
    def cost(self) -> int:
        """Row-loops: what the group spends of a plan's budget."""
        return self.num_rows * self.loops


@dataclasses.dataclass(frozen=True)
class ReleaseScan:
    """INT4 residuals: one request's tail pages the device checks after the call: from
    `released[plane]` leading pages on, those whose every position is read reconstructed by
    any query of that plane's depth at or past `frontiers[plane]`."""

    kv_key: str  # the request's residency (a preempted request's next one has another)
    cell: int
    frontiers: list[int]
    released: list[int]
    committed: int  # rows at positions below it are committed (their groups may seal); past it: candidates


@dataclasses.dataclass
class Plan:
    ticket_id: int
    groups: list[RowGroup]
    adaptive_exit: bool
    releases: list[ReleaseScan] = dataclasses.field(default_factory=list)
    # prompt blocks this plan finishes at the last depth, for the prefix cache once its ticket is
    # back: (request cell, first position, one page per plane)
    cached_blocks: list[tuple[int, int, tuple[int, ...]]] = dataclasses.field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return sum(g.num_rows for g in self.groups)

    @property
    def num_entering(self) -> int:
        """Tokens that enter the loops in this call (prompt positions, new tokens, drafts): the
        call's tokens as vLLM counts an iteration's."""
        return sum(g.num_rows for g in self.groups if g.depth == 0)

    @property
    def host_groups(self) -> list[RowGroup]:
        """Groups whose tokens go to the host, in plan order (one result each)."""
        return [g for g in self.groups if isinstance(g.head, HOST_HEADS)]
