"""Requests and their outputs: plain Python, no torch.

A request's scheduling state is optimistic: it counts work that has been submitted in
tickets but not yet committed, because the executor keeps tickets in flight. What the
user sees (`output_ids`) is only what committed tickets produced.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import Any

from specloop.sampling_params import SamplingParams

_incarnations = itertools.count(1)


def new_incarnation() -> int:
    """A process-wide fresh generation number; results tagged with an older one are stale."""
    return next(_incarnations)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPING = "swapping"  # preempted by swap: no longer planned, its last tickets still in flight
    FINISHED = "finished"


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    num_drafts: int = 0  # speculation rounds
    num_draft_tokens: int = 0  # candidates drafted
    num_accepted_tokens: int = 0  # candidates accepted

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass
class RequestOutput:
    """One incremental update of a request: what is new since the previous update."""

    request_id: str
    text: str  # new text (delta)
    token_ids: list[int]  # new token ids (delta)
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    usage: Usage
    logprobs: list[float] | None = None  # of the new tokens, when requested
    error: str | None = None  # with finish_reason "error": what failed (the engine serves on)
    queue_time: float | None = None  # on the final output: seconds from its add until it was first
    # admitted (None: it never was, or it came from a snapshot)


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # FCFS order
    stop_ids: frozenset[int] = frozenset()  # tokens that end it: stop_token_ids, and eos unless ignore_eos
    incarnation: int = dataclasses.field(default_factory=new_incarnation)
    status: Status = Status.WAITING
    cell: int = -1  # the request cell: index of its device-side state (next token, draft buffer)
    # Scheduled (optimistic) state:
    num_tokens: int = 0  # positions that exist: prompt + samples scheduled in earlier plans
    produced: int = 0  # output tokens whose generation is scheduled (committed ones included)
    speculating: bool = False  # the speculation controller plans this request's rows
    round: Any = None  # the speculation controller's state of the current round
    token_slots: dict[int, int] = dataclasses.field(default_factory=dict)  # position -> token slot of a live token
    # (with token-sparse prefill also of a prompt window's tokens not entered yet: it takes them all at once)
    window_rows: dict[int, int] = dataclasses.field(default_factory=dict)  # depth -> rows planned of the
    # prompt window at that depth's frontier, while a token-sparse prefill window is split across plans
    # After a recompute preemption: committed output tokens re-entered as a prompt, and
    # (speculation) the last one, from which the controller resumes once the rest is in.
    replay: list[int] = dataclasses.field(default_factory=list)
    resume_token: int | None = None
    num_preemptions: int = 0
    swapped: Any = None  # after a swap preemption: its snapshot in host memory, restored at admission
    # Automatic prefix caching: the chained hashes of its prompt's full blocks (computed once,
    # at its first admission with a cache), and how many leading ones its current residency
    # need not offer the cache (hits at admission, then each one offered as it completes).
    block_hashes: list[bytes] | None = None
    published_blocks: int = 0
    queue_time: float | None = None  # seconds from its add until it was first admitted (set by the engine)
    # Committed state:
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.num_tokens = len(self.prompt_ids)

    @property
    def kv_key(self) -> str:
        """Unique per request object and residency, so neither a reused request ID nor the
        request's own resumption meets KV that is still being released."""
        return f"{self.request_id}@{self.arrival}#{self.num_preemptions}"

    @property
    def reserve_tokens(self) -> int:
        """KV positions the request may ever need."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def num_host_tokens(self) -> int:
        """Leading positions whose token ids the host knows: the prompt and the replay."""
        return len(self.prompt_ids) + len(self.replay)

    def host_token_ids(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end) < num_host_tokens."""
        prompt = len(self.prompt_ids)
        if end <= prompt:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.replay[max(start - prompt, 0):end - prompt]

    @property
    def wants_more_samples(self) -> bool:
        return self.produced < self.params.max_tokens

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def usage(self) -> Usage:
        return Usage(len(self.prompt_ids), len(self.output_ids), self.num_drafts, self.num_draft_tokens,
                     self.num_accepted_tokens)
