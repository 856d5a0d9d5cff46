"""Serving-core baseline on the GPU: decode and prefill speed against the floors.

Usage (device machine; a random checkpoint is written first):
    python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b
    python bench/baseline.py --model /tmp/ouro14 --out bench/results/baseline_ouro-1.4b.json

Cases (random weights, bf16, greedy, ignore_eos):
- batch-1 decode after a 1K-token prompt: time per output token (TPOT) over the decode
  phase, i.e. (time of last token - time of first token) / (tokens - 1);
- batch-32 decode after 1K-token prompts: aggregate output tokens/s over the window in
  which all 32 requests are decoding;
- batch-1 decode after an 8K-token prompt (TPOT as above);
- 128 concurrent requests, 1K in / 128 out: output tokens / wall time from submission
  to the last token;
- an 8K-token prompt with max_tokens=1: time to first token, and peak CUDA memory.
Floors follow ../shared/docs/gpu.md: bytes / 4.3 TB/s and FLOPs / 790 TFLOP/s, the larger.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams

BANDWIDTH = 4.3e12  # bytes/s, device-to-device copy measured on the H200 (gpu.md)
MATMUL = 790e12  # bf16 FLOP/s (gpu.md)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def _run(engine: EngineCore, prompts: list[list[int]], max_tokens: int,
         trace: list[tuple[float, int, int]] | None = None) -> dict[str, list[float]]:
    """Submit all prompts at once; per request, the wall time of each output token.
    `trace` gets (time, tokens the step's plan took in, requests running) per step."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {}
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        times[f"r{i}"] = []
    entered = engine.iteration_tokens.total
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter() - start
            times[out.request_id].extend([now] * len(out.token_ids))
        if trace is not None:
            trace.append((time.perf_counter() - start, engine.iteration_tokens.total - entered,
                          len(engine.scheduler.running)))
            entered = engine.iteration_tokens.total
    return times


def _phases(trace: list[tuple[float, int, int]], last_first_token: float) -> dict:
    """Where a many-request case's time went: steps before the last first token (prompts
    still entering) and after it (decode only), their mean step time and tokens a step, and
    the most requests running at once (a pool that holds fewer runs the rest later)."""
    out = {"steps": len(trace), "most_running": max((r for _, _, r in trace), default=0)}
    before, prev = [], 0.0
    after = []
    for t, tokens, running in trace:
        (before if t <= last_first_token else after).append((t - prev, tokens, running))
        prev = t
    for name, part in (("until_last_first_token", before), ("after", after)):
        secs = sum(d for d, _, _ in part)
        out[name] = {"steps": len(part), "seconds": secs,
                     "ms_per_step": 1e3 * secs / max(len(part), 1),
                     "tokens_per_step": sum(k for _, k, _ in part) / max(len(part), 1),
                     "mean_running": sum(r for _, _, r in part) / max(len(part), 1)}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="rows a forward call")
    p.add_argument("--ttft-repeats", type=int, default=3, help="8K prompts timed (the median is reported)")
    args = p.parse_args()
    engine = EngineCore(EngineConfig(model=args.model, dtype="bfloat16", device="cuda", max_num_seqs=128,
                                     max_num_batched_tokens=args.max_num_batched_tokens,
                                     attention_backend=args.attention_backend,
                                     enforce_eager=args.enforce_eager,
                                     gpu_memory_utilization=args.gpu_memory_utilization))
    cfg = engine.model.config
    vocab, loops = cfg.vocab_size, cfg.num_loops
    stack_bytes = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters() if ".layers." in n)
    head_bytes = engine.model.lm_head.weight.numel() * engine.model.lm_head.weight.element_size()
    kv_token_bytes = cfg.kv_bytes_per_token(2)  # every plane, K and V

    _run(engine, _prompts(2, 64, vocab, 0), 8)  # warm-up: kernels, allocator

    # batch-1 decode after a 1K prompt
    t = _run(engine, _prompts(1, 1024, vocab, 1), args.decode_tokens)["r0"]
    tpot1 = (t[-1] - t[0]) / (len(t) - 1)
    ctx = 1024 + args.decode_tokens / 2
    floor1 = (loops * stack_bytes + head_bytes + ctx * kv_token_bytes) / BANDWIDTH

    # batch-32 decode after 1K prompts
    t32 = _run(engine, _prompts(32, 1024, vocab, 2), args.decode_tokens)
    window_start = max(ts[0] for ts in t32.values())
    window_end = min(ts[-1] for ts in t32.values())
    in_window = sum(sum(1 for x in ts if window_start < x <= window_end) for ts in t32.values())
    agg32 = in_window / (window_end - window_start)
    floor32_step = (loops * stack_bytes + head_bytes + 32 * ctx * kv_token_bytes) / BANDWIDTH  # one token each

    # batch-1 decode after 8K
    t8d = _run(engine, _prompts(1, 8192, vocab, 4), args.decode_tokens)["r0"]
    tpot8 = (t8d[-1] - t8d[0]) / (len(t8d) - 1)
    floor8 = (loops * stack_bytes + head_bytes + (8192 + args.decode_tokens / 2) * kv_token_bytes) / BANDWIDTH

    # 128 concurrent, 1K in / 128 out
    trace128: list[tuple[float, int, int]] = []
    t128 = _run(engine, _prompts(128, 1024, vocab, 5), 128, trace128)
    out128 = sum(len(ts) for ts in t128.values()) / max(ts[-1] for ts in t128.values())
    ttft128 = sorted(ts[0] for ts in t128.values())
    phases128 = _phases(trace128, ttft128[-1])

    # 8K prefill (the median of --ttft-repeats prompts)
    torch.cuda.reset_peak_memory_stats()
    kv_alloc = torch.cuda.memory_allocated()
    t8s = [_run(engine, _prompts(1, 8192, vocab, 3 + 100 * i), 1)["r0"][0] for i in range(args.ttft_repeats)]
    t8 = statistics.median(t8s)
    peak = torch.cuda.max_memory_allocated()
    n = 8192
    linear_flops = 2 * (stack_bytes / 2) * loops * n
    attn_flops = loops * cfg.num_hidden_layers * 2 * 2 * (n * n / 2) * cfg.num_attention_heads * cfg.head_dim
    floor8k = max((linear_flops + attn_flops) / MATMUL, (loops * stack_bytes + n * kv_token_bytes) / BANDWIDTH)

    result = {
        "command": " ".join(["python"] + sys.argv),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "engine": engine.config.summary(),
        "num_kv_pages": engine.kv.num_pages,
        "batch1_decode": {"prompt": 1024, "tokens": len(t), "tpot_ms": 1e3 * tpot1, "tokens_per_s": 1 / tpot1,
                          "floor_ms": 1e3 * floor1, "gap": tpot1 / floor1},
        "batch32_decode": {"prompt": 1024, "tokens_per_request": args.decode_tokens, "aggregate_tokens_per_s": agg32,
                           "floor_tokens_per_s": 32 / floor32_step, "gap": (32 / floor32_step) / agg32},
        "batch1_decode_after_8k": {"prompt": 8192, "tokens": len(t8d), "tpot_ms": 1e3 * tpot8,
                                   "tokens_per_s": 1 / tpot8, "floor_ms": 1e3 * floor8, "gap": tpot8 / floor8},
        "concurrent128": {"prompt": 1024, "tokens_per_request": 128, "output_tokens_per_s": out128,
                          "ttft_p50_s": ttft128[len(ttft128) // 2], "ttft_p99_s": ttft128[int(0.99 * (len(ttft128) - 1))],
                          "phases": phases128,
                          # how many of these requests the KV pool holds at once, whole (every plane's
                          # pages of 1,152 tokens): fewer than 128 and the rest wait or preempt
                          "pool_holds_requests": engine.kv.num_pages // engine.kv.pages_at_once(1024 + 128)},
        "prefill_8k": {"ttft_s": t8, "ttfts_s": t8s, "floor_s": floor8k, "gap": t8 / floor8k,
                       "peak_cuda_gib": peak / 2**30, "kv_pool_and_weights_gib": kv_alloc / 2**30},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'case':16s} {'measured':>22s} {'floor':>22s} {'gap':>6s}")
    b1, b32, p8 = result["batch1_decode"], result["batch32_decode"], result["prefill_8k"]
    print(f"{'batch-1 decode':16s} {b1['tpot_ms']:17.2f} ms/t {b1['floor_ms']:17.2f} ms/t {b1['gap']:6.1f}")
    print(f"{'batch-32 decode':16s} {agg32:19.0f} t/s {b32['floor_tokens_per_s']:19.0f} t/s {b32['gap']:6.1f}")
    print(f"{'b1 after 8K':16s} {1e3 * tpot8:17.2f} ms/t {1e3 * floor8:17.2f} ms/t {tpot8 / floor8:6.1f}")
    print(f"{'128 x 1K/128':16s} {out128:19.0f} t/s   TTFT p50 {ttft128[len(ttft128) // 2]:.3f} s, "
          f"p99 {result['concurrent128']['ttft_p99_s']:.3f} s; the pool holds "
          f"{result['concurrent128']['pool_holds_requests']} of them at once")
    for name in ("until_last_first_token", "after"):
        ph = phases128[name]
        print(f"  128 x 1K {name}: {ph['steps']} steps, {ph['seconds']:.2f} s, {ph['ms_per_step']:.1f} ms a step, "
              f"{ph['tokens_per_step']:.0f} tokens in a step, {ph['mean_running']:.0f} running "
              f"(most {phases128['most_running']})")
    print(f"{'8K prefill':16s} {t8:19.3f} s   {floor8k:19.3f} s   {p8['gap']:6.1f}")
    print(f"peak CUDA memory {peak / 2**30:.1f} GiB (KV pool + weights {kv_alloc / 2**30:.1f} GiB)")


if __name__ == "__main__":
    main()
