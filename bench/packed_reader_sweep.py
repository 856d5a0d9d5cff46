"""The packed reader alone: one decode row's attention over INT4 residual planes against
the BF16 paged kernel over the same context, across key block sizes, splits and warps.

Usage (device machine):
    python bench/packed_reader_sweep.py --out bench/results/packed_reader_sweep_h200.json
A smoke run without a GPU (interpreter; its times mean nothing):
    TRITON_INTERPRET=1 python bench/packed_reader_sweep.py --out /tmp/sweep.json --lengths 200 \
        --heads 4 --kv-heads 4 --dim 32 --tail 16 --reps 1 --block-n 32 --splits engine,2 --warps default

What it times (CUDA events around one replay of a CUDA graph of the call, after warm-up, the
median of --reps; ../shared/docs/gpu.md):
one layer's attention for `--batch` cells of `--length` positions each, one query row per
cell at position length - 1, at depth --depth (0-based: 3 reads four planes). Every plane is
dense (every position has a row at every plane: the common case without token-sparse
prefill), every group sealed except the BF16 tail's last --tail positions, which the
reader loads exact, as in a decode step. The shape is ouro-1.4b's (16 query and 16 KV
heads of 128 channels) unless told otherwise. The BF16 kernel (`paged_attention`) reads
the same length from pages with its own split choice; the packed one is swept over
block_n x num_splits x num_warps, each checked against its reference first, the engine's
choice (block_n 32, `packed_splits`, Triton's default warps) marked `engine`. (The
recorded bench/results/packed_reader_sweep_h200.json also swept a branching decode variant,
since deleted: it was slower everywhere.) Bytes each reads are counted (packed: codes and
fp16 parameters of every plane up to the depth, the tail's BF16; BF16: every key and
value), so each time comes with the bandwidth it reaches.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specloop.kernels.int4_groups import quantize_k_groups, quantize_v_groups
from specloop.kernels.packed_attention import (
    MIN_SPLIT_KEYS, packed_attention_reference, packed_attention_triton, packed_splits,
)
from specloop.kernels.packed_keys import PackedKV
from specloop.kernels.packed_rows import NEVER
from specloop.kernels.paged_attention import TILE_COLUMNS, block_g, choose_splits, paged_attention

GROUP = 64
ENGINE_BLOCK_N = 32  # the engine's packed reader launches (specloop/kernels/packed_attention.py)
ENGINE_SEALED = ("on", "default", "32")  # packed_attention_triton's defaults: sealed pass, its warps and chunk


def build(batch: int, length: int, planes: int, heads: int, kv_heads: int, dim: int, tail: int, page: int,
          device: str) -> dict:
    """Cells of `length` positions, every plane dense, groups sealed up to the tail."""
    gen = torch.Generator(device=device).manual_seed(0)
    groups = -(-length // GROUP)
    ng = batch * planes * groups
    rows = torch.arange(length, dtype=torch.int32, device=device)
    row_maps = rows.expand(batch, planes, length).contiguous()
    group_tables = torch.arange(ng, dtype=torch.int32, device=device).view(batch, planes, groups)
    seal = torch.full((ng,), NEVER, dtype=torch.int32, device=device)
    sealed = (torch.arange(groups, device=device) + 1) * GROUP - 1 + tail <= length - 1  # last row + tail
    seal.view(batch, planes, groups)[..., sealed] = 0
    scale = torch.tensor([1.0] + [0.1] * (planes - 1), device=device).repeat(batch).repeat_interleave(groups)
    k = torch.randn(ng, GROUP, kv_heads, dim, generator=gen, device=device, dtype=torch.bfloat16)
    k = k * scale[:, None, None, None].to(torch.bfloat16)
    v = torch.randn(ng * GROUP, kv_heads, dim, generator=gen, device=device, dtype=torch.bfloat16)
    v = v * scale.repeat_interleave(GROUP)[:, None, None].to(torch.bfloat16)
    packed = PackedKV(quantize_k_groups(k, torch.full((ng,), GROUP, device=device)), quantize_v_groups(v), seal,
                      group_tables, row_maps)
    del k, v
    pages_per_plane = -(-length // page)
    num_pages = batch * planes * pages_per_plane
    perm = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    tables = perm  # cell c, plane p: entries [(c * planes + p) * pages_per_plane, + pages_per_plane)
    k_tail = torch.randn(num_pages * page, kv_heads, dim, generator=gen, device=device, dtype=torch.bfloat16)
    v_tail = torch.randn_like(k_tail)
    q = torch.randn(batch, heads, dim, generator=gen, device=device, dtype=torch.bfloat16)
    return {"packed": packed, "tables": tables, "k_tail": k_tail, "v_tail": v_tail, "q": q,
            "pages_per_plane": pages_per_plane, "sealed_groups": int(sealed.sum())}


def check(case: dict, rows: tuple, page: int, **kw) -> float:
    """The kernel against its torch reference on this case (a time of wrong output means
    nothing): the largest absolute difference, asserted within bf16's 2e-2."""
    args = (case["q"], case["k_tail"], case["v_tail"], case["tables"], page, case["packed"], *rows)
    got, _ = packed_attention_triton(*args, **kw)
    key = ("want", int(rows[1][0]))  # once per case and depth
    if key not in case:
        case[key] = packed_attention_reference(*args)[0].float()
    err = float((got.float() - case[key]).abs().max())
    assert err <= 2e-2, f"the packed kernel differs from its reference by {err}"
    return err


