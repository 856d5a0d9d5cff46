"""Admission by need (with recompute preemption) against reserving prompt + max_tokens.

Usage (device machine; a random checkpoint is written first):
    python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b
    python bench/preemption.py --model /tmp/ouro14 --out bench/results/preemption_h200.json
    python bench/preemption.py --model /tmp/tiny --device cpu --requests 12 --prompt 24 --output 24 \\
        --out /tmp/preemption_cpu.json        (a smoke run)

A burst of `--requests` requests (random prompts of `--prompt` tokens, max_tokens
`--output`) arrives at once at an engine whose KV pool holds `--pool-fraction` of the
offered load (every request's prompt + max_tokens in every plane). With `--stop-every 0`
they are greedy and ignore EOS, so each generates exactly max_tokens: the case where a
reservation knows what each request needs. With `--stop-every N` they sample (seeded,
temperature 1) and stop at any of every N-th token id, so outputs end early at random
lengths (mean about N with a random model's near-uniform draws), as requests that stop at
EOS well before max_tokens do: the case admission by need is for.
The same burst runs twice: admission by need (the default: requests are admitted when
their prompt fits and preempted, latest first, when pages run out) and the older policy
(`Scheduler.reserve_max_tokens`: reserve prompt + output at admission, never preempt).
Each engine first runs the whole burst once untimed (kernels of every shape compile), then
the policies alternate for `--repeats` timed bursts; the median burst is reported, with
every burst's wall time. Reported per policy: wall time, output tokens/s, time to first token and end-to-end
latency (p50, p99) per request, preemptions, the most requests running at once, and how
many requests emitted the same tokens under both policies (recompute re-enters tokens as
prompt chunks, so bf16 sums may round apart where two logits nearly tie).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specloop.config import ModelConfig
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _params(output: int, stop_every: int, vocab: int, seed: int) -> SamplingParams:
    if not stop_every:
        return SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=output, temperature=1.0, seed=seed, ignore_eos=True,
                          stop_token_ids=list(range(stop_every, vocab, stop_every)))


def _burst(engine: EngineCore, prompts: list[list[int]], output: int, stop_every: int, cuda: bool) -> dict:
    vocab = engine.model.config.vocab_size
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    peak_running = 0
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, _params(output, stop_every, vocab, i))
    while engine.has_unfinished():
        outs = engine.step()
        peak_running = max(peak_running, len(engine.scheduler.running))
        now = time.perf_counter() - start
        for out in outs:
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.token_ids)
            if out.token_ids:
                first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    wall = max(done.values())
    ttft, e2e = list(first.values()), list(done.values())
    return {
        "wall_s": wall,
        "output_tokens": sum(map(len, tokens.values())),
        "output_tokens_per_s": sum(map(len, tokens.values())) / wall,
        "ttft_s": {"p50": statistics.median(ttft), "p99": _quantile(ttft, 0.99)},
        "e2e_s": {"p50": statistics.median(e2e), "p99": _quantile(e2e, 0.99)},
        "num_preemptions": engine.stats().num_preemptions,
        "peak_running": peak_running,
        "tokens": tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--pool-fraction", type=float, default=1 / 3)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=None, help="running requests at once (default: --requests)")
    p.add_argument("--repeats", type=int, default=2, help="timed bursts per policy after the warm-up")
    p.add_argument("--stop-every", type=int, default=0, help="0: exact lengths; N: stop at every N-th token id")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    planes = ModelConfig.from_file(Path(args.model) / "config.json").num_loops
    per_request = planes * -(-(args.prompt + args.output) // args.block_size)
    pool = int(args.requests * per_request * args.pool_fraction)
    gc.collect()
    gen = torch.Generator().manual_seed(0)
    result: dict = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "torch": torch.__version__, "requests": args.requests, "prompt": args.prompt,
                    "output": args.output, "repeats": args.repeats, "stop_every": args.stop_every, "max_num_seqs": args.max_num_seqs or args.requests, "block_size": args.block_size, "pool_pages": pool,
                    "offered_pages": args.requests * per_request, "pool_fraction": args.pool_fraction}
    engines = {}
    for policy in ("need", "reserve"):
        engine = EngineCore(EngineConfig(model=args.model, device=args.device, dtype=dtype, num_kv_pages=pool,
                                         block_size=args.block_size, max_num_seqs=args.max_num_seqs or args.requests,
                                         max_num_batched_tokens=2048))
        engine.scheduler.reserve_max_tokens = policy == "reserve"
        engines[policy] = engine
    vocab = engines["need"].model.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt,), generator=gen.manual_seed(i)).tolist()
               for i in range(args.requests)]
    # Warm-up: the whole burst once per engine, untimed, so kernels of every shape it meets are
    # compiled before anything is timed (a short warm-up left compiles in the first timed run).
    for engine in engines.values():
        _burst(engine, prompts, args.output, args.stop_every, cuda)
    timed: dict[str, list[dict]] = {"need": [], "reserve": []}
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
        for policy, engine in engines.items():
            engine.scheduler.num_preemptions = 0
            timed[policy].append(_burst(engine, prompts, args.output, args.stop_every, cuda))
    runs = {}
    for policy, bursts in timed.items():
        best = sorted(bursts, key=lambda b: b["wall_s"])[len(bursts) // 2]  # the median burst
        best["walls_s"] = [b["wall_s"] for b in bursts]
        runs[policy] = best
    same = sum(runs["need"]["tokens"][r] == runs["reserve"]["tokens"][r] for r in runs["need"]["tokens"])
    for policy, run in runs.items():
        run.pop("tokens")
        result[policy] = run
    result["same_tokens"] = f"{same}/{args.requests}"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{args.requests} x ({args.prompt} in, {args.output} out), pool {pool} pages "
          f"({args.pool_fraction:.2f} of the offered {args.requests * per_request})")
    print(f"{'policy':8s} {'tok/s':>8s} {'wall s':>7s} {'TTFT p50/p99 s':>16s} {'E2E p50/p99 s':>15s} "
          f"{'preempt':>8s} {'peak run':>8s}")
    for policy in ("need", "reserve"):
        r = result[policy]
        print(f"{policy:8s} {r['output_tokens_per_s']:8.0f} {r['wall_s']:7.2f} "
              f"{r['ttft_s']['p50']:7.2f}/{r['ttft_s']['p99']:<7.2f} {r['e2e_s']['p50']:7.2f}/{r['e2e_s']['p99']:<7.2f} "
              f"{r['num_preemptions']:8d} {r['peak_running']:8d}")
    print(f"same tokens under both policies: {result['same_tokens']}")


if __name__ == "__main__":
    main()
