"""The ASGI layer in front of every route: the API key, the body limit, and the last-resort 500.

It runs before FastAPI reads anything of a request, so:

- with an API key, a request to a protected route (`/v1/*`, `/tokenize`, `/detokenize`)
  without `Authorization: Bearer <key>` gets 401 before a byte of its body is read;
- a body over the limit gets 413 without being parsed: at once when `Content-Length` says
  so, otherwise (chunked) as soon as the bytes received pass the limit, so no more than the
  limit plus one chunk is ever held;
- an exception nothing else handled becomes a 500 in the OpenAI envelope (never Starlette's
  plain-text page), logged with its traceback; the engine and other requests go on.

Every error response sent here is counted once through `count_error`.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, bad_request, internal_error

log = logging.getLogger(__name__)
PROTECTED_PATHS = frozenset({"/v1", "/tokenize", "/detokenize"})


def is_protected(path: str) -> bool:
    """Routes that need the API key; /health, /metrics, /version, /openapi.json and /docs stay open."""
    return path in PROTECTED_PATHS or path.startswith("/v1/")


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the {limit} bytes this server accepts",
                         code="request_too_large")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class FrontDoor:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 count_error: Callable[[int], None]) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._limit = max_body_bytes
        self._count_error = count_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await self._answer(refusal, scope, receive, send)
                return
            await self.app(scope, self._bounded(receive), send_tracked)
        except Exception as exc:
            if started:  # too late for a status: let the server close the connection
                raise
            if not isinstance(exc, APIError):
                log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
                exc = internal_error(f"internal error ({type(exc).__name__}); the server log has the details")
            await self._answer(exc, scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        """What is wrong with the request before its body is read: the key, then the declared length."""
        headers = dict(scope.get("headers") or [])
        if self._key is not None and is_protected(scope["path"]):
            problem = self._key_problem(headers.get(b"authorization"))
            if problem is not None:
                return unauthorized(problem)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return bad_request(f"Content-Length must be an integer, got {length.decode(errors='replace')!r}")
            if declared > self._limit:
                return BodyTooLarge(self._limit)
        return None

    def _key_problem(self, header: bytes | None) -> str | None:
        if header is None:
            return "this server needs an API key: send the header Authorization: Bearer <key>"
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key or b""):
            return "the API key is not valid"
        return None

    def _bounded(self, receive: Receive) -> Receive:
        """`receive` that raises BodyTooLarge once the body passes the limit (a chunked body has no length)."""
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._limit:
                    raise BodyTooLarge(self._limit)
            return message

        return bounded

    async def _answer(self, error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        self._count_error(error.status)
        await error.response()(scope, receive, send)
