"""The library's commands of `specloop`: `generate` and `random-checkpoint`.

The console script (`specloop`, pyproject) is `server.cli:main`, which adds `serve` to the
parser built here: the library sits below the HTTP server and never imports it, so the
server plugs its command in through `build_parser(*subcommands)` / `main(argv, subcommands)`.
`python -m specloop.cli` runs the library's commands alone.

Every user error (bad checkpoint, bad option) is printed as one `error:` line with exit
status 2; tracebacks are for bugs only. No command reads stdin (see `no_stdin`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import io
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from specloop import __version__
from specloop.errors import ConfigError, SpecloopError

# Adds one subcommand (parser, options, `func` default) to the `specloop` parser.
AddSubcommand = Callable[[argparse._SubParsersAction], None]


class HelpFormatter(argparse.HelpFormatter):
    """Shows every option's default: appended, unless its help already says it in words.

    An action may carry `default_text`, a callable run only when help is shown, for a
    default that costs an import to read (one that pulls in torch, say)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        lazy = getattr(action, "default_text", None)
        if lazy is not None:
            return f"{text} (default: {lazy()})".replace("%", "%%")
        if "default" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def positive_int(text: str) -> int:
    """An argparse type: a bad value is argparse's one usage error, not a traceback."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _add_random_checkpoint(sub: argparse._SubParsersAction) -> None:
    from specloop.checkpoint.random_checkpoint import PRESETS, SHAPE_OPTIONS

    p = sub.add_parser("random-checkpoint", help="write a random Ouro checkpoint in the HF layout",
                       formatter_class=HelpFormatter)
    p.add_argument("out", help="output folder")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    for name in SHAPE_OPTIONS:
        kind = float if name in ("rope_theta", "early_exit_threshold") else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, dest=name, default=None,
                       help=f"override the preset's {name} (default: the preset's)")
    p.set_defaults(func=_run_random_checkpoint)


def _run_random_checkpoint(args: argparse.Namespace) -> None:
    import torch

    from specloop.checkpoint.random_checkpoint import SHAPE_OPTIONS, preset_config, write_random_checkpoint

    cfg = preset_config(args.preset, **{k: getattr(args, k) for k in SHAPE_OPTIONS})
    dtype = getattr(torch, args.dtype)
    print(f"writing a random {args.preset} checkpoint ({cfg.num_hidden_layers} layers x "
          f"{cfg.num_loops} loops, hidden {cfg.hidden_size}) to {args.out}", file=sys.stderr)
    write_random_checkpoint(args.out, cfg, seed=args.seed, dtype=dtype)
    print(args.out)


ENGINE_OPTIONS: dict[str, tuple[type, str]] = {
    "dtype": (str, "auto, float32, bfloat16 or float16 (auto: bf16 on CUDA, fp32 on CPU)"),
    "device": (str, "auto, cpu or cuda[:N]"),
    "seed": (int, "engine seed: requests without their own seed sample reproducibly from it"),
    "block_size": (int, "tokens per KV page"),
    "num_kv_pages": (int, "KV budget in pages"),
    "kv_cache_bytes": (int, "KV budget in bytes"),
    "gpu_memory_utilization": (float, "fraction of free GPU memory after weights for KV"),
    "max_num_seqs": (int, "running requests at once"),
    "max_num_batched_tokens": (int, "rows (token, depth) per forward call"),
    "max_model_len": (int, "context length limit"),
    "max_waiting_requests": (int, "bounded waiting queue"),
    "max_stop_strings": (int, "stop strings one request may give"),
    "max_stop_chars": (int, "characters over all of one request's stop strings"),
    "exit_threshold": (float, "Q-exit threshold (1.0: every loop)"),
    "speculation": (str, "none, block (self-speculation rounds) or pipeline (token pipelines)"),
    "draft_loops": (int, "draft depth d for speculation (1..loops-1)"),
    "num_speculative_tokens": (int, "candidates drafted per speculation round"),
    "attention_backend": (str, "auto (triton on CUDA, torch on CPU), torch (the readable reference) or triton; "
                          "the engine logs what it chose"),
    "enforce_eager": (bool, "run every forward call eagerly: no CUDA graphs"),
    "preemption_mode": (str, "what preemption does to the latest-arrived running request when KV pages run out: "
                        "recompute (drop its KV, re-enter its prompt and tokens later) or swap (snapshot it to "
                        "host memory, restore it later)"),
    "enable_prefix_caching": (bool, "share the KV of full prompt blocks between requests with the same prefix "
                              "(whole windows of them with --token-sparse-prefill; with --kv-residual-quantization the BF16 pages, "
                              "each reader encodes its own INT4 records)"),
    "tensor_parallel_size": (int, "ranks (processes, one GPU each on CUDA) the model's heads and MLP columns are "
                             "split over; must divide the attention heads, KV heads and intermediate size"),
    "token_sparse_prefill": (str, "FlashLoop token-sparse prefill as a JSON object with enabled, window (prompt "
                             "tokens per selection window) and retention (per loop); '{}' switches it on with "
                             "the defaults"),
    "sparse_decode_attention": (str, "FlashLoop sparse decode attention as a JSON object with enabled and "
                                "key_retention (share of a generated token's keys kept at loops 3+, from its "
                                "loop-2 probabilities); '{}' switches it on with the defaults"),
    "kv_residual_quantization": (str, "FlashLoop INT4 cross-loop KV residuals as a JSON object with enabled, bits "
                                 "(4), group_size (64), tail (tokens a group stays exact after its last one) and "
                                 "policy (serial); '{}' switches it on with the defaults"),
}
JSON_OPTIONS = ("token_sparse_prefill", "sparse_decode_attention", "kv_residual_quantization")  # FlashLoop groups: a JSON object each
# What an unset option means where EngineConfig's default is None (no value to show).
UNSET_MEANS = {
    "num_kv_pages": "from --kv-cache-bytes, else --gpu-memory-utilization on CUDA, a fixed budget on CPU",
    "kv_cache_bytes": "from --gpu-memory-utilization on CUDA, a fixed budget on CPU",
    "max_model_len": "the model's max_position_embeddings",
    "exit_threshold": "the checkpoint's early_exit_threshold",
    "enable_prefix_caching": "on, except with --kv-residual-quantization or a token-sparse window that is not a "
                             "multiple of --block-size",
}


def engine_option_help(name: str) -> str:
    """The option's help with EngineConfig's default, read from the dataclass (never restated here)."""
    from specloop.engine.config import EngineConfig

    field = {f.name: f for f in dataclasses.fields(EngineConfig)}[name]
    default = field.default_factory() if field.default is dataclasses.MISSING else field.default
    if dataclasses.is_dataclass(default):  # a FlashLoop group: its options as JSON
        from specloop.flashloop.config import summary

        default = json.dumps(summary(default))
    shown = UNSET_MEANS.get(name, "unset") if default is None else default
    return f"{ENGINE_OPTIONS[name][1]} (default: {shown})".replace("%", "%%")


def add_model_argument(p: argparse.ArgumentParser) -> None:
    """The checkpoint as an optional positional MODEL or as --model (both: they must agree)."""
    p.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                   help="checkpoint folder (default: the shipped model)")
    p.add_argument("--model", default=None, help="the same as MODEL (default: the shipped model)")


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """Engine options, named as vLLM names them where vLLM has the same option.

    They default to None here so an unset option takes EngineConfig's default; the help
    shows that default."""
    add_model_argument(p)
    for name, (kind, _) in ENGINE_OPTIONS.items():
        if kind is bool:  # a switch: --name means True, --no-name False, neither the default
            p.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, dest=name,
                           default=None, help=engine_option_help(name))
            continue
        p.add_argument("--" + name.replace("_", "-"), type=kind, dest=name, default=None,
                       metavar="JSON" if name in JSON_OPTIONS else None, help=engine_option_help(name))


def engine_options(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_OPTIONS if getattr(args, k) is not None}


def resolve_model(args: argparse.Namespace) -> None:
    """Fold the positional MODEL into args.model; two different models are one user error."""
    given = getattr(args, "model_arg", None)
    if given is None:
        return
    if args.model is not None and os.path.abspath(args.model) != os.path.abspath(given):
        raise ConfigError(f"two models given: {given!r} and --model {args.model!r}; give one")
    args.model = given


class _NoStdin(io.TextIOBase):
    """sys.stdin while a command runs: specloop never reads standard input, so nothing it
    calls (a library prompting "[y/N]", say) may block on it; a read raises at once."""

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> str:
        raise SpecloopError("specloop does not read standard input (something asked for it)")

    def readline(self, size: int | None = -1) -> str:
        return self.read()

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def no_stdin() -> Iterator[None]:
    """Replace sys.stdin with `_NoStdin` for the duration (restored for in-process callers)."""
    saved = sys.stdin
    sys.stdin = _NoStdin()
    try:
        yield
    finally:
        sys.stdin = saved


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion to stdout", formatter_class=HelpFormatter)
    add_engine_options(p)
    p.add_argument("--prompt", required=True, help="the prompt text (required; no default)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=-1, help="sample from the k likeliest tokens (-1: off)")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> None:
    from specloop.engine.config import EngineConfig
    from specloop.engine.core import EngineCore
    from specloop.sampling_params import SamplingParams
    from specloop.llm import default_model

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k)
    engine = EngineCore(EngineConfig.from_kwargs(args.model or default_model(), **engine_options(args)))
    engine.add_request("cli", args.prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")


def build_parser(*subcommands: AddSubcommand) -> argparse.ArgumentParser:
    """The `specloop` parser: the library's commands, then each of `subcommands` (the server's
    `serve`), so a layer above adds commands without the library importing it."""
    parser = argparse.ArgumentParser(prog="specloop", description="Serving runtime for looped language models")
    parser.add_argument("--version", action="version", version=f"specloop {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_random_checkpoint(sub)
    _add_generate(sub)
    for add in subcommands:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None, subcommands: Sequence[AddSubcommand] = ()) -> int:
    """Parse and run one command; a SpecloopError from any command is one `error:` line, exit 2."""
    args = build_parser(*subcommands).parse_args(argv)
    try:
        with no_stdin():
            resolve_model(args)
            status = args.func(args)
    except SpecloopError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
