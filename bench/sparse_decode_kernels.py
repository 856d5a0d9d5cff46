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
With `--layers L` the graph's calls rotate over L layers' K/V, scores and state, so a call
finds its data cold in L2 as in the engine, which runs 24 layers in turn (one layer
replays warm: its kept rows and scores stay in L2). `--max-context` sizes the state and
the correction's splits as the engine's max_model_len does. `--correction-variants` times
the correction at fixed splits; `--profile` adds each kernel's GPU time per call of the
default select and correction (`*_kernels_ms`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from specloop.kernels.paged_attention import block_g, choose_splits, paged_attention, query_tiles
from specloop.kernels.sparse_decode_common import Blocks, SlotState, _num_sms, key_budget
from specloop.kernels.sparse_decode_correction import correction_splits, correction_triton
from specloop.kernels.sparse_decode_select import _launch_select
from specloop.kernels.sparse_decode_source import (
    SCRATCH_BYTES, _launch_scores, decode_select, decode_source, score_splits, scratch_rows,
)
from specloop.kernels.sparse_decode_split_select import select_splits

from packed_reader_sweep import time_ms  # noqa: E402 -- bench/ is the script's folder


def graph_time_ms(fn, reps: int, calls: int, layers: int = 1, profile: dict | None = None) -> float:
    """GPU time per call of fn(layer) inside a CUDA graph of `calls` calls (layer = call %
    layers): the median of `reps` replays divided by `calls` (no host launch latency). With
    `profile` (a dict), also each kernel's GPU time per call, from torch.profiler over the
    replays. Wall time of one call on CPU."""
    if not torch.cuda.is_available():
        return time_ms(lambda: [fn(layer) for layer in range(layers)], 1) / layers
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compilation) off the capture
        for layer in range(layers):
            fn(layer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(calls):
            fn(call % layers)
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    if profile is not None:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                graph.replay()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
            if us:
                profile[e.key[:60]] = profile.get(e.key[:60], 0.0) + us / 1e3 / (reps * calls)
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
    p.add_argument("--layers", type=int, default=1,
                   help="layers of K/V, scores and state that the graph's calls rotate over: 1 keeps one layer's "
                        "data warm in L2 from call to call; the engine's 24 layers are closer to 8 or more (cold)")
    p.add_argument("--max-context", type=int, default=None,
                   help="the state's capacity and the correction's splits from this context (the engine's "
                        "max_model_len), not the case's length")
    p.add_argument("--split-variants", default="auto@512,4@1024,8@512,16@256",
                   help="decode_select split over programs per row and head, timed in graphs: splits (auto: "
                        "`select_splits`) @ select block, then optional :r<radix bits> and :g<gather block>")
    p.add_argument("--select-variants", default="8,11",
                   help="select kernels also timed (graphs): radix bits @ select block")
    p.add_argument("--correction-variants", default="1,4",
                   help="correction splits [: kept keys per block] also timed (graphs), besides the default "
                        "`correction_splits`")
    p.add_argument("--skew", type=float, default=0.0,
                   help="the last SKEW of each row's keys lean towards its query, so the kept keys bunch at the "
                        "end of the row, as a local window does (0: random keys, kept keys spread evenly)")
    p.add_argument("--profile", action="store_true",
                   help="each kernel's GPU time per call of the default select and correction (torch.profiler)")
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
    layers = args.layers
    calls = -(-args.graph_calls // layers) * layers  # whole rotations
    pages = -(-length // args.page)
    q = torch.randn(batch, args.heads, args.dim, generator=gen, device=device, dtype=dtype)
    k = [torch.randn(batch * pages * args.page, args.kv_heads, args.dim, generator=gen, device=device, dtype=dtype)
         for _ in range(layers)]
    v = [torch.randn_like(x) for x in k]
    tables = torch.randperm(batch * pages, generator=gen, device=device)  # pages out of order, as in a pool
    offsets = torch.arange(batch, dtype=torch.long, device=device) * pages
    if args.skew > 0:  # the last skew x length keys of each row lean towards its query: they score highest
        recent = torch.arange(int(length * (1 - args.skew)), length, device=device)
        for r in range(batch):
            slot = tables[r * pages + recent // args.page] * args.page + recent % args.page
            lean = q[r, :: args.heads // args.kv_heads].to(torch.float32)  # [Hkv, D]
            for x in k:
                x[slot] = (x[slot].float() + 2 * lean).to(dtype)
    positions = torch.full((batch,), length - 1, dtype=torch.long, device=device)
    tile_rows = max(1, 16 // block_g(args.heads, args.kv_heads))
    tiles = torch.tensor(query_tiles([(i, 1, i * pages) for i in range(batch)], tile_rows),
                         dtype=torch.long, device=device).view(-1, 3)
    dense_splits = choose_splits(tiles.shape[0], args.kv_heads, length, _num_sms(device))  # the engine's
    dense_out = [torch.empty_like(q) for _ in range(layers)]
    max_context = max(length, args.max_context or 0)
    capacity = key_budget(max_context, args.retention)
    state = [SlotState.zeros(batch, args.heads, args.dim, capacity, device=device) for _ in range(layers)]
    slots = torch.arange(batch, device=device)
    rows = min(batch, scratch_rows(args.heads, max_context, SCRATCH_BYTES))
    scratch = [torch.empty(rows, args.heads, length, dtype=torch.float32, device=device) for _ in range(layers)]
    splits = score_splits(rows, args.kv_heads, length, _num_sms(device))
    out = torch.empty_like(q)

    def timed(fn, **kw) -> float:
        return graph_time_ms(fn, args.reps, calls, layers, **kw)

    def dense(i=0):
        paged_attention(q, k[i], v[i], tables, positions, tiles, args.page, tile_rows=tile_rows,
                        num_splits=dense_splits, out=dense_out[i])

    def scores(i=0):
        for first in range(0, batch, rows):
            _launch_scores(q, k[i], v[i], tables, positions, offsets, args.page, scratch[i], first,
                           min(rows, batch - first), length, splits, Blocks())

    def select(i=0, blocks=Blocks()):  # over the scores of the last chunk (every chunk's, when one holds the batch)
        for first in range(0, batch, rows):
            _launch_select(v[i], tables, positions, offsets, args.page, args.retention, dense_out[i], slots, state[i],
                           scratch[i], first, min(rows, batch - first), length, blocks)

    score_rows = torch.arange(batch, dtype=torch.int32, device=device)
    fused = batch <= rows  # the engine keeps the scores in the dense launch when the scratch holds every row
    lse = [torch.empty(batch, args.heads, dtype=torch.float32, device=device) for _ in range(layers)]

    def dense_scores(i=0):  # the loop-2 dense launch keeping the rows' scores and lse (the fused source's half)
        lse[i].copy_(paged_attention(q, k[i], v[i], tables, positions, tiles, args.page, tile_rows=tile_rows,
                                     num_splits=dense_splits, out=dense_out[i], return_lse=True, scores=scratch[i],
                                     score_rows=score_rows)[1])

    def select_lse(i=0, blocks=Blocks()):  # the fused source's other half: the select with the dense launch's lse
        decode_select(v[i], tables, positions, offsets, args.page, args.retention, dense=dense_out[i], lse=lse[i],
                      scores=scratch[i], slots=slots, state=state[i], max_context=length, blocks=blocks)

    def source(i=0):
        decode_source(q, k[i], v[i], tables, positions, offsets, args.page, args.retention, dense=dense_out[i],
                      slots=slots, state=state[i], max_context=length, scratch=scratch[i])

    def correction(i=0, blocks=Blocks()):
        correction_triton(q, k[i], v[i], tables, positions, offsets, args.page, slots=slots, state=state[i], out=out,
                          blocks=blocks)

    for i in range(layers):  # every layer's state filled before any correction is timed
        dense(i)
        scores(i)
        select(i)
    row = {"length": length, "batch": batch, "layers": layers, "kept_keys": key_budget(length, args.retention),
           "capacity": capacity, "dense_splits": dense_splits,
           "correction_splits": correction_splits(batch, args.kv_heads, capacity, _num_sms(device)),
           "score_splits": splits, "scratch_rows": rows,
           "scratch_bytes": scratch[0].numel() * scratch[0].element_size()}
    for variant in filter(None, args.select_variants.split(",")):
        bits, _, block = variant.partition("@")
        row[f"select_{variant}_ms"] = timed(lambda i, b=Blocks(radix_bits=int(bits), select=int(block or Blocks().select)):
                                            select(i, b))
    for variant in filter(None, args.correction_variants.split(",")):
        n, _, block = variant.partition(":")
        blocks = Blocks(correction_splits=int(n), correction=int(block or Blocks().correction))
        name = f"correction_splits{n}" + (f"@{block}" if block else "")
        row[f"{name}_ms"] = timed(lambda i, b=blocks: correction(i, b))
    if fused:
        for i in range(layers):
            dense_scores(i)
        for variant in filter(None, args.split_variants.split(",")):
            count, _, rest = variant.partition("@")
            block, *extra = rest.split(":")  # ":r<radix bits>", ":g<gather block>"
            block = int(block) if block else Blocks().split_select
            opts = {"r": Blocks().radix_bits, "g": Blocks().gather} | {e[0]: int(e[1:]) for e in extra}
            n = (select_splits(batch, args.heads, length, _num_sms(device), block) if count == "auto" else int(count))
            name = f"select_lse_split{n}@{block}" + "".join(f":{e}" for e in extra)
            blocks = Blocks(split_select=block, select_splits=n, radix_bits=opts["r"], gather=opts["g"])
            row[f"{name}_ms"] = timed(lambda i, b=blocks: select_lse(i, b))
    named = [("dense_ms", dense), ("scores_ms", scores), ("select_ms", select), ("source_ms", source),
             ("correction_ms", correction)]
    if fused:
        for i in range(layers):
            dense_scores(i)
        named += [("dense_scores_ms", dense_scores), ("select_lse_ms", select_lse)]
    for name, fn in named:
        if layers == 1:
            row[name.replace("_ms", "_eager_ms")] = time_ms(fn, args.reps)
        kernels: dict | None = {} if args.profile and name in ("select_lse_ms", "correction_ms") else None
        row[name] = timed(fn, profile=kernels)
        if kernels:
            row[name.replace("_ms", "_kernels_ms")] = kernels
    assert all(int(s.count[0]) == key_budget(length, args.retention) for s in state)
    if fused:
        row["fused_source_ms"] = row["dense_scores_ms"] - row["dense_ms"] + row["select_lse_ms"]
    print({k: round(v * 1e3, 1) for k, v in row.items() if isinstance(v, float) and k.startswith(("select_", "correction_s", "dense_s", "fused"))})
    print({k: {n: round(t * 1e3, 1) for n, t in v.items()} for k, v in row.items() if k.endswith("_kernels_ms")})
    print(f"{batch} x {length} (b={row['kept_keys']}, {layers} layers): dense {row['dense_ms'] * 1e3:.1f} us, source "
          f"{row['source_ms'] * 1e3:.1f} us (scores {row['scores_ms'] * 1e3:.1f}, select "
          f"{row['select_ms'] * 1e3:.1f}), correction {row['correction_ms'] * 1e3:.1f} us in graphs, scratch "
          f"{row['scratch_bytes'] / 2**20:.1f} MiB", flush=True)
    return row


if __name__ == "__main__":
    main()
