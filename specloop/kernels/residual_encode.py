"""Encoding the ready groups of INT4 cross-loop KV residuals into their records, in Triton
(one launch for every plane of a layer, or one for one plane), with its torch reference.

    encode_groups(k_tail, v_tail, tables, page_size, plane, cells, positions, records, ready,
                  table_offsets, k_codes, k_scale, k_lo, v_codes, v_scale, v_lo, group_tables, row_maps)

What `PackedResiduals.encode` (`specloop.flashloop.kv_residual.planes`) does for one layer and one
plane, without its ~75 small torch ops a plane. DT is the model dtype (the tails'), Hkv KV
heads, D the head dim (even), GROUP = 64, P planes, NG + 1 records (the last one, NG, is
the sink: `sink` names another one). The caller slices the layer:

- k_tail, v_tail [S, Hkv, D] DT: the exact values (one layer of the BF16 tail pages);
  position j of candidate m sits at slot tables[max(table_offsets[m], 0) + j // page_size]
  * page_size + j % page_size (its plane's page table, as in `paged_attention`).
- The candidates of plane `plane`, M of them: cells [M], positions [M, 64] (the group's
  rows, in row order), records [M] (where it encodes), ready [M] bool, table_offsets [M].
- The records of the layer, written in place: k_codes uint8 [NG + 1, 32, Hkv, D],
  k_scale / k_lo fp16 [NG + 1, Hkv, D], v_codes uint8 [(NG + 1) * 64, Hkv, D / 2],
  v_scale / v_lo fp16 [(NG + 1) * 64, Hkv, ceil(D / 64)] (`int4_groups` layouts).
- group_tables int32 [C, P, MAXG], row_maps int32 [C, P, MAXLEN]: read to reconstruct.

For each READY candidate m (the others write nothing, not even the sink):
  1. X = the exact K and V of its 64 rows, from the tail.
  2. plane > 0: X = DT(fp32(X) - fp32(X^)), X^ the rows reconstructed at plane - 1 as
     `PackedResiduals.reconstruct` does: the plane-0 row's decode (the sink's row 0 where
     a position has no plane-0 row), then for each plane 1..plane - 1 where the position
     has a row, X^ = DT(fp32(X^) + fp32(dq)); dq = DT(lo16 + scale16 * code) in fp32 (a
     product and an add, never fused). A row whose record is the sink reads the sink.
  3. K quantized per channel over the 64 rows, V per row over 64-channel groups, by the
     codec's arithmetic (`int4_groups`: fp16 lo / scale rounded first, scale at least
     2^-24, round half to even, codes 0..15, constant groups scale 1 and codes 0), written
     into record records[m]: every byte of its K codes, K scale and lo, and its 64 V rows.
`PackedResiduals.encode` writes the same bytes into every record but the sink (it sends
its not-ready candidates there); the tests compare every byte of the pools.

Planes. Plane p's residuals read the reconstruction of planes < p, which may include
groups encoded for plane p - 1 in the same forward call. `encode_planes_triton` (what
`PackedResiduals.encode` runs on CUDA) puts every plane's candidates in one launch, in
plane order: a ready program of plane p > 0 spins on a count (`sync`, int32 in device
memory) until every program of plane p - 1 has counted itself done, after a barrier that
orders its warps' stores (release; the wait's load is acquire, both by one thread). Program
ids grow with the plane and a program waits only on lower ids, which the GPU has started
before it, so the wait cannot deadlock; the launch's last program sets the counts back to
zero, so a CUDA graph replays it. Until 2026-12-07 it was one launch per plane, up to 4 a
layer, each with its Python checks: the INT4 prefill was bound by host launches
(docs/flashloop.md). `encode_groups` (tests, benches) is the one-plane launch:

    encode_groups(k_tail, v_tail, tables, page_size, p, plan.cells[p], plan.positions[p],
                  plan.records[p], plan.ready[p], plan.table_offsets[p], store.k_codes[layer],
                  store.k_scale[layer], store.k_lo[layer], store.v_codes[layer],
                  store.v_scale[layer], store.v_lo[layer], store.group_tables, store.row_maps)

Kernel: a program per (candidate, KV head, K or V), one grid axis; a not-ready
candidate's programs only count themselves done. K: the 64 rows as even and odd rows
([32, D] each: the two nibbles of a code byte), statistics per channel over both; V:
whole rows loaded (vector loads) and split into [64 rows, groups, 32] tiles of even and
odd channels, statistics per (row, group), each code byte of a reconstruction loaded once
for both nibbles. The rows' metadata (positions, pages, each plane's row and record) are
1-D, a row's in one thread, broadcast only into tile loads: as [R, 1] tiles every thread
held every row's (218 registers, 896 loads a thread; 47 -> 32 ms for an 8K prompt on the
H100 once 1-D). Reconstruction walks planes 0..plane - 1 in a loop whose bound is the
program's plane (one compiled body for every plane; a branch per plane, each with its
plane a constexpr, took 239 registers and twice the compile time), each element's code,
scale and lo gathered from its row's record, as `packed_attention` reads keys. The codec's `_stats` and `_code`
are shared with `int4_groups`. No host sync.

Precision: FMA contraction is off for the launch (the decode must not fuse). Under
`TRITON_INTERPRET=1` the fp32 -> bf16 cast truncates, so the DT roundings of the
reconstruction and the subtraction are done by hand on the bits there (as `int4_groups`
does); only fp16 and uint8 are stored. tests/test_kernels_residual_encode.py runs under the
interpreter and unchanged on CUDA (bit-exact on the H200 at 5690b40: 11 ms for a 2K
prompt's 768 launches at the ouro-1.4b shape). Not checked on the device: ready candidates' records and positions in range, and
that their reconstruction reads only encoded groups (`plan_encode` guarantees it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specloop.kernels import DTYPES
from specloop.kernels import packed_rows
from specloop.kernels.int4_groups import (
    GROUP,
    PAIRS,
    KGroups,
    VGroups,
    _code,
    _stats,
    quantize_k_groups_reference,
    quantize_v_groups_reference,
)
from specloop.kernels.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_PLANES = 4
MAX_PLANES_C = tl.constexpr(MAX_PLANES)  # the kernel's count slot: sync[MAX_PLANES]
REFERENCE_DTYPES = (*DTYPES, torch.float64)  # the torch reference also takes fp64
NUM_WARPS = 4  # the launch's warps by default


# --- Triton ---------------------------------------------------------------------------

@triton.jit
def _plane_rows(pos, base, plane, sink, group_tables_ptr, row_maps_ptr, max_groups, max_len):
    """Per row (1-D, like pos): the record (int64) and in-group row of each position's row at
    `plane`, and whether it has one; a position without one reads the sink's row 0."""
    at = (base + plane) * max_len + pos  # (cell, plane, position) of the row maps
    row = tl.load(row_maps_ptr + at)
    has = row >= 0
    row = tl.where(has, row, 0)
    record = tl.load(group_tables_ptr + (base + plane) * max_groups + row // 64)
    return tl.where(has, record, sink).to(tl.int64), row % 64, has


@triton.jit
def _k_decoded(pos, d, ok, base, plane, head, sink, k_codes_ptr, k_scale_ptr, k_lo_ptr, group_tables_ptr,
               row_maps_ptr, num_kv_heads, max_groups, max_len, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr,
               BF16_BY_HAND: tl.constexpr):
    """(dq [R, BLOCK_D], has [R]): the K decode at channels d of the rows positions pos [R]
    have in `plane` (fp32 holding DT). Code byte (record, i // 2, head, c), the row's
    nibble; scale / lo (record, head, c)."""
    record, i, has = _plane_rows(pos, base, plane, sink, group_tables_ptr, row_maps_ptr, max_groups, max_len)
    at = ((record * 32 + i // 2) * num_kv_heads + head) * HEAD_DIM
    byte = tl.load(k_codes_ptr + at[:, None] + d, mask=ok, other=0).to(tl.int32)
    code = (byte >> (4 * (i % 2))[:, None]) & 0xF
    meta = ((record * num_kv_heads + head) * HEAD_DIM)[:, None] + d
    scale = tl.load(k_scale_ptr + meta, mask=ok, other=1.0).to(tl.float32)
    lo = tl.load(k_lo_ptr + meta, mask=ok, other=0.0).to(tl.float32)
    return round_to(lo + scale * code.to(tl.float32), DTYPE, BF16_BY_HAND), has


@triton.jit
def _k_target(pos, d, ok, base, table, head, sink, k_tail_ptr, stride_ks, stride_kh, tables_ptr, k_codes_ptr,
              k_scale_ptr, k_lo_ptr, group_tables_ptr, row_maps_ptr, num_kv_heads, max_groups, max_len, plane,
              PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """What plane `plane` quantizes at rows pos [R] x channels d [1, BLOCK_D] of K, fp32
    holding DT: the exact value from the tail, minus the reconstruction at plane - 1 when
    plane > 0. Row metadata stays 1-D (a thread holds a row's, not every row's)."""
    dtype = k_tail_ptr.dtype.element_ty
    page = tl.load(tables_ptr + table + pos // PAGE_SIZE).to(tl.int64)
    at = (page * PAGE_SIZE + pos % PAGE_SIZE) * stride_ks + head * stride_kh
    x = tl.load(k_tail_ptr + at[:, None] + d, mask=ok, other=0.0).to(tl.float32)
    if plane > 0:
        hat, _ = _k_decoded(pos, d, ok, base, 0, head, sink, k_codes_ptr, k_scale_ptr, k_lo_ptr, group_tables_ptr,
                            row_maps_ptr, num_kv_heads, max_groups, max_len, HEAD_DIM, dtype, BF16_BY_HAND)
        for p in range(1, plane):
            dq, has = _k_decoded(pos, d, ok, base, p, head, sink, k_codes_ptr, k_scale_ptr, k_lo_ptr,
                                 group_tables_ptr, row_maps_ptr, num_kv_heads, max_groups, max_len, HEAD_DIM, dtype,
                                 BF16_BY_HAND)
            hat = tl.where(has[:, None], round_to(hat + dq, dtype, BF16_BY_HAND), hat)
        x = round_to(x - hat, dtype, BF16_BY_HAND)
    return x


@triton.jit
def _encode_k(m, head, base, record, table, sink, k_tail_ptr, stride_ks, stride_kh, tables_ptr, positions_ptr,
              k_codes_ptr, k_scale_ptr, k_lo_ptr, group_tables_ptr, row_maps_ptr, num_kv_heads, max_groups, max_len,
              plane, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BF16_BY_HAND: tl.constexpr):
    """K of one (candidate, head): even rows 2p and odd rows 2p + 1 [32, BLOCK_D] (a code
    byte's two nibbles), per-channel parameters."""
    p = tl.arange(0, 32)
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = d < HEAD_DIM
    pos_a = tl.load(positions_ptr + m * 64 + 2 * p)
    pos_b = tl.load(positions_ptr + m * 64 + 2 * p + 1)
    a = _k_target(pos_a, d, ok, base, table, head, sink, k_tail_ptr, stride_ks, stride_kh, tables_ptr, k_codes_ptr,
                  k_scale_ptr, k_lo_ptr, group_tables_ptr, row_maps_ptr, num_kv_heads, max_groups, max_len, plane,
                  PAGE_SIZE, HEAD_DIM, BF16_BY_HAND)
    b = _k_target(pos_b, d, ok, base, table, head, sink, k_tail_ptr, stride_ks, stride_kh, tables_ptr, k_codes_ptr,
                  k_scale_ptr, k_lo_ptr, group_tables_ptr, row_maps_ptr, num_kv_heads, max_groups, max_len, plane,
                  PAGE_SIZE, HEAD_DIM, BF16_BY_HAND)
    lo16, scale16, varies = _stats(a, b, ok, ok, 0)  # per channel [1, BLOCK_D]
    byte = _code(a, ok, lo16, scale16, varies) | (_code(b, ok, lo16, scale16, varies) << 4)
    rows = ((record * 32 + p) * num_kv_heads + head) * HEAD_DIM
    tl.store(k_codes_ptr + rows[:, None] + d, byte.to(tl.uint8), mask=ok)
    meta = (record * num_kv_heads + head) * HEAD_DIM + d
    tl.store(k_scale_ptr + meta, scale16.to(tl.float16), mask=ok)
    tl.store(k_lo_ptr + meta, lo16.to(tl.float16), mask=ok)


@triton.jit
def _v_decoded(pos, j, k, ok, base, plane, head, sink, v_codes_ptr, v_scale_ptr, v_lo_ptr, group_tables_ptr,
               row_maps_ptr, num_kv_heads, max_groups, max_len, HEAD_DIM: tl.constexpr, V_GROUPS: tl.constexpr,
               DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """(dq_even, dq_odd [64, BLOCK_G, 32], has [64]): the V decode of channels 64 j + 2 k and
    64 j + 2 k + 1 of the rows positions pos [64] have in `plane`: the low and high nibble of
    byte (record * 64 + i, head, 32 j + k), one load; scale / lo per (row, 64 channels)."""
    record, i, has = _plane_rows(pos, base, plane, sink, group_tables_ptr, row_maps_ptr, max_groups, max_len)
    vrow = ((record * 64 + i) * num_kv_heads + head)[:, None, None]
    byte = tl.load(v_codes_ptr + vrow * (HEAD_DIM // 2) + 32 * j + k, mask=ok, other=0).to(tl.int32)
    meta = vrow * V_GROUPS + j
    scale = tl.load(v_scale_ptr + meta, mask=j < V_GROUPS, other=1.0).to(tl.float32)
    lo = tl.load(v_lo_ptr + meta, mask=j < V_GROUPS, other=0.0).to(tl.float32)
    even = round_to(lo + scale * (byte & 0xF).to(tl.float32), DTYPE, BF16_BY_HAND)
    odd = round_to(lo + scale * (byte >> 4).to(tl.float32), DTYPE, BF16_BY_HAND)
    return even, odd, has


@triton.jit
def _encode_v(m, head, base, record, table, sink, v_tail_ptr, stride_vs, stride_vh, tables_ptr, positions_ptr,
              v_codes_ptr, v_scale_ptr, v_lo_ptr, group_tables_ptr, row_maps_ptr, num_kv_heads, max_groups, max_len,
              plane, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, V_GROUPS: tl.constexpr,
              BLOCK_G: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """V of one (candidate, head): rows [64] x groups [BLOCK_G] x channel pairs [32], even
    channels 64 j + 2 k (a) and odd ones (b), split from whole rows loaded as [64, BLOCK_G,
    32, 2] (contiguous: vector loads); parameters per (row, 64 channels)."""
    dtype = v_tail_ptr.dtype.element_ty
    i = tl.arange(0, 64)
    j = tl.arange(0, BLOCK_G)[None, :, None]
    k = tl.arange(0, 32)[None, None, :]
    ok = 32 * j + k < HEAD_DIM // 2  # the pair's byte (D is even); contiguous in k, so loads vectorize
    pos = tl.load(positions_ptr + m * 64 + i)
    page = tl.load(tables_ptr + table + pos // PAGE_SIZE).to(tl.int64)
    at = (page * PAGE_SIZE + pos % PAGE_SIZE) * stride_vs + head * stride_vh
    c = tl.arange(0, 64 * BLOCK_G)[None, :]
    x = tl.load(v_tail_ptr + at[:, None] + c, mask=c < HEAD_DIM, other=0.0).to(tl.float32)
    a, b = tl.split(tl.reshape(x, (64, BLOCK_G, 32, 2)))  # [64, BLOCK_G, 32] each
    if plane > 0:
        hat_a, hat_b, _ = _v_decoded(pos, j, k, ok, base, 0, head, sink, v_codes_ptr, v_scale_ptr, v_lo_ptr,
                                     group_tables_ptr, row_maps_ptr, num_kv_heads, max_groups, max_len, HEAD_DIM,
                                     V_GROUPS, dtype, BF16_BY_HAND)
        for p in range(1, plane):
            dq_a, dq_b, has = _v_decoded(pos, j, k, ok, base, p, head, sink, v_codes_ptr, v_scale_ptr, v_lo_ptr,
                                         group_tables_ptr, row_maps_ptr, num_kv_heads, max_groups, max_len,
                                         HEAD_DIM, V_GROUPS, dtype, BF16_BY_HAND)
            has = has[:, None, None]
            hat_a = tl.where(has, round_to(hat_a + dq_a, dtype, BF16_BY_HAND), hat_a)
            hat_b = tl.where(has, round_to(hat_b + dq_b, dtype, BF16_BY_HAND), hat_b)
        a = round_to(a - hat_a, dtype, BF16_BY_HAND)
        b = round_to(b - hat_b, dtype, BF16_BY_HAND)
    lo16, scale16, varies = _stats(a, b, ok, ok, 2)  # per (row, group) [64, BLOCK_G, 1]
    byte = _code(a, ok, lo16, scale16, varies) | (_code(b, ok, lo16, scale16, varies) << 4)
    vrow = ((record * 64 + i) * num_kv_heads + head)[:, None, None]
    tl.store(v_codes_ptr + vrow * (HEAD_DIM // 2) + 32 * j + k, byte.to(tl.uint8), mask=ok)
    meta = vrow * V_GROUPS + j
    tl.store(v_scale_ptr + meta, scale16.to(tl.float16), mask=j < V_GROUPS)
    tl.store(v_lo_ptr + meta, lo16.to(tl.float16), mask=j < V_GROUPS)


@triton.jit
def _encode_one(m, head, is_v, base, record, table, sink, k_tail_ptr, v_tail_ptr, stride_ks, stride_kh, stride_vs,
                stride_vh, tables_ptr, positions_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr,
                v_lo_ptr, group_tables_ptr, row_maps_ptr, num_kv_heads, max_groups, max_len, plane,
                PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, V_GROUPS: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_G: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    # K and V bodies live in their own functions: a compiled if/else must give the names
    # both branches assign one type, and K's tiles are 2-D where V's are 3-D.
    if is_v == 0:
        _encode_k(m, head, base, record, table, sink, k_tail_ptr, stride_ks, stride_kh, tables_ptr,
                  positions_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, group_tables_ptr, row_maps_ptr,
                  num_kv_heads, max_groups, max_len, plane, PAGE_SIZE, HEAD_DIM, BLOCK_D, BF16_BY_HAND)
    else:
        _encode_v(m, head, base, record, table, sink, v_tail_ptr, stride_vs, stride_vh, tables_ptr,
                  positions_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, group_tables_ptr, row_maps_ptr,
                  num_kv_heads, max_groups, max_len, plane, PAGE_SIZE, HEAD_DIM, V_GROUPS, BLOCK_G, BF16_BY_HAND)


@triton.jit(do_not_specialize=["start1", "start2", "start3", "total"])
def _encode_kernel(
    k_tail_ptr, v_tail_ptr, tables_ptr, cells_ptr, positions_ptr, records_ptr, ready_ptr, table_offsets_ptr,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, group_tables_ptr, row_maps_ptr,
    sync_ptr, stride_ks, stride_kh, stride_vs, stride_vh, num_kv_heads, num_planes, max_groups, max_len, sink,
    start1, start2, start3, total,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, V_GROUPS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    # program (m * Hkv + head) * 2 + (K: 0, V: 1); candidates [start_p, start_(p+1)) are plane p's
    pid = tl.program_id(0)
    is_v = pid % 2
    head = (pid // 2) % num_kv_heads
    m = (pid // 2 // num_kv_heads).to(tl.int64)
    plane = (m >= start1).to(tl.int32) + (m >= start2).to(tl.int32) + (m >= start3).to(tl.int32)
    if tl.load(ready_ptr + m) != 0:  # a candidate that is not ready writes nothing
        if plane > 0:  # wait for every program of plane - 1: its groups may be what this residual reads
            first = tl.where(plane == 1, 0, tl.where(plane == 2, start1, start2))
            last = tl.where(plane == 1, start1, tl.where(plane == 2, start2, start3))
            need = ((last - first) * num_kv_heads * 2).to(tl.int32)
            seen = tl.atomic_add(sync_ptr + plane - 1, 0, sem="acquire")
            while seen < need:
                seen = tl.atomic_add(sync_ptr + plane - 1, 0, sem="acquire")
        base = tl.load(cells_ptr + m).to(tl.int64) * num_planes  # (cell, plane 0) of the tables
        record = tl.load(records_ptr + m).to(tl.int64)
        table = tl.maximum(tl.load(table_offsets_ptr + m).to(tl.int64), 0)
        _encode_one(m, head, is_v, base, record, table, sink, k_tail_ptr, v_tail_ptr, stride_ks, stride_kh,
                    stride_vs, stride_vh, tables_ptr, positions_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr,
                    v_scale_ptr, v_lo_ptr, group_tables_ptr, row_maps_ptr, num_kv_heads, max_groups, max_len, plane,
                    PAGE_SIZE, HEAD_DIM, V_GROUPS, BLOCK_D, BLOCK_G, BF16_BY_HAND)
    # every warp's stores before the count that releases the next plane; the last program
    # of the launch puts the counts back to zero for the next launch (CUDA graphs replay it)
    tl.debug_barrier()
    tl.atomic_add(sync_ptr + plane, 1, sem="release")
    if tl.atomic_add(sync_ptr + MAX_PLANES_C, 1, sem="acq_rel") == total - 1:
        for p in tl.static_range(MAX_PLANES_C + 1):
            tl.atomic_xchg(sync_ptr + p, 0)


def _check(k_tail, v_tail, tables, plane, cells, positions, records, ready, table_offsets, k_codes, k_scale, k_lo,
           v_codes, v_scale, v_lo, group_tables, row_maps, dtypes=DTYPES) -> None:
    _, heads, dim = k_tail.shape
    assert k_tail.dtype in dtypes, f"residual encoding takes {', '.join(map(str, dtypes))}, not {k_tail.dtype}"
    assert v_tail.shape == k_tail.shape and v_tail.dtype == k_tail.dtype, "K and V tails must be [S, Hkv, D] alike"
    assert k_tail.stride(2) == 1 and v_tail.stride(2) == 1, "the head dim must be contiguous"
    assert dim % 2 == 0, "the head dim must be even"
    n = k_codes.shape[0]
    groups = triton.cdiv(dim, GROUP)
    assert k_codes.shape == (n, PAIRS, heads, dim) and k_codes.dtype == torch.uint8, "k codes: [NG + 1, 32, Hkv, D]"
    assert k_scale.shape == k_lo.shape == (n, heads, dim), "k scale, lo: [NG + 1, Hkv, D]"
    assert v_codes.shape == (n * GROUP, heads, dim // 2) and v_codes.dtype == torch.uint8, "v codes shape"
    assert v_scale.shape == v_lo.shape == (n * GROUP, heads, groups), "v scale, lo: [(NG + 1) * 64, Hkv, ceil(D/64)]"
    assert all(t.dtype == torch.float16 for t in (k_scale, k_lo, v_scale, v_lo)), "scales and minimums are fp16"
    assert group_tables.dim() == row_maps.dim() == 3 and group_tables.shape[:2] == row_maps.shape[:2], \
        "group tables and row maps: [C, P, *], same cells and planes"
    assert 0 <= plane < row_maps.shape[1] <= MAX_PLANES, f"plane {plane} of {row_maps.shape[1]} (at most {MAX_PLANES})"
    m = cells.shape[0]
    assert positions.shape == (m, GROUP) and not positions.is_floating_point(), "positions: [M, 64] int"
    assert ready.shape == (m,) and ready.dtype == torch.bool, "ready: [M] bool"
    for t in (cells, records, table_offsets):
        assert t.shape == (m,) and not t.is_floating_point(), "cells, records, table offsets: [M] int"
    for t in (k_codes, k_scale, k_lo, v_codes, v_scale, v_lo, group_tables, row_maps, tables, cells, positions,
              records, ready, table_offsets):
        assert t.is_contiguous(), "records, tables and candidate vectors must be contiguous"


def encode_planes_triton(k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor, page_size: int,
                         starts: tuple[int, ...], cells: torch.Tensor, positions: torch.Tensor, records: torch.Tensor,
                         ready: torch.Tensor, table_offsets: torch.Tensor, k_codes: torch.Tensor,
                         k_scale: torch.Tensor, k_lo: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor,
                         v_lo: torch.Tensor, group_tables: torch.Tensor, row_maps: torch.Tensor, sync: torch.Tensor, *,
                         sink: int | None = None, num_warps: int | None = None) -> None:
    """Every plane's candidates in one launch: candidates [starts[p], starts[p + 1]) are plane
    p's (starts: P + 1 host ints from 0 to M, nondecreasing), in plane order. A ready
    program of plane p > 0 first waits until every program of plane p - 1 has counted
    itself done in `sync` (int32 [MAX_PLANES + 1], zeros; the launch leaves it zeros), since
    its residual may read a group plane p - 1 encodes here. Programs run plane-major
    (program ids grow with the plane), and a program waits only on programs with lower
    ids, which the GPU has started before it: no deadlock. No argument checks (`_check`
    per plane: `check_encode`), no host sync."""
    m = starts[-1]
    if m == 0:
        return
    heads, dim = k_tail.shape[1:]
    planes = row_maps.shape[1]
    assert len(starts) == planes + 1 and starts[0] == 0, "starts: planes + 1 candidate offsets from 0"
    bounds = [*starts[1:], m, m, m][:MAX_PLANES - 1]  # planes past the last one: no candidates
    v_groups = triton.cdiv(dim, GROUP)
    _encode_kernel[(m * heads * 2,)](
        k_tail, v_tail, tables, cells, positions, records, ready, table_offsets, k_codes, k_scale, k_lo, v_codes,
        v_scale, v_lo, group_tables, row_maps, sync, k_tail.stride(0), k_tail.stride(1), v_tail.stride(0),
        v_tail.stride(1), heads, planes, group_tables.shape[2], row_maps.shape[2],
        k_codes.shape[0] - 1 if sink is None else sink, *bounds, m * heads * 2,
        PAGE_SIZE=page_size, HEAD_DIM=dim, V_GROUPS=v_groups,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_G=triton.next_power_of_2(v_groups),
        BF16_BY_HAND=_INTERPRET and k_tail.dtype == torch.bfloat16, enable_fp_fusion=False,
        num_warps=NUM_WARPS if num_warps is None else num_warps)


def new_sync(device: torch.device) -> torch.Tensor:
    """The counts `encode_planes_triton` orders planes by: zeros, and zeros again after each launch."""
    return torch.zeros(MAX_PLANES + 1, dtype=torch.int32, device=device)


def encode_groups_triton(k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor, page_size: int,
                         plane: int, cells: torch.Tensor, positions: torch.Tensor, records: torch.Tensor,
                         ready: torch.Tensor, table_offsets: torch.Tensor, k_codes: torch.Tensor,
                         k_scale: torch.Tensor, k_lo: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor,
                         v_lo: torch.Tensor, group_tables: torch.Tensor, row_maps: torch.Tensor, *,
                         sink: int | None = None, num_warps: int | None = None) -> None:
    """One plane's candidates: `encode_planes_triton` with them all at `plane` (nothing to
    wait for), its arguments checked. `num_warps`: NUM_WARPS when None
    (bench/int4_prefill_sweep.py times others)."""
    _check(k_tail, v_tail, tables, plane, cells, positions, records, ready, table_offsets, k_codes, k_scale, k_lo,
           v_codes, v_scale, v_lo, group_tables, row_maps)
    m = cells.shape[0]
    starts = tuple([0] * (plane + 1) + [m] * (row_maps.shape[1] - plane))
    encode_planes_triton(k_tail, v_tail, tables, page_size, starts, cells, positions, records, ready, table_offsets,
                         k_codes, k_scale, k_lo, v_codes, v_scale, v_lo, group_tables, row_maps,
                         new_sync(k_tail.device), sink=sink, num_warps=num_warps)


# --- torch reference ------------------------------------------------------------------

def encode_groups_reference(k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor, page_size: int,
                            plane: int, cells: torch.Tensor, positions: torch.Tensor, records: torch.Tensor,
                            ready: torch.Tensor, table_offsets: torch.Tensor, k_codes: torch.Tensor,
                            k_scale: torch.Tensor, k_lo: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor,
                            v_lo: torch.Tensor, group_tables: torch.Tensor, row_maps: torch.Tensor, *,
                            sink: int | None = None) -> None:
    """The same in plain PyTorch. On CUDA without a host sync: every candidate computed,
    only the ready ones' records changed (the others' writes put back what their record
    held); on the CPU, where a sync is free, the ready candidates alone (the same records
    change; the INT4 engine tests on the CPU ran 3x faster)."""
    _check(k_tail, v_tail, tables, plane, cells, positions, records, ready, table_offsets, k_codes, k_scale, k_lo,
           v_codes, v_scale, v_lo, group_tables, row_maps, REFERENCE_DTYPES)
    if not k_tail.is_cuda:  # a host sync costs nothing on the CPU: the ready candidates alone, the same writes
        chosen = ready.nonzero().flatten()
        cells, positions, records, ready, table_offsets = (
            x[chosen] for x in (cells, positions, records, ready, table_offsets))
    m = cells.shape[0]
    if m == 0:
        return
    sink = k_codes.shape[0] - 1 if sink is None else sink
    dtype, positions, records = k_tail.dtype, positions.long(), records.long()
    pages = tables[table_offsets.long().clamp(min=0)[:, None] + positions // page_size].long()
    slots = pages * page_size + positions % page_size  # [M, 64]
    k, v = k_tail[slots], v_tail[slots]  # [M, 64, Hkv, D]
    if plane > 0:  # minus the reconstruction at plane - 1 (the sink's where a row has no record)
        k_hat, v_hat = packed_rows.reconstruct(KGroups(k_codes, k_scale, k_lo), VGroups(v_codes, v_scale, v_lo),
                                               group_tables, row_maps, cells.long(), plane - 1, positions, dtype,
                                               absent=sink)
        k, v = k - k_hat, v - v_hat
    valid = torch.full((m,), GROUP, dtype=torch.int32, device=k.device)
    kg = quantize_k_groups_reference(k.contiguous(), valid)
    vg = quantize_v_groups_reference(v.flatten(0, 1).contiguous())
    keep = ready[:, None, None]
    k_codes[records] = torch.where(keep[..., None], kg.codes, k_codes[records])
    k_scale[records] = torch.where(keep, kg.scale, k_scale[records])
    k_lo[records] = torch.where(keep, kg.lo, k_lo[records])
    rows = (records[:, None] * GROUP + torch.arange(GROUP, device=k.device)).flatten()
    keep_rows = ready.repeat_interleave(GROUP)[:, None, None]
    v_codes[rows] = torch.where(keep_rows, vg.codes, v_codes[rows])
    v_scale[rows] = torch.where(keep_rows, vg.scale, v_scale[rows])
    v_lo[rows] = torch.where(keep_rows, vg.lo, v_lo[rows])


# --- dispatch -------------------------------------------------------------------------

def encode_groups(k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor, page_size: int, plane: int,
                  cells: torch.Tensor, positions: torch.Tensor, records: torch.Tensor, ready: torch.Tensor,
                  table_offsets: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_lo: torch.Tensor,
                  v_codes: torch.Tensor, v_scale: torch.Tensor, v_lo: torch.Tensor, group_tables: torch.Tensor,
                  row_maps: torch.Tensor, *, sink: int | None = None, use_triton: bool | None = None) -> None:
    """Encode plane `plane`'s ready candidates of one layer into their records, in place
    (module docstring); `sink` defaults to the last record. Triton on CUDA by default;
    use_triton=True also runs it on CPU under TRITON_INTERPRET=1."""
    if use_triton is None:
        use_triton = k_tail.is_cuda
    assert not use_triton or k_tail.is_cuda or _INTERPRET, "Triton runs on CUDA tensors or under TRITON_INTERPRET=1"
    fn = encode_groups_triton if use_triton else encode_groups_reference
    fn(k_tail, v_tail, tables, page_size, plane, cells, positions, records, ready, table_offsets, k_codes, k_scale,
       k_lo, v_codes, v_scale, v_lo, group_tables, row_maps, sink=sink)


def check_encode(k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor, plane: int, cells: torch.Tensor,
                 positions: torch.Tensor, records: torch.Tensor, ready: torch.Tensor, table_offsets: torch.Tensor,
                 k_codes: torch.Tensor, k_scale: torch.Tensor, k_lo: torch.Tensor, v_codes: torch.Tensor,
                 v_scale: torch.Tensor, v_lo: torch.Tensor, group_tables: torch.Tensor, row_maps: torch.Tensor
                 ) -> None:
    """The checks of one plane's Triton launch (`encode_groups_triton`), for a caller that
    launches `encode_planes_triton`, which checks nothing (the Triton dtypes: no fp64)."""
    _check(k_tail, v_tail, tables, plane, cells, positions, records, ready, table_offsets, k_codes, k_scale, k_lo,
           v_codes, v_scale, v_lo, group_tables, row_maps)
