"""The one-row matmul kernel (`specloop.kernels.gemv`) against cuBLAS, then in the engine.

    python bench/gemv_sweep.py --out bench/results/gemv_sweep_h100.json [--model /tmp/ouro14]

Kernels: the `ouro-1.4b` shapes (qkv, o, gate_up, down of a layer, and the head) at one
row, cuBLAS (`torch.matmul`) and every launch in the sweep's grid; each timed as one CUDA
graph of 24 calls on 24 copies of the weight (a layer's worth each, so the reads come
from HBM, not L2, as in a decode step), replayed 20 times after a warm-up; reported per
call with the weight bytes read per second, the best launch and the default.

(bench/results/gemv_sweep_kernels_h100.json is the earlier sweep at d4ac0f4, which also
timed 8 and 32 rows with a tensor-core form, since removed: at best level with cuBLAS.)

Engine (`--model`): decode after a 1K prompt at `--batches` (128 tokens, greedy, bf16, CUDA
graphs) before (cuBLAS everywhere, each paired norm as its two launches), with the paired
norms alone, and after (both), alternated twice in one process (an engine each; graphs
are captured at start-up, so the switches are read then).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from specloop.kernels import gemv, norms

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "head": (49152, 2048)}
COPIES = 24
REPLAYS = 20


def _grid() -> list[gemv.Tiles]:
    return [gemv.Tiles(n, k, w, s) for n, k, w, s in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), (1, 3))]


def _time(fn, weights: list[torch.Tensor]) -> float:
    """Seconds a call: one graph of a call per weight copy, replayed REPLAYS times."""
    for w in weights[:2]:
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (REPLAYS * len(weights))


def sweep_kernels(rows_list: list[int], save) -> dict:
    """`save(out)` after each shape, so that a cut run keeps what it measured."""
    out: dict = {}
    grid = _grid()
    for name, (n, k) in SHAPES.items():
        copies = 2 if name == "head" else COPIES  # 200 MB a copy: past L2 already
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        nbytes = n * k * 2
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, weights[0])
            cublas = _time(lambda w: torch.matmul(x, w.T, out=y), weights)
            results = []
            for t in grid:
                try:
                    got = gemv.gemv(x, weights[0], t)
                    err = (got.float() - want.float()).abs().max().item()
                    sec = _time(lambda w, t=t: gemv.gemv(x, w, t, out=y), weights)
                except Exception as e:  # a launch the compiler refuses (shared memory): skipped, listed
                    results.append({"tiles": t._asdict(), "error": f"{type(e).__name__}: {str(e)[:120]}"})
                    continue
                results.append({"tiles": t._asdict(), "us": sec * 1e6, "tb_s": nbytes / sec / 1e12, "max_err": err})
            ok = [r for r in results if "us" in r]
            best = min(ok, key=lambda r: r["us"])
            default = next((r for r in ok if r["tiles"] == gemv.DEFAULT_TILES._asdict()), {"us": float("nan")})
            out[f"{name}_m{rows}"] = {
                "n": n, "k": k, "rows": rows, "cublas_us": cublas * 1e6, "cublas_tb_s": nbytes / cublas / 1e12,
                "best": best, "default": default, "all": results}
            print(f"{name:8s} M={rows:2d}  cuBLAS {cublas * 1e6:7.1f} us {nbytes / cublas / 1e12:4.2f} TB/s | "
                  f"best {best['us']:7.1f} us {best['tb_s']:4.2f} TB/s {tuple(best['tiles'].values())} | "
                  f"default {default['us']:7.1f} us", flush=True)
        del weights
        torch.cuda.empty_cache()
        save(out)
    return out


def _decode(model: str, batch: int, tokens: int) -> float:
    """Output tok/s of `batch` requests decoding after a 1K prompt (time from the last first
    token to the end)."""
    from specloop.engine.config import EngineConfig
    from specloop.engine.core import EngineCore
    from specloop.sampling_params import SamplingParams

    engine = EngineCore(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_num_seqs=16,
                                     kv_cache_bytes=8 << 30, max_model_len=4096))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    engine.add_request("warm-up", torch.randint(3, 1000, (64,), generator=gen).tolist(), params)
    engine.drain()
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(3, 1000, (1024,), generator=gen).tolist(), params)
    times: dict[str, list[float]] = {}
    torch.cuda.synchronize()
    start = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            times.setdefault(o.request_id, []).extend([time.perf_counter() - start] * len(o.token_ids))
    first = max(t[0] for t in times.values())
    last = max(t[-1] for t in times.values())
    emitted = sum(sum(1 for x in t if x > first) for t in times.values())
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return emitted / (last - first)


def _norms_apart(h, x, weight, eps, weight2, eps2):
    """The layer's paired norm as the two launches it replaced (the "before" of the A/B)."""
    out = norms.add_rms_norm(h, x, weight, eps)
    return out, norms.rms_norm(out, weight2, eps2)


def engine_ab(model: str, batches: list[int], tokens: int) -> dict:
    """before: cuBLAS and four norm launches a layer; norms: paired norms (two a layer);
    after: paired norms and the one-row kernel (with the activation in the down product)."""
    runs: dict = {}
    use, paired = gemv.use_gemv, norms.add_rms_norm_pair
    for _rep in range(2):
        for label in ("before", "norms", "after"):
            gemv.use_gemv = use if label == "after" else (lambda x, w: False)
            norms.add_rms_norm_pair = _norms_apart if label == "before" else paired
            for b in batches:
                rate = _decode(model, b, tokens)
                runs.setdefault(f"{label}_b{b}", []).append(rate)
                print(f"engine {label:6s} batch {b}: {rate:7.1f} tok/s", flush=True)
    gemv.use_gemv, norms.add_rms_norm_pair = use, paired
    return {k: {"tok_s": v, "median": statistics.median(v)} for k, v in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--no-kernels", action="store_true")
    p.add_argument("--model", help="a checkpoint for the engine A/B (bf16 ouro-1.4b)")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    result = {"command": " ".join(["python"] + sys.argv), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save(part: str, value: dict) -> None:
        result[part] = value
        Path(args.out).write_text(json.dumps(result, indent=1))

    if not args.no_kernels:
        sweep_kernels([1], lambda out: save("kernels", out))
    if args.model:
        save("engine", engine_ab(args.model, [int(b) for b in args.batches.split(",")], args.tokens))


if __name__ == "__main__":
    main()