def time_ms(fn, reps: int) -> float:
    """The median GPU time of one call, replayed from a CUDA graph as the engine runs it:
    timed eagerly, a batch-1 call's launches (three kernels and their Python) took longer
    than its kernels, so the events measured the host (before 2026-12-05)."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():  # the CPU smoke run (interpreter): wall time, meaningless as speed
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--depth", default="3", help="depths, comma-separated (0-based: 3 reads four planes)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--tail", type=int, default=64)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--block-n", default="32,64")
    p.add_argument("--splits", default="engine,64,128")
    p.add_argument("--warps", default="default,8")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--max-registers", default="default", help="ptxas register caps a thread, comma-separated")
    p.add_argument("--sealed", default="on,tc,off",
                   help="on: the sealed pass reads dense sealed groups first (one-row tiles of GQA 1 on CUDA cores, "
                        "packed_sealed_row; the engine's); tc: the tensor-core sealed pass (packed_sealed) for every "
                        "tile; off: the general kernel alone")
    p.add_argument("--sealed-warps", default="default", help="the sealed pass's warps, comma-separated")
    p.add_argument("--sealed-chunk", default="32", help="channels a sealed score product takes, comma-separated")
    p.add_argument("--exact-gap", default="engine",
                   help="exact_gap, comma-separated (engine: the tail, as the engine passes it; 0: off)")
    p.add_argument("--min-split", default="engine",
                   help="min_split_keys, comma-separated (engine: MIN_SPLIT_KEYS; 0: equal shares of the context)")
    args = p.parse_args()
    planes = 4
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run under TRITON_INTERPRET=1
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 1
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter smoke run)"
    record = {"command": " ".join(sys.argv), "device": name, "torch": torch.__version__,
              "args": vars(args), "results": []}
    for length in (int(x) for x in args.lengths.split(",")):
        case = build(args.batch, length, planes, args.heads, args.kv_heads, args.dim, args.tail, args.page, device)
        b = args.batch
        for d in (int(x) for x in args.depth.split(",")):
            cell = torch.arange(b, dtype=torch.int32, device=device)
            depth = torch.full((b,), d, dtype=torch.int32, device=device)
            position = torch.full((b,), length - 1, dtype=torch.int32, device=device)
            offset = ((cell * planes + d) * case["pages_per_plane"]).to(torch.int32)
            engine_splits = choose_splits(b, args.kv_heads, length, sms)  # the BF16 kernel's
            packed_engine_splits = packed_splits(b, args.kv_heads, length, sms)
            keys = b * length
            head_bytes = args.kv_heads * args.dim
            exact = b * (length - case["sealed_groups"] * GROUP)
            packed_bytes = ((keys - exact) * (d + 1) * head_bytes  # K and V codes: a byte per two values, each
                            + (keys - exact) // GROUP * (d + 1) * head_bytes * 4  # K scale + lo per group and channel
                            + (keys - exact) * (d + 1) * args.kv_heads * -(-args.dim // GROUP) * 4  # V per row
                            + exact * head_bytes * 4)  # the tail's K and V, BF16
            bf16_bytes = keys * head_bytes * 4
            tiles = torch.stack([torch.arange(b), torch.ones(b, dtype=torch.long), offset.long().cpu()], 1)
            tiles = tiles.to(torch.int32).to(device).contiguous()
            assert tiles.shape[1] == TILE_COLUMNS
            err = check(case, (cell, depth, position, offset), args.page, num_splits=packed_engine_splits)
            tile_rows = max(1, 16 // block_g(args.heads, args.kv_heads))  # the engine's decode tiles (M >= 16)
            bf16 = time_ms(lambda: paged_attention(case["q"], case["k_tail"], case["v_tail"], case["tables"], position,
                                                   tiles, args.page, tile_rows=tile_rows, num_splits=engine_splits),
                           args.reps)
            row = {"length": length, "batch": b, "depth": d, "bf16_ms": bf16, "bf16_splits": engine_splits,
                   "engine_config_max_abs_err_vs_reference": err,
                   "bf16_gbs": bf16_bytes / bf16 / 1e6, "packed_bytes": packed_bytes, "bf16_bytes": bf16_bytes,
                   "packed": []}
            print(f"{b} x {length}, depth {d}: BF16 {bf16 * 1e3:.1f} us ({row['bf16_gbs']:.0f} GB/s), "
                  f"{engine_splits} splits", file=sys.stderr, flush=True)
            for block_n in (int(x) for x in args.block_n.split(",")):
                for splits_arg in args.splits.split(","):
                    splits = packed_engine_splits if splits_arg == "engine" else int(splits_arg)
                    for warps_arg, regs_arg, sealed, sealed_warps, chunk, min_split_arg, gap_arg in itertools.product(
                            args.warps.split(","), args.max_registers.split(","), args.sealed.split(","),
                            args.sealed_warps.split(","), args.sealed_chunk.split(","), args.min_split.split(","),
                            args.exact_gap.split(",")):
                        if sealed == "off" and (sealed_warps, chunk) != ENGINE_SEALED[1:]:
                            continue  # (the sealed pass's own knobs mean nothing without it)
                        if sealed == "on" and chunk != ENGINE_SEALED[2] and args.heads == args.kv_heads:
                            continue  # (the one-lane pass has no chunk)
                        warps = None if warps_arg == "default" else int(warps_arg)
                        regs = None if regs_arg == "default" else int(regs_arg)
                        min_split = MIN_SPLIT_KEYS if min_split_arg == "engine" else int(min_split_arg)
                        gap = args.tail if gap_arg == "engine" else int(gap_arg)
                        label = (f"block_n {block_n}, {splits} splits (min {min_split} keys), exact gap {gap}, warps {warps_arg}, "
                                 f"registers {regs_arg}, "
                                 f"sealed {sealed} (warps {sealed_warps}, chunk {chunk})")
                        kw = {"num_splits": splits, "block_n": block_n, "num_warps": warps, "max_registers": regs,
                              "sealed": sealed != "off", "sealed_row": sealed == "on", "sealed_chunk": int(chunk),
                              "sealed_warps": None if sealed_warps == "default" else int(sealed_warps),
                              "min_split_keys": min_split, "exact_gap": gap}

                        def run() -> None:
                            packed_attention_triton(case["q"], case["k_tail"], case["v_tail"], case["tables"],
                                                    args.page, case["packed"], cell, depth, position, offset, **kw)
                        entry = {"block_n": block_n, "splits": splits, "warps": warps_arg, "max_registers": regs_arg,
                                 "sealed": sealed, "sealed_warps": sealed_warps, "sealed_chunk": chunk,
                                 "min_split_keys": min_split, "exact_gap": gap}
                        try:
                            entry["max_abs_err_vs_reference"] = check(case, (cell, depth, position, offset),
                                                                      args.page, **kw)
                            ms = time_ms(run, args.reps)
                        except Exception as exc:  # one Triton cannot compile (registers, shared memory), or wrong
                            row["packed"].append(entry | {"error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                            print(f"  {label}: {type(exc).__name__}", file=sys.stderr, flush=True)
                            continue
                        engine = (block_n == ENGINE_BLOCK_N and splits_arg == "engine" and warps is None
                                  and (sealed, sealed_warps, chunk) == ENGINE_SEALED and regs is None
                                  and min_split_arg == "engine" and gap_arg == "engine")
                        row["packed"].append(entry | {"ms": ms, "gbs": packed_bytes / ms / 1e6, "over_bf16": ms / bf16,
                                                      "engine": engine})
                        print(f"  {label}: {ms * 1e3:.1f} us ({ms / bf16:.1f}x BF16){' (engine)' if engine else ''}",
                              file=sys.stderr, flush=True)
            record["results"].append(row)
        Path(args.out).write_text(json.dumps(record, indent=1))
        del case
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
