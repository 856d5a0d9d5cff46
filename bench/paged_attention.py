"""Paged attention kernel on the GPU: correctness against the reference at the real shape,
and achieved bandwidth (decode, verification) or FLOP rate (prefill) against the ceilings
(4.3 TB/s, 790 TFLOP/s: ../shared/docs/gpu.md), beside the torch backend on the same inputs.

    python bench/paged_attention.py --out bench/results/paged_attention_h200.json

Shape: the ouro-1.4b layer (16 query and KV heads, head dim 128), bf16, page size 16,
shuffled pages. Each timed call reads another layer's pages (the pool of layers is larger
than L2), so small cases are not served from cache. Counted: bytes = every group's K and
V once (groups x context x Hkv x D x 2 x 2 B), the floor of a read; FLOPs = 4 x Hq x D x
visible keys summed over rows (QK and PV, causal).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specloop.kernels.paged_attention import (  # noqa: E402
    choose_splits, paged_attention, paged_attention_reference, query_tiles,
)
from specloop.runtime.attention import _decode_attention  # noqa: E402

BANDWIDTH, FLOPS = 4.3e12, 790e12
HEADS, KV_HEADS, DIM, PAGE = 16, 16, 128, 16
POOL_BYTES = 400 << 20  # K and V over all layers of the pool: well past the 50 MB L2


def _inputs(groups: int, rows: int, context: int, gen: torch.Generator):
    """`groups` groups of `rows` rows each ending at position context - 1."""
    pages_per_group = -(-context // PAGE)
    pages = groups * pages_per_group
    layer_bytes = 2 * pages * PAGE * KV_HEADS * DIM * 2
    layers = max(2, -(-POOL_BYTES // layer_bytes))
    k = torch.randn(layers, pages * PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(layers, pages * PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(groups * rows, HEADS, DIM, generator=gen).to("cuda", torch.bfloat16)
    tables = torch.randperm(pages, generator=gen).to("cuda", torch.int32)
    positions = torch.arange(context - rows, context).repeat(groups).to("cuda")
    shapes = [(g * rows, rows, g * pages_per_group) for g in range(groups)]
    return q, k, v, tables, positions, shapes


def _time(fn, layers: int, repeats: int = 30) -> float:
    for i in range(3):
        fn(i % layers)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(repeats):
        start.record()
        fn(i % layers)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = []
    # (kind, groups, rows per group, context)
    for kind, groups, rows, context in (
        ("decode", 1, 1, 1024), ("decode", 1, 1, 8192), ("decode", 32, 1, 1024), ("decode", 64, 1, 2048),
        ("decode", 128, 1, 1024), ("verify", 1, 5, 1024), ("verify", 1, 5, 8192), ("verify", 32, 5, 1024),
        ("prefill", 1, 1024, 1024), ("prefill", 1, 2048, 8192), ("prefill", 1, 8192, 8192),
    ):
        q, k, v, tables, positions, shapes = _inputs(groups, rows, context, gen)
        tile_rows = 16 if rows <= 16 else 64
        tiles_list = query_tiles(shapes, tile_rows)
        tiles = torch.tensor(tiles_list, device="cuda").view(-1, 3)
        splits = choose_splits(tiles.shape[0], KV_HEADS, context, sms)
        layers = k.shape[0]

        def run(i: int):
            return paged_attention(q, k[i], v[i], tables, positions, tiles, PAGE, tile_rows=tile_rows,
                                   num_splits=splits, return_lse=True)

        out, lse = run(0)
        check = torch.tensor(tiles_list[:3 * min(2, len(tiles_list) // 3)], device="cuda").view(-1, 3)
        if rows > 64:  # the reference goes row by row: check the last tile of a long prompt
            check = tiles[-1:]
        want, want_lse = paged_attention_reference(q, k[0], v[0], tables, positions, check, PAGE)
        covered = torch.cat([torch.arange(f, f + r) for f, r, _ in check.tolist()]).cuda()
        err = (out[covered].float() - want[covered].float()).abs().max().item()
        lse_err = (lse[covered] - want_lse[covered]).abs().max().item()
        seconds = _time(run, layers)
        moved = groups * context * KV_HEADS * DIM * 2 * 2
        visible = groups * sum(context - rows + 1 + r for r in range(rows))
        flops = 4 * HEADS * DIM * visible
        case = {"kind": kind, "groups": groups, "rows_per_group": rows, "context": context, "splits": splits,
                "tile_rows": tile_rows, "max_abs_err_vs_reference": err, "lse_max_abs_err": lse_err,
                "kernel_us": seconds * 1e6, "gb_per_s": moved / seconds / 1e9,
                "fraction_of_bandwidth": moved / seconds / BANDWIDTH, "tflop_per_s": flops / seconds / 1e12,
                "fraction_of_flops": flops / seconds / FLOPS}
        if kind == "decode":  # the torch backend: padded gather, then einsum softmax attention
            span = torch.arange(context, device="cuda")
            offsets = torch.tensor([s[2] for s in shapes], device="cuda")
            slots = tables[offsets[:, None] + span[None, :] // PAGE].long() * PAGE + span % PAGE
            valid = torch.ones(groups, context, dtype=torch.bool, device="cuda")
            case["torch_backend_us"] = _time(
                lambda i: _decode_attention(q, k[i][slots], v[i][slots], valid, DIM ** -0.5), layers) * 1e6
        if kind == "prefill":  # flash SDPA on contiguous keys: what a dense prefill costs
            kc = k[0][: context].transpose(0, 1)[None]
            qc = q.transpose(0, 1)[None]
            mask = None if rows == context else torch.arange(context, device="cuda")[None, :] <= positions[:, None]
            case["sdpa_contiguous_us"] = _time(
                lambda i: F.scaled_dot_product_attention(qc, kc, kc, attn_mask=mask, is_causal=mask is None),
                layers) * 1e6
        print(json.dumps(case), flush=True)
        cases.append(case)
    record = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM,
                                                     "page_size": PAGE, "dtype": "bfloat16"},
              "cases": cases}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
