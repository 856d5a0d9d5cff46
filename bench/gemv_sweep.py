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
graphs) with cuBLAS, with the one-row kernel and RoPE in its own launch, with RoPE in the
qkv product's epilogue (`gemv.gemv_rope`), the same with the products as programmatic
dependent launches (`pdl`: `specloop.kernels.pdl` on, the kernels before them not
releasing early; `pdl-early`: also the norms and attention releasing them as they start),
and, after a kernel sweep, with each shape's
best launch of the sweep in place of the default; alternated twice in one process (an engine
each; graphs are captured at start-up, so the switches are read then). (The paired norms'
A/B, before / after `norms.add_rms_norm_pair`: bench/results/gemv_sweep_engine_onerow_h100.json.)
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

from specloop.kernels import gemv, pdl
from specloop.kernels.rope import rope_

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "head": (49152, 2048)}
COPIES = 24
REPLAYS = 20


def _grid() -> list[gemv.Tiles]:
    return [gemv.Tiles(n, k, w, s) for n, k, w, s in itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8), (1, 3))]


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


def _rope_apart(x, weight, positions, inv_freq, rotated, tiles=gemv.DEFAULT_TILES):
    """The qkv product then `rope_`, two launches (what `gemv.gemv_rope` replaced)."""
    out = gemv.gemv(x, weight, tiles)
    half = inv_freq.numel()
    rope_(out[:, :rotated].view(1, rotated // (2 * half), 2 * half), positions, inv_freq)
    return out


def engine_ab(model: str, batches: list[int], tokens: int, tuned: dict) -> dict:
    """cublas: no one-row kernel (paired norms on, as everywhere); gemv: the one-row kernel
    with RoPE in its own launch; rope: RoPE in the qkv product's epilogue; tuned (when the
    kernel sweep ran): that, with each shape's best launch from the sweep (`tuned`); pdl: rope
    with every one-row product a programmatic dependent launch (`pdl.ENABLED`), pdl-early:
    that with the kernels before them releasing them as they start (`pdl.RELEASE_EARLY`;
    the engine's default since 2026-12-07). Every variant but the pdl ones runs with PDL off."""
    runs: dict = {}
    use, fused, launch = gemv.use_gemv, gemv.gemv_rope, gemv._launch
    pdl_on, release = pdl.ENABLED, pdl.RELEASE_EARLY

    def tuned_launch(x, weight, out, tiles, silu=False, rope=None):
        return launch(x, weight, out, tuned.get(tuple(weight.shape), tiles), silu, rope)
    labels = ("cublas", "gemv", "rope", "pdl", "pdl-early") + (("tuned",) if tuned else ())
    for _rep in range(2):
        for label in labels:
            gemv.use_gemv = (lambda x, w: False) if label == "cublas" else use
            gemv.gemv_rope = _rope_apart if label == "gemv" else fused
            gemv._launch = tuned_launch if label == "tuned" else launch
            pdl.ENABLED = label.startswith("pdl")
            pdl.RELEASE_EARLY = label == "pdl-early"
            for b in batches:
                rate = _decode(model, b, tokens)
                runs.setdefault(f"{label}_b{b}", []).append(rate)
                print(f"engine {label:9s} batch {b}: {rate:7.1f} tok/s", flush=True)
    gemv.use_gemv, gemv.gemv_rope, gemv._launch = use, fused, launch
    pdl.ENABLED, pdl.RELEASE_EARLY = pdl_on, release
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

    tuned: dict = {}
    if not args.no_kernels:
        pdl_on, pdl.ENABLED = pdl.ENABLED, False  # each launch alone, as cuBLAS's and the earlier sweeps'
        kernels = sweep_kernels([1], lambda out: save("kernels", out))
        pdl.ENABLED = pdl_on
        tuned = {(v["n"], v["k"]): gemv.Tiles(**v["best"]["tiles"]) for v in kernels.values()}
        result["tuned"] = {f"{n}x{k}": t._asdict() for (n, k), t in tuned.items()}
    if args.model:
        save("engine", engine_ab(args.model, [int(b) for b in args.batches.split(",")], args.tokens, tuned))


if __name__ == "__main__":
    main()
