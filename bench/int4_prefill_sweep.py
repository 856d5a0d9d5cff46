"""INT4 prefill's per-layer kernels besides attention, alone: the key read
(`packed_keys.read_keys`) and the residual encode (`residual_encode.encode_groups`), across
launch options, against a plain copy of the bytes the read writes.

    python bench/int4_prefill_sweep.py --out bench/results/int4_prefill_sweep_h100.json

Cells as bench/packed_reader_sweep.py builds them (batch 1, --length positions, planes
dense, every group sealed but the last --tail positions), at ouro-1.4b's KV shape.

- read: one layer's `read_keys_triton` for one row at position --length - 1 over --length
  keys at each depth of --depths (0-based: depth 3 decodes four planes), what each prompt
  chunk of an INT4 prefill reads per layer and loop before its attention
  (`flashloop/kv_residual/chunks.py`), with its group pass on and off, across the gather
  kernel's key block sizes and warps and the group pass's warps (the recorded
  bench/results/int4_prefill_sweep_h200.json also swept K and V in programs of their own,
  since deleted: slower everywhere, and the encoder's dense launch, since reverted: no
  faster). Every configuration's output must equal the default launch's bit for bit, and
  the default's the torch reference's on a slice. `bytes` counts what a read writes (K and
  V in the model dtype) plus the packed bytes it decodes (codes and fp16 parameters of each
  plane up to the depth).
- encode: one layer's `encode_groups_triton` of one plane for the --chunk rows before
  --length (the groups a prompt chunk seals), per plane, across warps, into copies of the
  records (the bytes must equal the default launch's).

Times: median of --reps replays of a CUDA graph of the call (packed_reader_sweep's
`time_ms`). `copy`: torch copying K and V tensors of a read's output size (bytes read +
written), the bandwidth a store-bound kernel can reach. On CPU (TRITON_INTERPRET=1) a tiny
smoke run, its times meaningless.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packed_reader_sweep import build, time_ms  # noqa: E402  (the same cells and timing)

from specloop.kernels.packed_keys import read_keys_reference, read_keys_triton  # noqa: E402
from specloop.kernels.residual_encode import encode_groups_triton  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def sweep_reads(args, case: dict, device: str, copy_ms: float) -> list[dict]:
    packed = case["packed"]
    one = lambda x: torch.tensor([x], dtype=torch.int32, device=device)  # noqa: E731
    elem = case["k_tail"].element_size()
    out_bytes = 2 * args.length * args.kv_heads * args.dim * elem
    planes = packed.planes
    plane_bytes = sum(t.numel() * t.element_size() for t in (packed.k.codes, packed.k.scale, packed.k.lo,
                                                              packed.v.codes, packed.v.scale, packed.v.lo)) / planes
    configs = [c for c in itertools.product([bool(g) for g in ints(args.groups)], ints(args.group_warps),
                                            ints(args.block_n), ints(args.warps))
               if not (c[0] and 64 % c[2]) and (c[0] or c[1] == ints(args.group_warps)[0])]
    storage = (case["k_tail"], case["v_tail"], case["tables"], args.page, packed)
    results = []
    for depth in ints(args.depths):
        rows = (one(0), one(depth), one(args.length - 1), one(depth * case["pages_per_plane"]))
        base_k, base_v = read_keys_triton(*storage, *rows, args.length)
        cut = min(args.length, 256)  # the reference on a slice: a row at position cut - 1
        ref_rows = (rows[0], rows[1], one(cut - 1), rows[3])
        ref_k, ref_v = read_keys_reference(*storage, *ref_rows, cut)
        got_k, got_v = read_keys_triton(*storage, *ref_rows, cut)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v), "read_keys differs from its reference"
        moved = out_bytes + plane_bytes * (depth + 1)
        for groups, group_warps, block_n, warps in configs:
            kw = dict(groups=groups, group_warps=group_warps, block_n=block_n, num_warps=warps)
            k, v = read_keys_triton(*storage, *rows, args.length, **kw)
            assert torch.equal(k, base_k) and torch.equal(v, base_v), f"{kw} differs from the default launch"
            ms = time_ms(lambda: read_keys_triton(*storage, *rows, args.length, **kw), args.reps)
            results.append({"depth": depth, **kw, "us": ms * 1e3, "GB/s": moved / ms / 1e6, "x_copy": ms / copy_ms})
            print(f"read depth {depth} groups {int(groups)}/{group_warps}w block_n {block_n:3d} warps {warps}: "
                  f"{ms * 1e3:7.1f} us {moved / ms / 1e6:6.0f} GB/s ({ms / copy_ms:.1f}x the copy)", flush=True)
    return results


def sweep_encodes(args, case: dict, device: str) -> list[dict]:
    packed = case["packed"]
    first = args.length - args.chunk
    groups = torch.arange(first // 64, args.length // 64, device=device)
    m = groups.numel()
    positions = (groups[:, None] * 64 + torch.arange(64, device=device)).to(torch.int32).contiguous()
    cells = torch.zeros(m, dtype=torch.int32, device=device)
    ready = torch.ones(m, dtype=torch.bool, device=device)
    results = []
    for plane in range(packed.planes):
        records = packed.group_tables[0, plane, groups].contiguous()
        offsets = torch.full((m,), plane * case["pages_per_plane"], dtype=torch.int32, device=device)
        base = None
        for warps in ints(args.encode_warps):
            out = [t.clone() for t in (packed.k.codes, packed.k.scale, packed.k.lo, packed.v.codes, packed.v.scale,
                                       packed.v.lo)]

            def run() -> None:
                encode_groups_triton(case["k_tail"], case["v_tail"], case["tables"], args.page, plane, cells,
                                     positions, records, ready, offsets, *out, packed.group_tables,
                                     packed.row_maps, sink=0, num_warps=warps)
            run()
            if base is None:
                base = [t.clone() for t in out]
            assert all(torch.equal(a, b) for a, b in zip(out, base)), f"encode with {warps} warps differs"
            ms = time_ms(run, args.reps)
            results.append({"plane": plane, "candidates": m, "num_warps": warps, "us": ms * 1e3})
            print(f"encode plane {plane}: {m} groups, warps {warps}: {ms * 1e3:7.1f} us", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048, help="rows a prompt chunk encodes")
    ap.add_argument("--depths", default="0,1,2,3")
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tail", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--groups", default="1,0", help="read_keys' group pass on (1) or off (0)")
    ap.add_argument("--group-warps", default="4,8", help="the group pass's warps")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--encode-warps", default="4,8")
    ap.add_argument("--parts", default="read,encode")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    planes = max(ints(args.depths)) + 1
    case = build(1, args.length, planes, args.kv_heads, args.kv_heads, args.dim, args.tail, args.page, device)
    src = torch.randn(2, args.length, args.kv_heads, args.dim, device=device, dtype=case["k_tail"].dtype)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), args.reps)
    copy_gbs = 2 * src.numel() * src.element_size() / copy_ms / 1e6
    print(f"copy of a read's output bytes: {copy_ms * 1e3:.1f} us, {copy_gbs:.0f} GB/s")
    results: dict = {"copy": {"us": copy_ms * 1e3, "GB/s": copy_gbs}}
    if "read" in args.parts:
        results["reads"] = sweep_reads(args, case, device, copy_ms)
    if "encode" in args.parts:
        results["encodes"] = sweep_encodes(args, case, device)
    results["args"] = vars(args)
    results["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter: times mean nothing)"
    results["command"] = "python " + " ".join(sys.argv)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
