"""specloop's HTTP server: an OpenAI-compatible API over one `AsyncEngine`.

`create_app(engine, model_name)` builds the FastAPI app; `specloop serve` (server.main)
runs it under uvicorn on uvloop. `python -m server ...` is the same as `specloop serve ...`.
"""

from server.app import create_app

__all__ = ["create_app"]
