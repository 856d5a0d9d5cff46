"""Sparse decode attention's kernels alone against dense paged attention, one layer.

Usage (device machine):
    python bench/sparse_decode_kernels.py --out bench/results/sparse_decode_kernels_h200.json
A smoke run without a GPU (interpreter; its times mean nothing):
    TRITON_INTERPRET=1 python bench/sparse_decode_kernels.py --lengths 256 --batches 1 --heads 2 --kv-heads 2 \
        --dim 32 --reps 1 --out /tmp/sdk.json

For `--batches` decode rows of `--lengths` keys each (random bf16 K/V in `--page`-token
pages, the `ouro-1.4b` shape unless told otherwise, key retention --retention), times with
CUDA events (median of --reps after a warm-up, ../shared/docs/gpu.md): dense
`paged_attention` with the engine's split-KV choice (what a dense loop costs per layer);
the loop-2 source's scores kernel and select kernel alone, and the whole source
(`decode_source`, both kernels per chunk of scratch rows); and the loop 3-4 correction
(`decode_correction`). The scratch is the one the source allocates by default
(`scratch_rows` under SCRATCH_BYTES), reported in bytes with its rows.

`dense_scores_ms` is the dense launch that also keeps the rows' scores and lse, and
`select_lse_ms` the select kernel alone on them (`decode_select`): the fused source the
engine runs when the scratch holds every source row costs `fused_source_ms` =
dense_scores - dense + select_lse on top of the dense loop.

`select_lse_split{k}@{block}_ms` times that select split over k programs per row and
head (`Blocks.select_splits`; `--split-variants`).

Each `*_ms` is the GPU time per call inside a CUDA graph (`--graph-calls` calls captured
in one graph, replayed, the median replay divided by the calls), as the engine runs these
kernels; `*_eager_ms` times one eager call between events, which adds the host's launch
latency (tens of microseconds for a Triton launch) and is what earlier results reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from specloop.kernels.paged_attention import block_g, choose_splits, paged_attention, query_tiles
from specloop.kernels.sparse_decode import (
    SCRATCH_BYTES, Blocks, SlotState, _launch_scores, _launch_select, _num_sms, correction_splits, correction_triton,
    decode_correction, decode_select, decode_source, key_budget, score_splits, scratch_rows, select_splits,
)

from packed_reader_sweep import time_ms  # noqa: E402 -- bench/ is the script's folder


def graph_time_ms(fn, reps: int, calls: int) -> float:
    """GPU time per call of fn inside a CUDA graph of `calls` calls: the median of `reps`
    replays divided by `calls` (no host launch latency). Wall time of one call on CPU."""
    if not torch.cuda.is_available():
        return time_ms(fn, 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compilation) off the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


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
    p.add_argument("--graph-calls", type=int, default=20)
    p.add_argument("--split-variants", default="auto@512,4@1024,8@512,16@256",
                   help="decode_select split over programs per row and head, timed in graphs: splits (auto: "
                        "`select_splits`) @ select block")
    p.add_argument("--select-variants", default="8,11",
                   help="select kernels also timed (graphs): radix bits @ select block")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    record = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "args": vars(args), "blocks": vars(Blocks()), "results": []}
    for length in (int(x) for x in args.lengths.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            record["results"].append(_case(args, length, batch, device, dtype, gen))
            Path(args.out).write_text(json.dumps(record, indent=1))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(record, indent=1))


def _case(args: argparse.Namespace, length: int, batch: int, device: torch.device, dtype: torch.dtype,
          gen: torch.Generator) -> dict:
    pages = -(-length // args.page)
    k = torch.randn(batch * pages * args.page, args.kv_heads, args.dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(batch, args.heads, args.dim, generator=gen, device=device, dtype=dtype)
    tables = torch.randperm(batch * pages, generator=gen, device=device)  # pages out of order, as in a pool
    offsets = torch.arange(batch, dtype=torch.long, device=device) * pages
    positions = torch.full((batch,), length - 1, dtype=torch.long, device=device)
    tile_rows = max(1, 16 // block_g(args.heads, args.kv_heads))
    tiles = torch.tensor(query_tiles([(i, 1, i * pages) for i in range(batch)], tile_rows),
                         dtype=torch.long, device=device).view(-1, 3)
    dense_splits = choose_splits(tiles.shape[0], args.kv_heads, length, _num_sms(device))  # the engine's
    dense_out = torch.empty_like(q)
    capacity = key_budget(length, args.retention)
    state = SlotState.zeros(batch, args.heads, args.dim, capacity, device=device)
    slots = torch.arange(batch, device=device)
    rows = min(batch, scratch_rows(args.heads, length, SCRATCH_BYTES))
    scratch = torch.empty(rows, args.heads, length, dtype=torch.float32, device=device)
    splits = score_splits(rows, args.kv_heads, length, _num_sms(device))
    out = torch.empty_like(q)

    def dense():
        paged_attention(q, k, v, tables, positions, tiles, args.page, tile_rows=tile_rows, num_splits=dense_splits,
                        out=dense_out)

    def scores():
        for first in range(0, batch, rows):
            _launch_scores(q, k, tables, positions, offsets, args.page, scratch, first, min(rows, batch - first),
                           length, splits, Blocks())

    def select():  # over the scores of the last chunk (every chunk's, when one holds the batch)
        for first in range(0, batch, rows):
            _launch_select(v, tables, positions, offsets, args.page, args.retention, dense_out, slots, state, scratch,
                           first, min(rows, batch - first), length, Blocks())

    score_rows = torch.arange(batch, dtype=torch.int32, device=device)
    fused = batch <= rows  # the engine keeps the scores in the dense launch when the scratch holds every row
    lse = torch.empty(batch, args.heads, dtype=torch.float32, device=device)

    def dense_scores():  # the loop-2 dense launch keeping the rows' scores and lse (the fused source's half)
        lse.copy_(paged_attention(q, k, v, tables, positions, tiles, args.page, tile_rows=tile_rows,
                                  num_splits=dense_splits, out=dense_out, return_lse=True, scores=scratch,
                                  score_rows=score_rows)[1])

    def select_lse():  # the fused source's other half: the select kernel with the dense launch's lse
        decode_select(v, tables, positions, offsets, args.page, args.retention, dense=dense_out, lse=lse,
                      scores=scratch, slots=slots, state=state, max_context=length)

    def source():
        decode_source(q, k, v, tables, positions, offsets, args.page, args.retention, dense=dense_out, slots=slots,
                      state=state, max_context=length, scratch=scratch)

    def correction():
        decode_correction(q, k, v, tables, positions, offsets, args.page, slots=slots, state=state, out=out)

    dense()
    scores()
    row = {"length": length, "batch": batch, "kept_keys": capacity, "dense_splits": dense_splits,
           "correction_splits": correction_splits(batch, args.kv_heads, capacity, _num_sms(device)),
           "score_splits": splits, "scratch_rows": rows, "scratch_bytes": scratch.numel() * scratch.element_size()}
    for variant in filter(None, args.select_variants.split(",")):
        bits, _, block = variant.partition("@")
        blocks = Blocks(radix_bits=int(bits), select=int(block) if block else Blocks().select)

        def select_variant(blocks=blocks):
            for first in range(0, batch, rows):
                _launch_select(v, tables, positions, offsets, args.page, args.retention, dense_out, slots, state,
                               scratch, first, min(rows, batch - first), length, blocks)
        row[f"select_{variant}_ms"] = graph_time_ms(select_variant, args.reps, args.graph_calls)
    for splits in (1, 4):
        def correction_fixed(splits=splits):
            correction_triton(q, k, v, tables, positions, offsets, args.page, slots=slots, state=state, out=out,
                              blocks=Blocks(correction_splits=splits))
        row[f"correction_splits{splits}_ms"] = graph_time_ms(correction_fixed, args.reps, args.graph_calls)
    if fused:
        dense_scores()
        for variant in filter(None, args.split_variants.split(",")):
            count, _, block = variant.partition("@")
            block = int(block) if block else Blocks().split_select
            splits = (select_splits(batch, args.heads, length, _num_sms(device), block) if count == "auto"
                      else int(count))

            def split_select(blocks=Blocks(split_select=block, select_splits=splits)):
                decode_select(v, tables, positions, offsets, args.page, args.retention, dense=dense_out, lse=lse,
                              scores=scratch, slots=slots, state=state, max_context=length, blocks=blocks)
            row[f"select_lse_split{splits}@{block}_ms"] = graph_time_ms(split_select, args.reps, args.graph_calls)
    named = [("dense_ms", dense), ("scores_ms", scores), ("select_ms", select), ("source_ms", source),
             ("correction_ms", correction)]
    if fused:
        dense_scores()
        named += [("dense_scores_ms", dense_scores), ("select_lse_ms", select_lse)]
    for name, fn in named:
        row[name.replace("_ms", "_eager_ms")] = time_ms(fn, args.reps)
        row[name] = graph_time_ms(fn, args.reps, args.graph_calls)
    assert int(state.count[0]) == capacity
    if fused:
        row["fused_source_ms"] = row["dense_scores_ms"] - row["dense_ms"] + row["select_lse_ms"]
    print({k: round(v * 1e3, 1) for k, v in row.items() if k.endswith("_ms") and k.startswith(("select_", "correction_s", "dense_s", "fused"))})
    print(f"{batch} x {length} (b={capacity}): dense {row['dense_ms'] * 1e3:.1f} us, source "
          f"{row['source_ms'] * 1e3:.1f} us (scores {row['scores_ms'] * 1e3:.1f}, select "
          f"{row['select_ms'] * 1e3:.1f}), correction {row['correction_ms'] * 1e3:.1f} us in graphs (eager: dense "
          f"{row['dense_eager_ms'] * 1e3:.1f}, source {row['source_eager_ms'] * 1e3:.1f}, correction "
          f"{row['correction_eager_ms'] * 1e3:.1f}), scratch {row['scratch_bytes'] / 2**20:.1f} MiB", flush=True)
    return row


if __name__ == "__main__":
    main()
