"""Errors in the OpenAI envelope: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause or meet becomes an `APIError` with an HTTP status; the
helpers below translate the engine's and msgspec's exceptions into one, keeping the name
of the offending field in `param`.
"""

from __future__ import annotations

import re

import msgspec
from fastapi import Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from specloop.engine.async_engine import EngineDeadError
from specloop.engine.core import QueueFullError
from specloop.errors import InvalidRequestError, RequestFailedError
from specloop.protocol import ErrorInfo, ErrorResponse

RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def envelope(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code))

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.envelope()), status_code=self.status,
                        media_type="application/json", headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_engine(exc: Exception) -> APIError:
    """The engine's refusal of a request, as the status a client should see."""
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(503, f"{exc}; retry later", type="overloaded_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, RequestFailedError):  # this request only; the engine serves on
        return internal_error(str(exc), code="request_failed")
    return internal_error(f"internal error: {type(exc).__name__}: {exc}")


def internal_error(message: str, code: str | None = None) -> APIError:
    return APIError(500, message, type="server_error", code=code)


def too_deep() -> APIError:
    """msgspec raises RecursionError for JSON nested past Python's recursion limit (~1,000 levels)."""
    return bad_request("the body is not valid JSON for this server: it nests arrays or objects too deeply "
                       "(more than about 1,000 levels)", code="invalid_json")


_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")


def from_decode(exc: msgspec.MsgspecError) -> APIError:
    """A body msgspec could not decode: bad JSON, or a field of the wrong type or missing.

    msgspec ends a validation message with the JSON path (`- at `$.messages[0].role``);
    that path, without the `$.`, becomes `param`.
    """
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"the body is not valid JSON: {exc}", code="invalid_json")
    text = str(exc)
    match = _PATH.search(text)
    path = match.group("path").lstrip(".") if match else ""
    message = text[:match.start()] if match else text
    missing = _MISSING.match(message)
    if missing:
        field = missing.group("field")
        param = f"{path}.{field}" if path else field
        return bad_request(f"the required field {param!r} is missing", param)
    if not path:
        return bad_request(f"the body must be a JSON object: {message}")
    return bad_request(f"invalid value for {path!r}: {message}", path)


async def api_error_handler(request: Request, exc: APIError) -> Response:
    return exc.response()


async def http_error_handler(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (unknown route, wrong method) in the same envelope."""
    kind = "not_found" if exc.status_code == 404 else None
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return APIError(exc.status_code, message, code=kind, headers=dict(exc.headers or {})).response()
