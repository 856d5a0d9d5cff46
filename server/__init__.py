"""specloop's HTTP server: an OpenAI-compatible API over one engine (`AsyncEngine`, or with
`--data-parallel-size` a `DataParallelEngine` of replicas).

`create_app(engine, model_name)` builds the FastAPI app; `specloop serve` (server.cli adds
the command to the library's parser, server.main runs it) serves it under uvicorn on uvloop.
`python -m server ...` is the same as `specloop serve ...`.

`create_app` is exported lazily: the console script imports `server.cli`, hence this
package, and `specloop --version` should not pay for FastAPI and torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from server.app import create_app

        return create_app
    raise AttributeError(f"module 'server' has no attribute {name!r}")
