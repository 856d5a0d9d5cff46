"""Where an INT4-residual engine spends its time: per-step wall times and a torch profile.

Usage (device machine):
    python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b
    python bench/profile_kv_residual.py --model /tmp/ouro14 --out bench/results/profile_kv_residual_h200.json

One request of --prompt random tokens decoding --decode tokens (eager, or with --graphs CUDA
graphs; kv_residual_quantization at its defaults, or off with --bf16; the default backend): the wall time of every engine step, then a profile
(torch.profiler, CPU and CUDA) of one more request's prefill steps and of --profiled decode
steps, summarised as the top operators by self CUDA time and by self CPU time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specloop.checkpoint import load_model, load_tokenizer
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _top(prof, key: str, n: int) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"name": e.key[:120], "calls": e.count, "self_cuda_ms": e.self_device_time_total / 1e3,
             "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--profiled", type=int, default=3)
    p.add_argument("--kv-cache-bytes", type=int, default=30 << 30)
    p.add_argument("--graphs", action="store_true", help="CUDA graphs on (default: eager)")
    p.add_argument("--bf16", action="store_true", help="the format off: BF16 pages, for comparison")
    args = p.parse_args()
    model, _ = load_model(args.model, dtype=torch.bfloat16, device="cuda")
    model.fuse_projections()
    engine = EngineCore(EngineConfig.from_kwargs(
        args.model, device="cuda", dtype="bfloat16", enforce_eager=not args.graphs, kv_cache_bytes=args.kv_cache_bytes,
        **({} if args.bf16 else {"kv_residual_quantization": {}})), model=model, tokenizer=load_tokenizer(args.model))
    params = SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True)
    engine.add_request("a", _prompt(args.prompt, model.config.vocab_size, 1), params)
    steps = []
    while engine.has_unfinished():
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = engine.step()
        torch.cuda.synchronize()
        steps.append({"ms": (time.perf_counter() - t) * 1e3, "emitted": sum(len(o.token_ids) for o in outs),
                      "running": len(engine.scheduler.running)})
        print(f"step {len(steps)}: {steps[-1]['ms']:.1f} ms", file=sys.stderr, flush=True)
    engine.add_request("b", _prompt(args.prompt, model.config.vocab_size, 2), params)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prefill:
        while not engine.requests["b"].output_ids:
            engine.step()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as decode:
        for _ in range(args.profiled):
            engine.step()
        torch.cuda.synchronize()
    record = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "prompt": args.prompt,
              "steps": steps,
              "prefill": {"by_cuda": _top(prefill, "self_device_time_total", 20),
                          "by_cpu": _top(prefill, "self_cpu_time_total", 20)},
              "decode": {"steps": args.profiled, "by_cuda": _top(decode, "self_device_time_total", 20),
                         "by_cpu": _top(decode, "self_cpu_time_total", 20)}}
    Path(args.out).write_text(json.dumps(record, indent=1))
    for part in ("prefill", "decode"):
        print(f"{part}: top self CUDA", file=sys.stderr)
        for row in record[part]["by_cuda"][:10]:
            print(f"  {row['self_cuda_ms']:9.1f} ms cuda {row['self_cpu_ms']:9.1f} ms cpu {row['calls']:6d}x "
                  f"{row['name']}", file=sys.stderr)
        print(f"{part}: top self CPU", file=sys.stderr)
        for row in record[part]["by_cpu"][:8]:
            print(f"  {row['self_cpu_ms']:9.1f} ms cpu {row['calls']:6d}x {row['name']}", file=sys.stderr)


if __name__ == "__main__":
    main()
