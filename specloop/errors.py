"""Exception types that carry one clear line for the user.

Every error a user can provoke (bad checkpoint, bad option, bad request) is raised as a
`SpecloopError` subclass whose message is a single sentence naming the offending thing;
the CLI prints that line and exits non-zero instead of showing a traceback.
"""

from __future__ import annotations


class SpecloopError(Exception):
    """Base class for errors whose message is meant for the user."""


class ConfigError(SpecloopError):
    """A model or engine configuration that specloop cannot run."""


class CheckpointError(SpecloopError):
    """A checkpoint folder that is missing, malformed or does not match its config."""


class InvalidRequestError(SpecloopError):
    """A request the engine refuses; `param` names the offending field (None: the request as a whole)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailedError(SpecloopError):
    """One request failed inside the engine (adding, planning or committing it) and was ended;
    the engine goes on serving every other request."""


class EngineDeadError(SpecloopError):
    """The engine stopped after a failure that may have corrupted shared state (a forward
    call); it serves nothing more."""


class SnapshotError(SpecloopError):
    """A request snapshot that cannot be taken or restored here (unknown format or version,
    another configuration, no room); nothing was changed."""
