"""The `specloop` console command (pyproject `[project.scripts]`): the library's commands plus `serve`.

The console script lives here, not in `specloop.cli`, because dependencies point one way:
the server imports the library, never the reverse. This module adds `serve` to the parser
that `specloop.cli.build_parser` builds, so `generate`, `random-checkpoint`, `--version`,
the one-line `error:` handling and the stdin guard stay the library's.

`serve` exits 0 after SIGINT/SIGTERM, 1 when the engine died, 2 on a user error (a port it
cannot listen on, a bad model or option). `python -m server ...` is `specloop serve ...`.
The server's modules (uvicorn, FastAPI, torch) are imported only when `serve` runs or its
help is shown, so `specloop --version` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from specloop import cli
from specloop.errors import ConfigError

API_KEY_ENV = "SPECLOOP_API_KEY"


def add_serve(sub: argparse._SubParsersAction) -> None:
    """Add `serve` (engine options, where to listen, API key, limits) to the `specloop` parser."""
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       formatter_class=cli.HelpFormatter)
    cli.add_engine_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--served-model-name", "--model-name", dest="served_model_name", default=None,
                   help="the model's name in the API (default: specloop-default for the shipped model, "
                        "else the checkpoint folder's name)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize (default: $" + API_KEY_ENV
                        + ", else no key); prefer the variable, a flag shows in the process list")
    body = p.add_argument("--max-request-body-bytes", type=cli.positive_int, dest="max_body_bytes", default=None,
                          help="larger request bodies get 413 before they are parsed")
    body.default_text = _default_max_body_bytes  # type: ignore[attr-defined]
    p.add_argument("--max-tokens-default", type=cli.positive_int, default=None,
                   help="max_tokens of a chat request that gives neither max_tokens nor max_completion_tokens "
                        "(capped at what fits); default: everything that fits, up to the context length, as in vLLM")
    p.add_argument("--data-parallel-size", type=cli.positive_int, default=1,
                   help="engine replicas, each in its own process (on CUDA replica i uses cuda:i), requests "
                        "routed to the least loaded; 1: one engine in the server's process")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                   help="log level of the server and uvicorn")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted")
    p.set_defaults(func=_run_serve)


def _default_max_body_bytes() -> int:
    """Read lazily: server.app pulls in FastAPI and torch, which `--version` should not pay for."""
    from server.app import DEFAULT_MAX_BODY_BYTES

    return DEFAULT_MAX_BODY_BYTES


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $SPECLOOP_API_KEY; an empty variable means no key, an empty flag is an error."""
    if args.api_key is not None:
        if not args.api_key:
            raise ConfigError("--api-key is empty; give a key or leave the option out")
        return args.api_key
    return os.environ.get(API_KEY_ENV) or None


def _run_serve(args: argparse.Namespace) -> int:
    from server.main import ServeOptions, serve

    max_body = args.max_body_bytes if args.max_body_bytes is not None else _default_max_body_bytes()
    return serve(ServeOptions(args.model, cli.engine_options(args), args.host, args.port, args.served_model_name,
                              args.log_level, args.shutdown_timeout, api_key=_api_key(args),
                              max_body_bytes=max_body, max_tokens_default=args.max_tokens_default,
                              data_parallel_size=args.data_parallel_size))


SUBCOMMANDS: tuple[cli.AddSubcommand, ...] = (add_serve,)  # what the server adds to the library's commands


def build_parser() -> argparse.ArgumentParser:
    """The full `specloop` parser: the library's commands and `serve`."""
    return cli.build_parser(*SUBCOMMANDS)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: every `specloop` command, `serve` included."""
    return cli.main(argv, subcommands=SUBCOMMANDS)


if __name__ == "__main__":
    sys.exit(main())
