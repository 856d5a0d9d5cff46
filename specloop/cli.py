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


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion to stdout")
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> None:
    import torch

    from specloop.checkpoint import load_model, load_tokenizer, stop_token_ids
    from specloop.model.stepper import LoopStepper

    if args.max_tokens < 1:
        raise SpecloopError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
    tokenizer = load_tokenizer(args.model)
    stops = set(stop_token_ids(model.config, tokenizer))
    prompt = tokenizer.encode(args.prompt, add_special_tokens=False)
    if not prompt:
        raise SpecloopError("the prompt is empty after tokenization")
    stepper = LoopStepper(model, max_seqs=1, max_len=len(prompt) + args.max_tokens + 1)
    seq = stepper.add_sequence(prompt)
    generated: list[int] = []
    printed = ""
    with torch.inference_mode():
        for _ in range(args.max_tokens):
            token = stepper.greedy(seq, 1)[0]
            if token in stops:
                break
            generated.append(token)
            text = tokenizer.decode(generated, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
    sys.stdout.write("\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specloop", description="Serving runtime for looped language models")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_random_checkpoint(sub)
    _add_generate(sub)
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
