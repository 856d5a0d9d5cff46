"""Paged decode kernel on the GPU: correctness against the reference at a real shape, and
achieved bandwidth against the 4.3 TB/s ceiling (../shared/docs/gpu.md), beside the torch
backend's padded-gather decode attention on the same inputs.

    python bench/paged_decode.py --out bench/results/paged_decode_h200.json

Shape: the ouro-1.4b layer (16 query and KV heads, head dim 128), bf16, page size 16,
shuffled pages; rows x context from batch 1 to 64 and 1K to 8K keys. Bytes counted: every
row's K and V (rows x context x Hkv x D x 2 x 2 B), the floor of a decode read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specloop.kernels.paged_decode import paged_decode, paged_decode_reference  # noqa: E402
from specloop.runtime.attention import _decode_attention  # noqa: E402

BANDWIDTH = 4.3e12
HEADS, KV_HEADS, DIM, PAGE = 16, 16, 128, 16


def _inputs(rows: int, context: int, gen: torch.Generator):
    pages_per_row = -(-context // PAGE)
    pages = rows * pages_per_row
    k = torch.randn(pages * PAGE, KV_HEADS, DIM, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(pages * PAGE, KV_HEADS, DIM, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(rows, HEADS, DIM, generator=gen).to("cuda", torch.bfloat16)
    tables = torch.randperm(pages, generator=gen).to("cuda", torch.int32)
    offsets = torch.arange(rows, device="cuda") * pages_per_row
    lens = torch.full((rows,), context, device="cuda")
    return q, k, v, tables, offsets, lens


def _time(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats / 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    cases = []
    for rows, context in ((1, 1024), (1, 8192), (32, 1024), (64, 2048)):
        q, k, v, tables, offsets, lens = _inputs(rows, context, gen)
        out, lse = paged_decode(q, k, v, tables, offsets, lens, PAGE)
        small = slice(0, min(rows, 4))
        want, want_lse = paged_decode_reference(q[small], k, v, tables, offsets[small], lens[small], PAGE)
        err = (out[small].float() - want.float()).abs().max().item()
        lse_err = (lse[small] - want_lse).abs().max().item()
        seconds = _time(lambda: paged_decode(q, k, v, tables, offsets, lens, PAGE))
        span = torch.arange(context, device="cuda")
        slots = tables[offsets[:, None] + span[None, :] // PAGE].long() * PAGE + span % PAGE
        valid = torch.ones(rows, context, dtype=torch.bool, device="cuda")
        torch_seconds = _time(lambda: _decode_attention(q, k[slots], v[slots], valid, DIM ** -0.5))
        moved = rows * context * KV_HEADS * DIM * 2 * 2
        case = {"rows": rows, "context": context, "max_abs_err_vs_reference": err, "lse_max_abs_err": lse_err,
                "kernel_us": seconds * 1e6, "kernel_gb_per_s": moved / seconds / 1e9,
                "fraction_of_ceiling": moved / seconds / BANDWIDTH, "torch_backend_us": torch_seconds * 1e6}
        print(case, flush=True)
        cases.append(case)
    record = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM,
                                                     "page_size": PAGE, "dtype": "bfloat16"},
              "cases": cases}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
