"""Sparse decode attention's kernels alone against dense paged attention, one layer.

Usage (device machine):
    python bench/sparse_decode_kernels.py --out bench/results/sparse_decode_kernels_h200.json
A smoke run without a GPU (interpreter; its times mean nothing):
    TRITON_INTERPRET=1 python bench/sparse_decode_kernels.py --lengths 256 --batches 1 --heads 2 --kv-heads 2 \
        --dim 32 --reps 1 --out /tmp/sdk.json

For `--batches` decode rows of `--lengths` keys each (random bf16 K/V in 16-token pages, the
`ouro-1.4b` shape unless told otherwise, key retention --retention), times with CUDA events
(median of --reps after a warm-up, ../shared/docs/gpu.md): dense `paged_attention` with the
engine's split-KV choice (what a dense loop costs per layer), the loop-2 source (`decode_source`: one pass writing scores,
lse and O_ref, the device top-b, the selected sums), its selection alone (`select_keys` on
the scores: the top-k's share), the state write (the source's tensors copied into per-slot
reference storage, as `DecodeReferences` does), and the loop 3-4 correction
(`decode_correction`). The source's scratch (scores, probabilities, int64 rank keys) is
counted in bytes per row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specloop.kernels.paged_attention import block_g, choose_splits, paged_attention, query_tiles
from specloop.kernels.sparse_decode import decode_correction, decode_source, key_budget, select_keys

from packed_reader_sweep import time_ms  # noqa: E402 -- bench/ is the script's folder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--retention", type=float, default=0.10)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    record = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "args": vars(args), "results": []}
    for length in (int(x) for x in args.lengths.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            pages = -(-length // args.page)
            k = torch.randn(batch * pages * args.page, args.kv_heads, args.dim, generator=gen, device=device,
                            dtype=dtype)
            v = torch.randn_like(k)
            q = torch.randn(batch, args.heads, args.dim, generator=gen, device=device, dtype=dtype)
            tables = torch.arange(batch * pages, dtype=torch.long, device=device)
            offsets = torch.arange(batch, dtype=torch.long, device=device) * pages
            positions = torch.full((batch,), length - 1, dtype=torch.long, device=device)
            tile_rows = max(1, 16 // block_g(args.heads, args.kv_heads))
            tiles = torch.tensor(query_tiles([(i, 1, i * pages) for i in range(batch)], tile_rows),
                                 dtype=torch.long, device=device).view(-1, 3)
            cap = key_budget(length, args.retention)
            sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 1
            splits = choose_splits(tiles.shape[0], args.kv_heads, length, sms)  # the engine's

            def dense():
                paged_attention(q, k, v, tables, positions, tiles, args.page, tile_rows=tile_rows, num_splits=splits)

            def source():
                return decode_source(q, k, v, tables, positions, offsets, args.page, args.retention, cap,
                                     max_context=length)

            src = source()
            scores = torch.randn(batch, args.heads, length, generator=gen, device=device)
            lse = torch.logsumexp(scores, -1)

            def select():
                select_keys(scores, lse, src.count, cap)

            slots = torch.arange(batch, device=device)
            store = {name: torch.zeros((batch + 1, 24, *t.shape[1:]), dtype=t.dtype, device=device)
                     for name, t in (("keys", src.keys), ("mass", src.mass), ("o_ref", src.o_ref),
                                     ("c_ref", src.c_ref))}

            def write():
                for name in store:
                    store[name][slots, 3] = getattr(src, name)

            def correction():
                decode_correction(q, k, v, tables, positions, offsets, args.page, src)

            row = {"length": length, "batch": batch, "kept_keys": cap, "dense_splits": splits,
                   "scratch_bytes_per_row": args.heads * length * (4 + 4 + 8) + args.heads * 4}
            for name, fn in (("dense_ms", dense), ("source_ms", source), ("select_ms", select),
                             ("state_write_ms", write), ("correction_ms", correction)):
                row[name] = time_ms(fn, args.reps)
            record["results"].append(row)
            print(f"{batch} x {length} (b={cap}): dense {row['dense_ms'] * 1e3:.1f} us, source "
                  f"{row['source_ms'] * 1e3:.1f} us (selection {row['select_ms'] * 1e3:.1f}, state write "
                  f"{row['state_write_ms'] * 1e3:.1f}), correction {row['correction_ms'] * 1e3:.1f} us",
                  flush=True)
            Path(args.out).write_text(json.dumps(record, indent=1))
            del k, v, scores
            if device == "cuda":
                torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
