"""Test-only fault injection: forward call N raises, one request's commit raises, ticket N is late.

Failure handling (an engine that dies cleanly, a request that fails alone) is only as
good as its tests, and those need failures on demand. `install(engine, faults)` adds them
from outside: it replaces `engine.executor` with a wrapper of the same interface and
shadows the bound `engine._commit_one` with an instance attribute. The engine never
checks for faults, so an engine without `install` runs exactly its usual code.

    log = install(engine, Faults(fail_forward_at=3))
    ...
    assert log.fired == ["forward 3"]  # the fault really fired

`from_env` reads the same description from $SPECLOOP_FAULTS (`forward=3`, `commit=req-7`,
`commit_after=2`, `delay=2:0.5`, comma-separated). It exists only so that a test can start
a `specloop serve` process with faults (`server/main.py` reads it); nothing else does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from specloop.engine.executor import Executor, SampleResult, Ticket
from specloop.errors import ConfigError
from specloop.plan import Plan

if TYPE_CHECKING:
    from specloop.engine.core import EngineCore
    from specloop.runtime.runner import Runner
    from specloop.scheduling.request import Request, RequestOutput

log = logging.getLogger(__name__)
FAULTS_ENV = "SPECLOOP_FAULTS"


class InjectedFault(RuntimeError):
    """Raised by an injected fault, never by real code (a plain RuntimeError, as a real bug would be)."""


@dataclasses.dataclass(frozen=True)
class Faults:
    """What to break; each fault fires once."""

    fail_forward_at: int | None = None  # the Nth forward call (1-based) raises InjectedFault
    fail_commit_of: str | None = None  # committing a result of this request id raises InjectedFault
    fail_commit_after: int = 0  # commits of that request that succeed first (its tickets are in flight then)
    delay_ticket: tuple[int, float] | None = None  # (N, S): the ticket of forward call N returns S seconds late

    def __post_init__(self) -> None:
        if self.fail_forward_at is not None and self.fail_forward_at < 1:
            raise ConfigError(f"fail_forward_at counts forward calls from 1, got {self.fail_forward_at}")
        if self.fail_commit_of is not None and not self.fail_commit_of:
            raise ConfigError("fail_commit_of must name a request id")
        if self.fail_commit_after < 0 or (self.fail_commit_after and self.fail_commit_of is None):
            raise ConfigError(f"fail_commit_after must be >= 0 and needs fail_commit_of, "
                              f"got {self.fail_commit_after}")
        delay = self.delay_ticket
        if delay is not None and (delay[0] < 1 or not 0 <= delay[1] < math.inf):
            raise ConfigError(f"delay_ticket is (ticket N >= 1, finite seconds >= 0), got {delay}")

    @classmethod
    def parse(cls, text: str) -> "Faults":
        """`forward=3,commit=req-7,commit_after=2,delay=2:0.5` (any subset); ConfigError if malformed."""
        fields: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in _PARSERS:
                raise ConfigError(f"{FAULTS_ENV}: cannot read {item!r}; expected comma-separated "
                                  f"{', '.join(k + '=' + v for k, (_, v, _) in _PARSERS.items())}")
            name, form, convert = _PARSERS[key]
            if name in fields:
                raise ConfigError(f"{FAULTS_ENV}: {key} is given twice")
            try:
                fields[name] = convert(value.strip())
            except ValueError:
                raise ConfigError(f"{FAULTS_ENV}: {key} must be {form}, got {value!r}") from None
        try:
            return cls(**fields)
        except ConfigError as exc:
            raise ConfigError(f"{FAULTS_ENV}={text!r}: {exc}") from None


def _request_id(text: str) -> str:
    if not text:
        raise ValueError(text)
    return text


def _delay(text: str) -> tuple[int, float]:
    ticket, sep, seconds = text.partition(":")
    if not sep:
        raise ValueError(text)
    return int(ticket), float(seconds)


# key -> (Faults field, the form shown in errors, converter raising ValueError)
_PARSERS: dict[str, tuple[str, str, Callable[[str], Any]]] = {
    "forward": ("fail_forward_at", "N", int),
    "commit": ("fail_commit_of", "REQUEST_ID", _request_id),
    "commit_after": ("fail_commit_after", "N", int),
    "delay": ("delay_ticket", "N:SECONDS", _delay),
}


def from_env(environ: Mapping[str, str] = os.environ) -> Faults | None:
    """The faults $SPECLOOP_FAULTS asks for; None when it is unset or empty (test-only)."""
    text = environ.get(FAULTS_ENV, "").strip()
    return Faults.parse(text) if text else None


@dataclasses.dataclass
class FaultLog:
    """What the installed faults saw and did, so a test can assert that a fault really fired."""

    forward_calls: int = 0  # submits seen, the failed one included
    target_commits: int = 0  # commit attempts of `fail_commit_of`
    fired: list[str] = dataclasses.field(default_factory=list)  # "forward N", "commit ID", "delay N"


def install(engine: "EngineCore", faults: Faults) -> FaultLog:
    """Arm `faults` on `engine` (before it serves: the engine thread must not be mid-step)."""
    fault_log = FaultLog()
    if faults.fail_forward_at is not None or faults.delay_ticket is not None:
        engine.executor = FaultyExecutor(engine.executor, faults, fault_log)  # type: ignore[assignment]
    if faults.fail_commit_of is not None:
        engine._commit_one = _faulty_commit(engine._commit_one, faults, fault_log)  # type: ignore[method-assign]
    log.warning("fault injection armed (tests only): %s", faults)
    return fault_log


class FaultyExecutor:
    """The executor's interface (`submit`, `num_submitted`, `runner`) with forward and delay faults."""

    def __init__(self, inner: Executor, faults: Faults, fault_log: FaultLog) -> None:
        self.inner = inner
        self._faults = faults
        self._log = fault_log

    @property
    def runner(self) -> "Runner":
        return self.inner.runner

    @property
    def num_submitted(self) -> int:
        return self.inner.num_submitted

    def submit(self, plan: Plan) -> "Ticket | DelayedTicket":
        self._log.forward_calls += 1
        n = self._log.forward_calls
        if n == self._faults.fail_forward_at:
            self._log.fired.append(f"forward {n}")
            raise InjectedFault(f"injected fault: forward call {n} failed")
        ticket = self.inner.submit(plan)
        delay = self._faults.delay_ticket
        if delay is not None and n == delay[0]:
            return DelayedTicket(ticket, delay[1], lambda: self._log.fired.append(f"delay {n}"))
        return ticket


