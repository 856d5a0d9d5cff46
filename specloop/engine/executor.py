"""The executor: `submit(plan) -> Ticket`.

On CUDA `submit` only enqueues device work (the runner never synchronises), so the CPU
returns at once and builds the next plan while the GPU runs this one; `Ticket.result()`
waits for the ticket's event. On CPU the work runs inside `submit` and the ticket is
already complete: the same interface, synchronous.
"""

from __future__ import annotations

import dataclasses

from specloop.runtime.runner import Runner, TicketOutput
from specloop.plan import Plan, RowGroup


@dataclasses.dataclass
class SampleResult:
    group: RowGroup  # the group whose head produced it (its head says what kind of result)
    tokens: list[int]  # emitted in order: one for a plain sample, accepted + 1 for a round's verification
    accepted: int  # candidates accepted
    logprobs: list[float] | None


class Ticket:
    def __init__(self, output: TicketOutput) -> None:
        self._output = output

    @property
    def ticket_id(self) -> int:
        return self._output.plan.ticket_id

    @property
    def plan(self) -> Plan:
        return self._output.plan

    def result(self) -> list[SampleResult]:
        """Block until the ticket completed; its results in plan order."""
        out = self._output
        if out.event is not None:
            out.event.synchronize()
        if out.tokens is None:
            return []
        tokens, counts, accepted = out.tokens.tolist(), out.counts.tolist(), out.accepted.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else [None] * len(tokens)
        return [SampleResult(g, t[:c], a, lp[:c] if lp is not None else None)
                for g, t, c, a, lp in zip(out.groups, tokens, counts, accepted, logprobs)]


    def releases(self) -> list[tuple[str, int, int]]:
        """(kv key, plane, leading pages) of tail pages no query reads exact any more (INT4
        residuals), once the ticket completed; [] without."""
        out = self._output
        if out.released is None:
            return []
        if out.event is not None:
            out.event.synchronize()
        counts = out.released.tolist()
        return [(scan.kv_key, plane, pages) for scan, row in zip(out.plan.releases, counts)
                for plane, pages in enumerate(row)]


class Executor:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.num_submitted = 0  # forward calls so far

    def submit(self, plan: Plan) -> Ticket:
        self.num_submitted += 1
        return Ticket(self.runner.execute(plan))

    def close(self) -> None:
        """Release what the runner holds outside this process (tensor-parallel workers); idempotent."""
        self.runner.close()
