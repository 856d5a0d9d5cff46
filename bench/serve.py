"""Load generator for a running `specloop serve` (or any OpenAI-compatible server).

    python bench/serve.py --base-url http://127.0.0.1:8000 --num-requests 64 --concurrency 16 \\
        --prompt-len 256 --output-len 64 --out bench/results/serve.json
    python bench/serve.py ... --request-rate 4      # Poisson arrivals, 4 requests/s on average

Every request is a streamed /v1/completions call with a prompt of exactly `--prompt-len`
random token ids (seeded) and `ignore_eos`, so it generates exactly `--output-len` tokens.
Per request it records, from the client's side:

- TTFT: request sent to the first chunk that carries a token;
- ITL: the gap between consecutive token-carrying chunks, divided over the tokens of the
  later chunk (one sample per token);
- TPOT: (end-to-end - TTFT) / (output tokens - 1);
- end-to-end latency.

It reports mean, p50, p90 and p99 of each (milliseconds), request and token throughput and
failures, as a printed table and as JSON (with the command and the server's /v1/models).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import platform
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from specloop.client import APIError, AsyncClient  # noqa: E402


@dataclasses.dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = dataclasses.field(default_factory=list)

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


def make_prompts(n: int, length: int, seed: int, token_range: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*token_range) for _ in range(length)] for _ in range(n)]


def arrival_delays(n: int, rate: float | None, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent (all 0 for fixed concurrency)."""
    if rate is None:
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def one_request(client: AsyncClient, model: str, prompt: list[int], args: argparse.Namespace) -> Outcome:
    res = Outcome(prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        stream = await client.completions(
            prompt, model=model, stream=True, max_tokens=args.output_len, temperature=args.temperature,
            ignore_eos=True, return_token_ids=True, stream_options={"include_usage": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                res.output_tokens = chunk.usage.completion_tokens
            n = sum(len(c.token_ids) for c in chunk.choices if isinstance(c.token_ids, list))
            if n == 0:
                continue
            if math.isnan(res.ttft):
                res.ttft = now - start
            else:
                res.itl.extend([(now - last) / n] * n)
            last = now
        res.e2e = time.perf_counter() - start
        res.ok = res.output_tokens > 0
        res.error = "" if res.ok else "no tokens"
    except (APIError, httpx.HTTPError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


class Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done, self.failed, self.start = total, 0, 0, time.perf_counter()

    def tick(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"failed {self.failed}  {elapsed:6.1f}s")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=30) as raw:
        models = (await raw.get("/v1/models")).json()
        metrics_before = (await raw.get("/metrics")).text
    model = args.model or models["data"][0]["id"]
    prompts = make_prompts(args.num_requests, args.prompt_len, args.seed, (args.token_min, args.token_max))
    delays = arrival_delays(args.num_requests, args.request_rate, args.seed)
    limit = asyncio.Semaphore(args.concurrency or args.num_requests)
    progress = Progress(args.num_requests)
    limits = httpx.Limits(max_connections=args.concurrency or args.num_requests)
    http = httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits)
    async with AsyncClient(http=http, max_retries=0) as client:
        begin = time.perf_counter()

        async def scheduled(prompt: list[int], delay: float) -> Outcome:
            await asyncio.sleep(max(0.0, begin + delay - time.perf_counter()))
            async with limit:
                outcome = await one_request(client, model, prompt, args)
            progress.tick(outcome.ok)
            return outcome

        outcomes = await asyncio.gather(*(scheduled(p, d) for p, d in zip(prompts, delays)))
        duration = time.perf_counter() - begin
    async with httpx.AsyncClient(base_url=args.base_url, timeout=30) as raw:
        metrics_after = (await raw.get("/metrics")).text
    return summarize(args, models, outcomes, duration, counter_deltas(metrics_before, metrics_after))


def summarize(args: argparse.Namespace, models: dict, outcomes: list[Outcome], duration: float,
              server_counters: dict[str, float]) -> dict[str, Any]:
    good = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in good)
    in_tokens = sum(o.prompt_tokens for o in good)
    return {
        "label": args.label,
        "command": shlex.join(["python", *sys.argv]),
        "server_command": args.server_command,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "server_command")},
        "server": {"base_url": args.base_url, "models": models.get("data", [])},
        "client_host": {"python": platform.python_version(), "machine": platform.machine()},
        "duration_s": duration,
        "completed": len(good),
        "failed": len(outcomes) - len(good),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "request_throughput_rps": len(good) / duration,
        "output_token_throughput_tps": out_tokens / duration,
        "total_token_throughput_tps": (in_tokens + out_tokens) / duration,
        "ttft_ms": stats([o.ttft for o in good]),
        "tpot_ms": stats([o.tpot for o in good]),
        "itl_ms": stats([x for o in good for x in o.itl]),
        "e2e_ms": stats([o.e2e for o in good]),
        "server_counters": server_counters,
    }


def stats(seconds: list[float]) -> dict[str, float]:
    values = sorted(1000.0 * s for s in seconds if not math.isnan(s))
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan, "n": 0}
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "n": len(values)}


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


COUNTERS = ("specloop_prompt_tokens_total", "specloop_generation_tokens_total",
            "specloop_spec_decode_num_drafts_total", "specloop_spec_decode_num_draft_tokens_total",
            "specloop_spec_decode_num_accepted_tokens_total")


def counter_deltas(before: str, after: str) -> dict[str, float]:
    """How much the server's own counters moved during the run (absent ones are skipped)."""

    def read(text: str) -> dict[str, float]:
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in COUNTERS:
                values[name] = float(value)
        return values

    b, a = read(before), read(after)
    return {name: a[name] - b.get(name, 0.0) for name in a}


def print_table(result: dict[str, Any]) -> None:
    cfg = result["config"]
    mode = f"Poisson {cfg['request_rate']}/s" if cfg["request_rate"] else f"concurrency {cfg['concurrency']}"
    print(f"\n{result['label'] or 'serve benchmark'}: {cfg['num_requests']} requests, {mode}, "
          f"prompt {cfg['prompt_len']}, output {cfg['output_len']}")
    print(f"completed {result['completed']}, failed {result['failed']}, duration {result['duration_s']:.2f} s")
    print(f"throughput: {result['request_throughput_rps']:.2f} req/s, "
          f"{result['output_token_throughput_tps']:.1f} output tok/s, "
          f"{result['total_token_throughput_tps']:.1f} total tok/s")
    print(f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = result[key]
        print(f"{key[:-3].upper():<12}{s['mean']:>10.1f}{s['p50']:>10.1f}{s['p90']:>10.1f}{s['p99']:>10.1f}")
    for error in result["errors"]:
        print(f"error: {error}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most (0: no limit)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-min", type=int, default=3, help="prompt token ids are drawn from [min, max)")
    p.add_argument("--token-max", type=int, default=259, help="259: the byte tokens every shipped tokenizer has")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per read")
    p.add_argument("--label", default="")
    p.add_argument("--server-command", default="", help="how the server was started (recorded in the JSON)")
    p.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    print_table(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