class DelayedTicket:
    """A ticket whose result returns `seconds` late: a slow device, as the engine thread sees it."""

    def __init__(self, ticket: Ticket, seconds: float, on_fire: Callable[[], None]) -> None:
        self._ticket = ticket
        self._seconds = seconds
        self._on_fire = on_fire

    @property
    def ticket_id(self) -> int:
        return self._ticket.ticket_id

    @property
    def plan(self) -> Plan:
        return self._ticket.plan

    def result(self) -> list[SampleResult]:
        time.sleep(self._seconds)
        self._on_fire()
        return self._ticket.result()

    def releases(self) -> list[tuple[str, int, int]]:
        return self._ticket.releases()


def _faulty_commit(real: Callable[["Request", SampleResult], "RequestOutput"], faults: Faults,
                   fault_log: FaultLog) -> Callable[["Request", SampleResult], "RequestOutput"]:
    """`real` (the bound `_commit_one`), raising once for `faults.fail_commit_of` after
    `fail_commit_after` successful commits of it."""

    def commit_one(req: "Request", res: SampleResult) -> "RequestOutput":
        if req.request_id == faults.fail_commit_of and f"commit {req.request_id}" not in fault_log.fired:
            fault_log.target_commits += 1
            if fault_log.target_commits > faults.fail_commit_after:
                fault_log.fired.append(f"commit {req.request_id}")
                raise InjectedFault(f"injected fault: committing a result of {req.request_id} failed")
        return real(req, res)

    return commit_one
