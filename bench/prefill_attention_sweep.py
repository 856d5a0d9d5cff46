"""Prompt-chunk attention kernels alone: launch configurations against flash SDPA.

    python bench/prefill_attention_sweep.py --out bench/results/prefill_attention_sweep_h100.json

An 8K prompt as the engine prefills it (chunks of `--rows` consecutive rows at one depth
plane, each reading every key up to its own, causally), one layer: the dense paged kernel
(`paged_attention`, 16-token pages shuffled over the pool) and INT4's two-source chunk
kernel (`chunk_attention.two_source_attention`, keys read once as the chunk's last query
reads them, seals a group and a tail behind each key), each over a grid of (tile rows,
block_n, warps, stages), against PyTorch's flash SDPA on the same chunks with contiguous K/V
and a lower-right causal mask (the yardstick of issue 39: ~540 TFLOP/s on the H200). Times are
the median of `--reps` CUDA-event timed calls of all chunks of the prompt; TFLOP/s counts the
causal pairs only (4 x pairs x head_dim x heads). On CPU (interpreter) it runs one tiny
configuration as a smoke test, its numbers meaningless.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import torch.nn.functional as F

from specloop.kernels.chunk_attention import seal_reach, two_source_attention_triton
from specloop.kernels.paged_attention import paged_attention


def timed(fn, reps: int) -> float:
    """Median ms of one call (wall time on CPU)."""
    fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=2048, help="rows a chunk (max_num_batched_tokens)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--tail", type=int, default=64, help="seals lie a group and this tail past each key")
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--tile-rows", default="64,128")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--kernels", default="dense,two-source")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    ints = lambda xs: [int(x) for x in xs.split(",")]  # noqa: E731
    if not cuda:  # the interpreter: one tiny configuration
        args.prompt, args.rows, args.heads, args.kv_heads, args.dim, args.reps = 128, 64, 2, 1, 16, 1
        args.tile_rows, args.block_n, args.warps, args.stages = "16", "32", "4", "2"
    gen = torch.Generator().manual_seed(0)
    c, h, hkv, dim, page = args.prompt, args.heads, args.kv_heads, args.dim, args.page
    pages = -(-c // page)
    tables = torch.randperm(pages, generator=gen).to(device=device, dtype=torch.int32)
    k_tail = torch.randn(pages * page, hkv, dim, generator=gen).to(device, dtype)
    v_tail = torch.randn(pages * page, hkv, dim, generator=gen).to(device, dtype)
    j = torch.arange(c)
    slots = (tables.cpu().long()[j // page] * page + j % page).to(device)
    k_flat, v_flat = k_tail[slots], v_tail[slots]  # [C, Hkv, D] in position order
    q_all = torch.randn(c, h, dim, generator=gen).to(device, dtype)
    chunks = [(s, min(args.rows, c - s)) for s in range(0, c, args.rows)]
    pairs = sum(r * s + r * (r + 1) // 2 for s, r in chunks)
    flops = 4 * pairs * dim * h
    seals = ((j // args.group + 1) * args.group + args.tail).to(device=device, dtype=torch.int32)
    report: dict = {"command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                    "shape": {"prompt": c, "rows": args.rows, "heads": h, "kv_heads": hkv, "dim": dim, "page": page},
                    "flops": flops, "cases": []}

    # every kernel computes the same thing here (k_read is the exact keys): its error against
    # an fp32 causal attention is printed with its time, so a broken configuration shows
    want = torch.empty(c, h, dim, dtype=torch.float32, device=device)
    for s, r in chunks:
        q = q_all[s: s + r].float().transpose(0, 1)
        k = k_flat[: s + r].float().repeat_interleave(h // hkv, 1).transpose(0, 1)
        v = v_flat[: s + r].float().repeat_interleave(h // hkv, 1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) * dim ** -0.5
        hidden = torch.arange(s + r, device=device)[None, :] > torch.arange(s, s + r, device=device)[:, None]
        want[s: s + r] = (scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v).transpose(0, 1)
    out = torch.empty(c, h, dim, dtype=dtype, device=device)

    def record(kernel: str, config: dict, ms: float) -> None:
        tflops = flops / ms / 1e9
        err = (out.float() - want).abs().max().item()
        report["cases"].append({"kernel": kernel, **config, "ms": ms, "tflops": tflops, "max_err": err})
        print(f"{kernel:10s} {config}: {ms:7.3f} ms  {tflops:6.1f} TFLOP/s  max err {err:.2e}", flush=True)

    if cuda:  # the yardstick: flash SDPA with contiguous K/V per chunk
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        def sdpa() -> None:
            for s, r in chunks:
                q = q_all[s: s + r].transpose(0, 1)[None]
                k = k_flat[: s + r].transpose(0, 1)[None]
                v = v_flat[: s + r].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(r, s + r),
                                                   enable_gqa=h != hkv)
                out[s: s + r] = o[0].transpose(0, 1)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            try:
                out.zero_()
                with sdpa_kernel([backend]):
                    record("sdpa", {"backend": backend.name}, timed(sdpa, args.reps))
            except RuntimeError as err:
                print(f"sdpa {backend.name}: {str(err).splitlines()[0]}")
    positions = torch.arange(c, device=device)
    grid = list(itertools.product(ints(args.tile_rows), ints(args.block_n), ints(args.warps), ints(args.stages)))
    for tile_rows, block_n, warps, stages in grid:
        config = {"tile_rows": tile_rows, "block_n": block_n, "warps": warps, "stages": stages}
        if "dense" in args.kernels:
            tiles = torch.tensor([(s + t, min(tile_rows, s + r - (s + t)), 0) for s, r in chunks
                                  for t in range(0, r, tile_rows)], dtype=torch.int32, device=device)

            def dense() -> None:
                paged_attention(q_all, k_tail, v_tail, tables, positions, tiles, page, tile_rows=tile_rows,
                                block_n=block_n, num_warps=warps, num_stages=stages, out=out)
            try:
                out.zero_()
                record("dense", config, timed(dense, args.reps))
            except Exception as err:  # out of shared memory or registers: skip that configuration
                print(f"dense {config}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
        if "two-source" in args.kernels:
            per_chunk = []
            for s, r in chunks:
                rows = positions[s: s + r]
                last = rows.max()[None]
                per_chunk.append((s, r, last, seal_reach(seals[: s + r], last)))

            def two_source() -> None:
                for s, r, last, reach in per_chunk:
                    out[s: s + r] = two_source_attention_triton(q_all[s: s + r], k_flat[: s + r], v_flat[: s + r], k_tail, v_tail,
                                                tables, 0, page, positions[s: s + r], seals[: s + r], last,
                                                reach=reach, tile_rows=tile_rows, block_n=block_n,
                                                num_warps=warps, num_stages=stages)
            try:
                out.zero_()
                record("two-source", config, timed(two_source, args.reps))
            except Exception as err:
                print(f"two-source {config}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
    for kernel in ("dense", "two-source"):
        best = min((x for x in report["cases"] if x["kernel"] == kernel), key=lambda x: x["ms"], default=None)
        if best:
            print(f"best {kernel}: {best}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
