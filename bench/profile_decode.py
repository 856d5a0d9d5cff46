"""Where a decode step's time goes on the GPU: host time per phase and kernel time per call.

    python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b
    python bench/profile_decode.py --model /tmp/ouro14 --out bench/results/profile_decode_h200.json

Batch-1 (and batch-32: --batches) greedy decode after a --prompt-token prompt (1K), random
ouro-1.4b bf16, defaults (triton backend, CUDA graphs unless --enforce-eager), optionally
with FlashLoop's updates (--sparse-decode-attention '{}', --kv-residual-quantization '{}',
--token-sparse-prefill '{}'; all three: where their decode steps' time goes). Over a window of decode
steps it records:
- host time per step, split into planning (Scheduler.schedule), building the forward
  batch, enqueueing the call (Runner.execute minus the build), waiting for the result
  (Ticket.result) and committing (the rest of EngineCore.step);
- from torch.profiler over the same kind of window: CUDA kernel time per step and the
  kernels that take most of it; wall time minus kernel time is what the GPU sits idle;
- the tokens the window emitted (tokens_per_s, rows_per_step) and the requests running and
  waiting at its start: a pool that holds fewer than the batch decodes fewer rows a step
  (before 2026-12-03 tokens_per_s assumed every request emitted at every step).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specloop.engine.config import EngineConfig  # noqa: E402
from specloop.engine.core import EngineCore  # noqa: E402
from specloop.engine.executor import Ticket  # noqa: E402
from specloop.sampling_params import SamplingParams  # noqa: E402


FEATURES = ("sparse_decode_attention", "kv_residual_quantization", "token_sparse_prefill")


def _timed(obj, name: str, bucket: str, acc: dict[str, float]) -> None:
    real = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            acc[bucket] += time.perf_counter() - t
    setattr(obj, name, wrapper)


def _case(engine: EngineCore, batch: int, steps: int, vocab: int, prompt: int = 1024, top: int = 12) -> dict:
    gen = torch.Generator().manual_seed(batch)
    # No request may finish inside the measured windows: with many long prompts the first
    # ones decode while the last still prefill, so a budget of a few windows' tokens let
    # most of a batch of 16 finish before the profile (4-5 of 16 ran at 8K before 2026-12-03).
    params = SamplingParams(max_tokens=engine.max_model_len - prompt, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", torch.randint(3, vocab, (prompt,), generator=gen).tolist(), params)
    while engine.executor.num_submitted < 8 or any(r.produced < 4 for r in engine.requests.values()):
        engine.step()  # past the prefill: every request decodes
    acc: dict[str, float] = collections.defaultdict(float)
    runner = engine.executor.runner
    _timed(engine.scheduler, "schedule", "plan", acc)
    _timed(runner.batches, "build", "build", acc)
    _timed(runner, "execute", "execute", acc)
    real_result = Ticket.result

    def waited(ticket: Ticket):
        t = time.perf_counter()
        try:
            return real_result(ticket)
        finally:
            acc["wait"] += time.perf_counter() - t

    Ticket.result = waited
    try:
        torch.cuda.synchronize()
        t0, n0 = time.perf_counter(), engine.executor.num_submitted
        running, waiting, emitted = len(engine.scheduler.running), len(engine.scheduler.waiting), 0
        for _ in range(steps):
            emitted += sum(len(o.token_ids) for o in engine.step())
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        calls = engine.executor.num_submitted - n0
    finally:
        Ticket.result = real_result
        del engine.scheduler.__dict__["schedule"], runner.batches.__dict__["build"], runner.__dict__["execute"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels, launches = collections.Counter(), collections.Counter()
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0):
            kernels[e.key] += getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
            launches[e.key] += e.count
    kernel_us = sum(kernels.values())
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.drain()
    host = {k: 1e3 * v / steps for k, v in acc.items()}
    host["enqueue"] = host.get("execute", 0) - host.get("build", 0)  # execute includes the build
    host["commit_and_rest"] = 1e3 * wall / steps - sum(host[k] for k in ("plan", "execute", "wait"))
    return {"batch": batch, "prompt": prompt, "steps": steps, "calls": calls, "wall_ms_per_step": 1e3 * wall / steps,
            "tokens_per_s": emitted / wall, "rows_per_step": emitted / steps, "running": running,
            "waiting": waiting, "host_ms_per_step": host,
            "kernel_ms_per_step": kernel_us / 1e3 / steps,
            "gpu_idle_fraction": max(0.0, 1 - (kernel_us / 1e6 / steps) / (wall / steps)),
            "top_kernels_ms_per_step": {k: v / 1e3 / steps for k, v in kernels.most_common(top)},
            "top_kernels_launches_per_step": {k: launches[k] / steps for k, _ in kernels.most_common(top)},
            "launches_per_step": sum(launches.values()) / steps}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens of each request")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--max-model-len", type=int, default=None)
    for feature in FEATURES:
        p.add_argument("--" + feature.replace("_", "-"), default=None, help="JSON, e.g. '{}' (default: off)")
    p.add_argument("--top", type=int, default=12, help="kernels listed per case")
    args = p.parse_args()
    extra = {f: json.loads(getattr(args, f)) for f in FEATURES if getattr(args, f) is not None}
    if args.max_model_len is not None:
        extra["max_model_len"] = args.max_model_len
    engine = EngineCore(EngineConfig(model=args.model, dtype="bfloat16", device="cuda", max_num_seqs=64,
                                     max_num_batched_tokens=2048, enforce_eager=args.enforce_eager, **extra))
    vocab = engine.model.config.vocab_size
    cases = [_case(engine, int(b), args.steps, vocab, args.prompt, args.top) for b in args.batches.split(",")]
    record = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "engine": engine.config.summary(), "cases": cases}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    for c in cases:
        print(json.dumps({k: c[k] for k in ("batch", "rows_per_step", "running", "waiting", "wall_ms_per_step",
                                            "tokens_per_s", "kernel_ms_per_step",
                                            "gpu_idle_fraction", "host_ms_per_step", "launches_per_step")}))
        for k, v in list(c["top_kernels_ms_per_step"].items())[:args.top]:
            print(f"   {v:8.3f} ms {c['top_kernels_launches_per_step'][k]:6.0f}x  {k[:90]}")


if __name__ == "__main__":
    main()
