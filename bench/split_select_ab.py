"""The split select against an older copy of its module on the GPU, in one process: every
output bit for bit on random cases (ragged and padding rows, ties across splits, b = n, GQA,
fp32 / bf16, 2-8 splits, 8- and 11-bit digits) and two packed INT4 cases, then the GPU time
of both inside a CUDA graph at the ouro-1.4b shape (1 x 8K, 1 x 32K; one layer, warm, and
eight layers in turn, cold), alternated three rounds.

    git show 8cf9d8e:specloop/kernels/sparse_decode_split_select.py > /tmp/old_split_select.py
    python bench/split_select_ab.py --old /tmp/old_split_select.py        # PART=exact / time: one part

(8cf9d8e: the eight-launch split select; issue 38's six-launch one came in 67231ae.)
Prints its results; bench/results/split_select_six_h100.json records one run.
"""
import argparse
import importlib.util
import os
import statistics
import sys

import torch

import specloop.kernels.sparse_decode_source as src
from specloop.kernels.sparse_decode_common import Blocks, PackedRows, SlotState, key_budget
from specloop.kernels.sparse_decode_source import decode_select
from specloop.kernels.sparse_decode_split_select import select_splits

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/ for the packed cases
_p = argparse.ArgumentParser()
_p.add_argument("--old", required=True, help="an older sparse_decode_split_select.py")
_args = _p.parse_args()
spec = importlib.util.spec_from_file_location("old_split", _args.old)
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
NEW, OLD = src._launch_split_select, old._launch_split_select
CASES = []
k = 0
for splits in range(2, 9):
    for dtype in (torch.float32, torch.bfloat16):
        k += 1
        CASES.append(dict(seed=k, positions=[150, -1, 0, 29, 199, 5, 99][: 3 + splits % 5], heads=4,
                          kv_heads=2 if splits % 2 else 4, dim=32 if dtype == torch.float32 else 24, page_size=16,
                          dtype=dtype, splits=splits, split_block=32, gather=16, radix=8 if splits % 3 else 11,
                          retention=0.1, max_context=200, tie_levels=None if splits % 2 else 3 + splits))
# ties straddling split boundaries, b = n (retention 1), a long row with 64-key blocks, GQA 4
CASES.append(dict(seed=100, positions=[199, -1, 130, 64], heads=8, kv_heads=2, dim=32, page_size=16,
                  dtype=torch.float32, splits=4, split_block=32, gather=16, radix=8, retention=0.3, max_context=200,
                  tie_levels=2))
CASES.append(dict(seed=101, positions=[63, 10, -1, 199], heads=4, kv_heads=1, dim=16, page_size=8,
                  dtype=torch.bfloat16, splits=3, split_block=32, gather=16, radix=8, retention=1.0, max_context=200))
CASES.append(dict(seed=102, positions=[700, 333, -1], heads=4, kv_heads=2, dim=64, page_size=32,
                  dtype=torch.float32, splits=5, split_block=64, gather=32, radix=11, retention=0.05,
                  max_context=768, tie_levels=4))
CASES.append(dict(seed=103, positions=[0, 1, 2, -1], heads=2, kv_heads=2, dim=32, page_size=16,
                  dtype=torch.float32, splits=2, split_block=32, gather=16, radix=8, retention=0.1, max_context=200))
CASES.append(dict(seed=104, positions=[511, 255], heads=4, kv_heads=2, dim=32, page_size=16,
                  dtype=torch.bfloat16, splits=8, split_block=32, gather=16, radix=8, retention=0.5,
                  max_context=512, tie_levels=2))


FIELDS = ("keys", "count", "mass", "o_ref", "c_ref")
dev = "cuda"
print(torch.cuda.get_device_name(), torch.__version__, __import__("triton").__version__, flush=True)


def with_launch(fn, launch):
    src._launch_split_select = launch
    try:
        return fn()
    finally:
        src._launch_split_select = NEW


