"""Where one prompt's prefill (time to first token) goes on the GPU, per FlashLoop variant.

    python -m specloop.cli random-checkpoint /tmp/ouro14 --preset ouro-1.4b
    python bench/profile_prefill.py --model /tmp/ouro14 --prompt 8192 --variants dense,int4 \
        --out bench/results/profile_prefill_8k_h200.json

Per variant (dense; int4: --kv-residual-quantization '{}'; int4-exec: the same with the
execution policy; sparse: token-sparse prefill; all: the three updates; any of them with
"-paged" after it: prompt chunks through the paged kernel, not flash attention), one engine
(random ouro-1.4b bf16, CUDA graphs for decode as the engine's defaults, 2048 rows a plan)
runs a warm-up prompt (Triton compiles), then the same-length prompt with max_tokens 1:
- ttft_s: wall time from add_request to the first token (best of --reps);
- under torch.profiler, one more such prompt: CUDA kernel time in total and the kernels that
  take most of it (ms for the whole prompt), and the forward calls it took; the host side's
  CUDA runtime calls (launches, copies, allocations, synchronizations: count and host ms);
- under cProfile, one more: the Python functions with the most own time and the most
  cumulative time (where the host spends a prompt's prefill, waits included).
Wall minus kernel time is what the GPU sits idle (host work of eager prefill passes).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gzip
import io
import json
import pstats
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specloop.engine.config import EngineConfig  # noqa: E402
from specloop.engine.core import EngineCore  # noqa: E402
from specloop.kernels import flash_prefill  # noqa: E402
from specloop.sampling_params import SamplingParams  # noqa: E402

VARIANTS = {
    "dense": {},
    "int4": {"kv_residual_quantization": {}},
    "int4-exec": {"kv_residual_quantization": {"policy": "execution"}},
    "sparse": {"token_sparse_prefill": {}},
    "sparse-recipe": {"token_sparse_prefill": {"retention": [1.0, 1.0, 1.0, 0.5]}},  # issue 38's quality recipe
    "all": {"kv_residual_quantization": {}, "token_sparse_prefill": {}, "sparse_decode_attention": {}},
}


def _prefill(engine: EngineCore, rid: str, prompt: list[int]) -> float:
    t = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while True:
        if any(o.token_ids for o in engine.step()):
            break
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    engine.drain()
    return dt


def _host_profile(engine: EngineCore, prompt: list[int], top: int) -> dict:
    """One more prefill under cProfile: the top functions by own and by cumulative seconds."""
    prof = cProfile.Profile()
    prof.enable()
    wall = _prefill(engine, "host", prompt)
    prof.disable()
    out = {"host_profiled_wall_s": wall}
    for key, sort in (("host_tottime_s", "tottime"), ("host_cumtime_s", "cumulative")):
        stats = pstats.Stats(prof, stream=io.StringIO()).sort_stats(sort)
        rows = []
        for func in stats.fcn_list[:top]:  # (file, line, name), in sort order
            _, _, tt, ct, _ = stats.stats[func]
            rows.append([f"{Path(func[0]).name}:{func[1]}({func[2]})", round(tt, 4), round(ct, 4)])
        out[key] = rows
    return out


def _variant(name: str, args: argparse.Namespace) -> dict:
    """`name`: a VARIANTS key, or one with "-paged" after it: prompt chunks through the
    paged kernel instead of flash attention (the path before it, for an A/B in one process)."""
    base = name.removesuffix("-paged")
    supported = flash_prefill.supported
    if name != base:
        flash_prefill.supported = lambda *a: False
    try:
        engine = EngineCore(EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=16,
                                         max_num_batched_tokens=args.rows, max_model_len=args.max_model_len,
                                         **VARIANTS[base]))
    finally:
        flash_prefill.supported = supported
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.reps + 3)]
    warm = _prefill(engine, "warm", prompts[0])
    ttfts = [_prefill(engine, f"r{i}", prompts[1 + i]) for i in range(args.reps)]
    n0 = engine.executor.num_submitted
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        wall = _prefill(engine, "prof", prompts[-1])
    calls = engine.executor.num_submitted - n0
    kernels: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    runtime: dict[str, list] = {}  # CUDA runtime/driver calls on the host: [count, host ms]
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if t and e.device_type == DeviceType.CUDA:  # kernels and copies, not the CPU ops that launched them
            kernels[e.key] += t
            counts[e.key] += e.count
        if e.key.startswith(("cuda", "cu")) and e.self_cpu_time_total:
            runtime[e.key] = [e.count, e.self_cpu_time_total / 1e3]
    if args.trace:  # the chrome trace of the profiled prompt, gzipped (chrome://tracing, Perfetto)
        raw = Path(args.trace) / f"prefill_{name}.json"
        raw.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    host = _host_profile(engine, prompts[-2], args.top)
    kernel_ms = sum(kernels.values()) / 1e3
    record = {"variant": name, "features": VARIANTS[base], "rows": args.rows,
              "flash_prefill": engine.backend.contiguous_min_rows is not None, "prompt": args.prompt, "warm_s": warm,
              "ttft_s": min(ttfts), "ttfts_s": ttfts, "profiled_wall_s": wall, "forward_calls": calls,
              "kernel_ms": kernel_ms, "gpu_idle_fraction": max(0.0, 1 - kernel_ms / 1e3 / wall),
              "top_kernels_ms": {k: v / 1e3 for k, v in kernels.most_common(args.top)},
              "top_kernels_calls": {k: counts[k] for k, _ in kernels.most_common(args.top)},
              "cuda_runtime_host": dict(sorted(runtime.items(), key=lambda kv: -kv[1][1])), **host}
    del engine
    torch.cuda.empty_cache()
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--rows", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--max-model-len", type=int, default=33024)
    p.add_argument("--variants", default="dense,int4")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--top", type=int, default=16)
    p.add_argument("--trace", default="", help="folder for a gzipped chrome trace per variant")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    cases = []
    for name in args.variants.split(","):
        cases.append(_variant(name, args))
        c = cases[-1]
        print(f"== {name}: ttft {c['ttft_s'] * 1e3:.1f} ms (warm-up {c['warm_s']:.1f} s), profiled "
              f"{c['profiled_wall_s'] * 1e3:.1f} ms over {c['forward_calls']} calls, kernels {c['kernel_ms']:.1f} ms",
              flush=True)
        for k, v in c["top_kernels_ms"].items():
            print(f"   {v:8.2f} ms {c['top_kernels_calls'][k]:6d}x  {k[:110]}")
        print("   host CUDA calls:", ", ".join(f"{k} {n}x {ms:.1f} ms" for k, (n, ms) in
                                           list(c["cuda_runtime_host"].items())[:8]))
        print(f"   cProfile ({c['host_profiled_wall_s'] * 1e3:.0f} ms), own s / cumulative s:")
        for name, tt, ct in c["host_tottime_s"][:12]:
            print(f"     {tt:7.3f} {ct:7.3f}  {name}")
    record = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "torch": torch.__version__, "cases": cases}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
