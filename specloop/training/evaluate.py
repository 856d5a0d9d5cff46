"""Step 3: evaluate a looped checkpoint on the held-out split (CPU or GPU).

    python -m specloop.training.evaluate --model specloop/assets/default_model \
        --streams out/stdlib_tokens.npz --out bench/results/default_model_eval.json

Measured on non-overlapping windows of the held-out stream, each scored from position 0:

- per loop r = 1..4: next-token cross-entropy and perplexity of loop r's logits, top-1
  accuracy, and top-1 agreement with loop 4 (what a depth-r draft would get accepted at
  under greedy self-speculation, token by token);
- a unigram baseline: train-split token frequencies (add-one smoothed) on the same targets;
- adaptive exit at a few thresholds q: the mean exit loop, perplexity at the exit loop,
  and agreement with full depth, with LAST_EXITED semantics (exact, as the runtime).

It also records greedy continuations of a few prompts, decoded by the dense reference
(`specloop.model.reference.reference_greedy`, every loop, q = 1.0), which the engine's
greedy tokens are tested to equal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specloop.checkpoint import load_model, load_tokenizer
from specloop.model.ouro import OuroModel
from specloop.model.reference import reference_greedy
from specloop.training.forward import batched_loops, loop_logits
from specloop.training.objective import per_token_ce
from specloop.training.token_data import fixed_windows

THRESHOLDS = (0.5, 0.7, 0.9, 0.95)
PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):", "# Read a JSON file and return the parsed object\ndef ")


def unigram_ce(train: np.ndarray, targets: torch.Tensor, vocab_size: int) -> float:
    """Mean CE (nats) of add-one-smoothed train-split unigram frequencies on `targets`."""
    counts = np.bincount(train.astype(np.int64), minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[targets.reshape(-1).numpy()].mean())


@torch.no_grad()
def score_windows(
    model: OuroModel, windows: torch.Tensor, thresholds: Sequence[float], batch: int,
) -> dict[str, Any]:
    """Per-loop and adaptive-exit statistics summed over windows [N, T]."""
    device = model.device
    num_loops = model.config.num_loops
    ce = torch.zeros(num_loops, dtype=torch.float64)
    correct = torch.zeros(num_loops, dtype=torch.float64)
    agree = torch.zeros(num_loops, dtype=torch.float64)
    adaptive = {q: {"ce": 0.0, "depth": 0.0, "agree": 0.0, "hist": torch.zeros(num_loops)} for q in thresholds}
    count = 0
    for start in range(0, windows.shape[0], batch):
        w = windows[start:start + batch].to(device)
        targets = w[:, 1:]
        logits = loop_logits(model, batched_loops(model, w))[:, :, :-1]  # [R, B, T-1, V]
        top = logits.argmax(-1)
        for r in range(num_loops):
            ce[r] += per_token_ce(logits[r], targets).double().sum().cpu()
            correct[r] += (top[r] == targets).sum().cpu()
            agree[r] += (top[r] == top[-1]).sum().cpu()
        for q in thresholds:
            out = batched_loops(model, w, exit_threshold=q)
            exit_logits = model.head(out.hidden[-1])[:, :-1]  # an exited token keeps its state
            exits = out.exit_loops[:, :-1]
            stats = adaptive[q]
            stats["ce"] += float(per_token_ce(exit_logits, targets).double().sum())
            stats["depth"] += float(exits.double().sum())
            stats["agree"] += float((exit_logits.argmax(-1) == top[-1]).sum())
            stats["hist"] += torch.bincount(exits.reshape(-1).cpu() - 1, minlength=num_loops).float()
        count += targets.numel()
    loops = []
    for r in range(num_loops):
        mean = float(ce[r] / count)
        loops.append({"loop": r + 1, "ce": mean, "ppl": math.exp(mean), "top1_acc": float(correct[r] / count),
                      "top1_agree_with_loop4": float(agree[r] / count)})
    exits = []
    for q, stats in adaptive.items():
        mean = stats["ce"] / count
        exits.append({"threshold": q, "mean_exit_loop": stats["depth"] / count, "ce": mean, "ppl": math.exp(mean),
                      "top1_agree_with_full_depth": stats["agree"] / count,
                      "exit_loop_fractions": (stats["hist"] / count).tolist()})
    return {"tokens_scored": count, "loops": loops, "adaptive_exit": exits}


@torch.no_grad()
def greedy_samples(model: OuroModel, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int) -> list[dict]:
    """Greedy continuations by the dense reference (every loop, q = 1.0), cut at the first
    end-of-text. Full recomputation per token is cheap at this size and keeps training
    independent of the serving engine."""
    weights = {name: p.detach() for name, p in model.named_parameters()}
    samples = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        out = reference_greedy(weights, model.config, ids, max_new_tokens, exit_threshold=1.0)
        if 0 in out:
            out = out[: out.index(0)]
        samples.append({"prompt": prompt, "continuation": tokenizer.decode(out)})
    return samples


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specloop.training.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: the shipped model)")
    p.add_argument("--streams", type=Path, default=None,
                   help="tokenised splits from specloop.training.prepare (default: tokenise the running stdlib)")
    p.add_argument("--out", type=Path, required=True, help="JSON to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--sample-tokens", type=int, default=48)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model is None:
        from specloop.assets import default_model_path

        args.model = default_model_path()
    start = time.perf_counter()
    device = torch.device(args.device)
    model, _ = load_model(args.model, dtype=torch.float32, device=device)
    tokenizer = load_tokenizer(args.model)
    if args.streams is not None:
        from specloop.training.token_data import load_streams

        streams, manifest = load_streams(args.streams)
    else:
        from specloop.training.token_data import build_streams

        streams, manifest = build_streams(tokenizer.backend_tokenizer)
    windows = fixed_windows(streams["heldout"], args.seq_len, args.max_windows)
    result = score_windows(model, windows, THRESHOLDS, args.batch)
    result["unigram"] = {"ce": unigram_ce(streams["train"], windows[:, 1:], model.config.vocab_size)}
    result["unigram"]["ppl"] = math.exp(result["unigram"]["ce"])
    result["samples"] = greedy_samples(model, tokenizer, PROMPTS, args.sample_tokens)
    result.update(
        command="python -m specloop.training.evaluate " + " ".join(argv if argv is not None else sys.argv[1:]),
        model=str(args.model), corpus_python=manifest["python"], heldout=manifest["splits"]["heldout"],
        windows=int(windows.shape[0]), seq_len=args.seq_len, device=str(device), seconds=time.perf_counter() - start,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"held-out ({result['tokens_scored']} tokens, Python {manifest['python']} stdlib): "
          f"unigram ppl {result['unigram']['ppl']:.1f}")
    for row in result["loops"]:
        print(f"  loop {row['loop']}: ppl {row['ppl']:.2f}  top-1 {row['top1_acc']:.3f}  "
              f"agrees with loop 4 {row['top1_agree_with_loop4']:.3f}")
    for row in result["adaptive_exit"]:
        print(f"  q={row['threshold']}: mean exit loop {row['mean_exit_loop']:.2f}  ppl {row['ppl']:.2f}  "
              f"agrees with full depth {row['top1_agree_with_full_depth']:.3f}")
    for s in result["samples"]:
        print(f"--- {s['prompt']!r}\n{s['prompt']}{s['continuation']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