def case_call(seed, positions, heads, kv_heads, dim, page_size, dtype, splits, split_block, gather, radix,
              retention, max_context, tie_levels=None):
    g = torch.Generator().manual_seed(seed)
    n = len(positions)
    pages = -(-max_context // page_size) + 4
    v = torch.randn(pages * page_size, kv_heads, dim, generator=g).to(dtype)
    tables, offs = [], []
    for pos in positions:
        need = max(1, -(-(pos + 1) // page_size))
        offs.append(len(tables))
        tables.extend(torch.randperm(pages, generator=g)[:need].tolist())
    pos_t = torch.tensor(positions)
    scores = torch.randn(n + 1, heads, max_context, generator=g) * 3
    if tie_levels is not None:
        scores = torch.randint(0, tie_levels, scores.shape, generator=g).float() * 0.5
    lse = torch.zeros(n, heads)
    for i, p in enumerate(positions):
        if p >= 0:
            lse[i] = torch.logsumexp(scores[i, :, : min(p + 1, max_context)], -1)
    dense = torch.randn(n, heads, dim, generator=g).to(dtype)
    slots = torch.randperm(n + 3, generator=g)[:n]
    slots = torch.where(pos_t < 0, 1 << 40, slots)
    cap = key_budget(max_context, retention) + 2
    args = [t.to(dev) for t in (v, torch.tensor(tables, dtype=torch.int32), pos_t, torch.tensor(offs), dense, lse,
                                scores, slots)]

    def call():
        state = SlotState.zeros(n + 3, heads, dim, cap, device=dev)
        for f in FIELDS:
            getattr(state, f).fill_(-7)
        v_, t_, p_, o_, d_, l_, s_, sl_ = args
        decode_select(v_, t_, p_, o_, page_size, retention, dense=d_, lse=l_, scores=s_, slots=sl_, state=state,
                      max_context=max_context, blocks=Blocks(split_select=split_block, gather=gather,
                                                             select_splits=splits, radix_bits=radix))
        torch.cuda.synchronize()
        return {f: getattr(state, f).clone() for f in FIELDS}
    return call


def compare(name, a, b):
    bad = [f for f in FIELDS if not torch.equal(a[f], b[f])]
    if bad:
        print("DIFF", name, [(f, (a[f].double() - b[f].double()).abs().max().item()) for f in bad], flush=True)
    return not bad


if os.environ.get("PART", "all") in ("all", "exact"):
    ok = 0
    for i, c in enumerate(CASES):
        call = case_call(**c)
        for j in range(3):  # again and again: same results (no tickets left over)
            ok += compare(f"{i}/{j}", call(), with_launch(call, OLD))
    print("bit-exact cases", ok, "of", 3 * len(CASES), flush=True)

    import dataclasses
    from tests.test_kernels_sparse_decode import _packed_case, PACKED_ROWS, MAX_CONTEXT, SPLIT_SELECT
    from specloop.kernels.packed_attention import packed_attention
    for dtype, blocks in ((torch.bfloat16, SPLIT_SELECT),
                          (torch.float32, dataclasses.replace(SPLIT_SELECT, select_splits=5))):
        case = _packed_case(11, [150, 100, 80], ["mixed", "sealed", "open"], PACKED_ROWS, 4, 2, 16, dtype)
        n, heads, dim = case.q.shape
        scored = [i for i in range(n) if i != 2]
        score_rows = torch.full((n,), -1, dtype=torch.int32, device=dev)
        score_rows[scored] = torch.arange(len(scored), dtype=torch.int32, device=dev)
        scores = torch.full((len(scored) + 1, heads, MAX_CONTEXT), -7.0, device=dev)
        dense, lse = packed_attention(*case.args(), return_lse=True, num_splits=3, scores=scores,
                                      score_rows=score_rows)
        at = torch.tensor(scored, device=dev)
        packed = PackedRows(case.packed, case.cell[at], case.depth[at])
        slots = torch.randperm(n + 2, generator=torch.Generator().manual_seed(13))[: len(scored)].to(dev)

        def call():
            got = SlotState.zeros(n + 2, heads, dim, key_budget(MAX_CONTEXT, 0.1), device=dev)
            decode_select(case.v_tail, case.tables, case.position[at], case.table_offset[at], case.page_size, 0.1,
                          dense=dense[at], lse=lse[at].contiguous(), scores=scores, slots=slots, state=got,
                          max_context=MAX_CONTEXT, blocks=blocks, k_cache=case.k_tail, packed=packed)
            torch.cuda.synchronize()
            return {f: getattr(got, f).clone() for f in FIELDS}
        print("packed", dtype, "bit-exact", compare(f"packed {dtype}", call(), with_launch(call, OLD)), flush=True)


def timing(keys, layers, launch):
    heads, dim, page = 16, 128, 16
    g = torch.Generator().manual_seed(0)
    pages = keys // page
    sets = []
    for _ in range(layers):
        v = torch.randn(pages * page, heads, dim, generator=g).to(torch.bfloat16).to(dev)
        scores = (torch.randn(1, heads, keys, generator=g) * 3).to(dev)
        lse = torch.logsumexp(scores[0], -1)[None].contiguous()
        state = SlotState.zeros(1, heads, dim, key_budget(keys, 0.1), device=dev)
        sets.append((v, scores, lse, state))
    tables = torch.randperm(pages, generator=g).to(torch.int32).to(dev)
    pos = torch.tensor([keys - 1], device=dev)
    off = torch.zeros(1, dtype=torch.long, device=dev)
    slots = torch.zeros(1, dtype=torch.long, device=dev)
    dense = torch.randn(1, heads, dim, device=dev).to(torch.bfloat16)
    splits = select_splits(1, heads, keys, torch.cuda.get_device_properties(0).multi_processor_count, 512)

    def one(k):
        v, scores, lse, state = sets[k % layers]
        decode_select(v, tables, pos, off, page, 0.1, dense=dense, lse=lse, scores=scores, slots=slots, state=state,
                      max_context=keys)
    src._launch_split_select = launch
    try:
        for k in range(3):
            one(k)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for k in range(20):
                one(k)
        times = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1000 / 20)
    finally:
        src._launch_split_select = NEW
    return statistics.median(times), splits


if os.environ.get("PART", "all") in ("all", "time"):
    for keys in (8192, 32768):
        for layers in (1, 8):
            res = {}
            for rnd in range(3):
                for name, launch in (("old", OLD), ("new", NEW)):
                    t, splits = timing(keys, layers, launch)
                    res.setdefault(name, []).append(t)
            print(f"1 x {keys} keys, {layers} layer(s), {splits} splits: old "
                  + ", ".join(f"{t:.1f}" for t in res["old"]) + " us; new "
                  + ", ".join(f"{t:.1f}" for t in res["new"]) + " us", flush=True)
