"""The `specloop` console command.

Every user error (bad checkpoint, bad option) is printed as one `error:` line with exit
status 2; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specloop.errors import SpecloopError


def _add_random_checkpoint(sub: argparse._SubParsersAction) -> None:
    from specloop.checkpoint.random_checkpoint import PRESETS, SHAPE_OPTIONS

    p = sub.add_parser("random-checkpoint", help="write a random Ouro checkpoint in the HF layout")
    p.add_argument("out", help="output folder")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    for name in SHAPE_OPTIONS:
        kind = float if name in ("rope_theta", "early_exit_threshold") else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, dest=name, default=None,
                       help=f"override the preset's {name}")
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
    "draft_loops": (int, "draft depth d for speculation (1..loops-1, default 2)"),
    "num_speculative_tokens": (int, "candidates drafted per speculation round (default 4)"),
}


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """Engine options, named as vLLM names them where vLLM has the same option."""
    p.add_argument("--model", default=None, help="checkpoint folder (default: the shipped model)")
    for name, (kind, help_text) in ENGINE_OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, dest=name, default=None, help=help_text)


def engine_options(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_OPTIONS if getattr(args, k) is not None}


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion to stdout")
    add_engine_options(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> None:
    from specloop.engine.config import EngineConfig
    from specloop.engine.core import EngineCore
    from specloop.engine.sampling_params import SamplingParams
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


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--served-model-name", "--model-name", dest="served_model_name", default=None,
                   help="the model's name in the API (default: --model as given)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted")
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> None:
    from server.main import ServeOptions, serve

    serve(ServeOptions(args.model, engine_options(args), args.host, args.port, args.served_model_name,
                              args.log_level, args.shutdown_timeout))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specloop", description="Serving runtime for looped language models")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_random_checkpoint(sub)
    _add_generate(sub)
    _add_serve(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SpecloopError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
