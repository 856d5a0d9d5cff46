"""Keys as a query row reads them from FlashLoop's packed planes: exact from BF16 tail
pages or reconstructed from INT4 residual groups. Here are the read rule's per-key gather in
Triton (`_key_block` and its helpers), which the packed reader (`packed_attention`) and
sparse decode's packed launches (`sparse_decode_source`, `sparse_decode_select`,
`sparse_decode_split_select`, `sparse_decode_correction`) share, so it sits apart from
both; `read_keys`, which stores that gather so that tests check the kernels'
reconstruction bit for bit; and the rule's torch references (`key_seals`,
`reconstruct_keys`, `row_keys`, `read_keys_reference`), which the packed reader's
reference and sparse decode's references read keys through.

    packed = PackedKV(k_groups, v_groups, record_seal, group_tables, row_maps)
    k, v = read_keys(k_tail, v_tail, tables, page_size, packed, cell, depth, position,
                     table_offset, keys)

What a call reads (one layer; the caller slices layers). DT is the model dtype (fp32, bf16
or fp16), Hkv KV heads, D the head dim (even), P <= 4 depth planes (0-based), GROUP = 64.

- Packed records, NG of them, one per 64-row group of one plane of one request cell: K as
  `int4_groups.KGroups` with G = NG (codes uint8 [NG, 32, Hkv, D], scale / lo fp16
  [NG, Hkv, D]) and V as `int4_groups.VGroups` with N = NG * 64 (codes uint8
  [NG * 64, Hkv, D / 2], scale / lo fp16 [NG * 64, Hkv, ceil(D / 64)]): in-group row i of
  record g is K row i of group g and V row g * 64 + i. record_seal int32 [NG] is the first
  query position that reads the record's rows reconstructed (NEVER = 2^31 - 1: none does).
- Per cell (C of them): group_tables int32 [C, P, MAXG], the record of compact group g of
  plane p (-1: none), and row_maps int32 [C, P, MAXLEN], the compact row of position j in
  plane p or -1 when j has no row there (absent means inherited from the planes before, not
  code 0). Every plane, plane 0 included, is read through its map.
- The BF16 tail (the exact values, one layer of the paged pool): k_tail, v_tail [S, Hkv, D]
  in DT; key j of a row sits at tables[table_offset + j // page_size] * page_size
  + j % page_size, the row's plane-d page table as in `paged_attention`.
- Rows, each with its cell, depth d (a plane), position and table offset. A row with a
  negative position is padding (`read_keys` gives it zeros).

The read rule, for row (cell c, depth d, position q) and key j <= q:
  1. s = the seal of the record holding j's deepest row at a plane <= d (NEVER when that
     row's group has no record; `key_seals`).
  2. q >= s: reconstructed (`reconstruct_keys`): x = dq(plane-0 row), then for each plane
     1..d where j has a row, x = DT(fp32(x) + fp32(dq(that row))). dq is the codec's decode,
     DT(lo16 + scale16 * code) in fp32 (a product and an add, never fused), rounded once.
  3. q < s: exact, from the tail.
The reconstructed path never loads a tail slot and the exact path never a packed record:
every load is masked, and unwanted lanes are replaced with `where`, so NaN in storage a row
does not read cannot reach it.

The gather, per block of keys: the row maps and group tables of planes 0..d are gathered
once (`_block_rows`: four planes unrolled, those past P or the depth masked off without a
load) and serve both the seals and the decode; they give every key's seal (`_key_seals`).
Keys read reconstructed are decoded plane by plane (`_reconstructed`, `_plane_decode`:
codes, scale and lo loaded only for them) and keys read exact load their tail slots
(`_exact`). `_key_block` is that gather for one row; the packed reader runs the same
helpers for a tile of rows.

Precision: the gather holds DT values in fp32 registers. The decode must not fuse, so every
launch that runs it turns FMA contraction off (`enable_fp_fusion=False`). Under
`TRITON_INTERPRET=1` rounding to bf16 is done by hand on the bits (its fp32 -> bf16 cast
truncates); see ../shared/docs/gpu.md and `int4_groups`.

Not checked on the device (no host sync in `read_keys_triton`): depth < P, positions <
MAXLEN, and that a key read reconstructed has a plane-0 row and every row it reads a
record (the references assert these).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from specloop.kernels import DTYPES
from specloop.kernels import packed_rows
from specloop.kernels.int4_groups import GROUP, PAIRS, KGroups, VGroups
from specloop.kernels.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_PLANES = 4
REFERENCE_DTYPES = (*DTYPES, torch.float64)  # the torch references also take fp64 (exact CPU tests)


@dataclasses.dataclass(frozen=True)
class PackedKV:
    """One layer's packed planes: K / V records, their seals and each cell's tables.

    k: KGroups with G = NG records; v: VGroups with N = NG * 64 rows; seal int32 [NG];
    group_tables int32 [C, P, MAXG] (record of compact group g of plane p, -1: none);
    row_maps int32 [C, P, MAXLEN] (compact row of position j in plane p, -1: no row)."""

    k: KGroups
    v: VGroups
    seal: torch.Tensor
    group_tables: torch.Tensor
    row_maps: torch.Tensor

    @property
    def planes(self) -> int:
        return self.row_maps.shape[1]


# --- Triton ---------------------------------------------------------------------------

@triton.jit
def _plane_rows(j, j_ok, base, depth, group_tables_ptr, row_maps_ptr, max_groups, max_len, p: tl.constexpr,
                PLANES: tl.constexpr):
    """Compact row and record [BLOCK_N] of keys j at plane p (-1: no row, or no record for
    it; p past the depth or the planes: -1 without a load), gathered once a block for both
    the seals and the decode."""
    if p < PLANES:
        on = j_ok & (tl.zeros_like(j) + depth >= p)  # (a scalar in a vector mask fails under the interpreter)
        r = tl.load(row_maps_ptr + (base + p) * max_len + j, mask=on, other=-1)
        rec = tl.load(group_tables_ptr + (base + p) * max_groups + tl.where(r >= 0, r, 0) // 64, mask=r >= 0,
                      other=-1)
    else:
        r = tl.zeros_like(j) - 1
        rec = tl.zeros_like(j) - 1
    return r, rec


@triton.jit
def _deeper_seal(seal, r, rec, seal_ptr):
    """The seal where a plane has a row (the record's, NEVER when the row has no record),
    `seal` (the planes before) elsewhere: applied plane by plane, the deepest row's."""
    has = r >= 0
    s = tl.load(seal_ptr + tl.where(rec >= 0, rec, 0), mask=has & (rec >= 0), other=2147483647)
    return tl.where(has, s, seal)


@triton.jit
def _key_seals(j, seal_ptr, r0, c0, r1, c1, r2, c2, r3, c3):
    """Seal [BLOCK_N] of keys j: the seal of the record holding each key's deepest row at a
    plane <= depth (NEVER for keys with no row: masked keys, from `_plane_rows`)."""
    seal = tl.zeros_like(j) + 2147483647
    seal = _deeper_seal(seal, r0, c0, seal_ptr)
    seal = _deeper_seal(seal, r1, c1, seal_ptr)
    seal = _deeper_seal(seal, r2, c2, seal_ptr)
    return _deeper_seal(seal, r3, c3, seal_ptr)


@triton.jit
def _plane_decode(
    k, v, r, rec, recon, kv_head, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr,
    num_kv_heads, p: tl.constexpr, DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    PARTS: tl.constexpr = 3,
):
    """k, v with plane p's decode applied for keys with a row and a record there where
    `recon`: plane 0's decode, or the residual added and rounded (codes, scale and lo
    loaded only for those keys). PARTS: 3 both, 1 K alone, 2 V alone (the other returned
    as given: nothing of it is loaded). Masks alone, no branch on the depth or on keys sharing a
    record: planes past the depth have no rows (`_plane_rows`), and the branching variant
    (one [D] scale load for a one-record block) was 1.2x slower on the H200
    (bench/results/packed_reader_sweep_h200.json)."""
    if p < PLANES:
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        use = recon & (r >= 0) & (rec >= 0)
        row = tl.where(use, r % 64, 0)
        rec = tl.where(use, rec, 0).to(tl.int64)
        ok = use[:, None] & d_ok[None, :]
        if PARTS % 2 == 1:
            # K: byte (rec, row // 2, head, d), the row's nibble; scale / lo (rec, head, d)
            pair = (rec * 32 + row // 2) * num_kv_heads + kv_head
            byte = tl.load(k_codes_ptr + pair[:, None] * HEAD_DIM + d[None, :], mask=ok, other=0).to(tl.int32)
            code = (byte >> (4 * (row % 2))[:, None]) & 0xF
            each = ((rec * num_kv_heads + kv_head) * HEAD_DIM)[:, None] + d[None, :]
            scale = tl.load(k_scale_ptr + each, mask=ok, other=0.0).to(tl.float32)
            lo = tl.load(k_lo_ptr + each, mask=ok, other=0.0).to(tl.float32)
            dk = round_to(lo + scale * code.to(tl.float32), DTYPE, BF16_BY_HAND)
            if p == 0:
                k = tl.where(ok, dk, 0.0)
            else:
                k = tl.where(ok, round_to(k + dk, DTYPE, BF16_BY_HAND), k)
        if PARTS >= 2:
            # V: row rec * 64 + row; byte (that row, head, d // 2), the channel's nibble; scale / lo
            # per (row, 64 channels): one [BLOCK_N] load per channel group, spread over its channels
            vrow = (rec * 64 + row) * num_kv_heads + kv_head
            byte = tl.load(v_codes_ptr + vrow[:, None] * (HEAD_DIM // 2) + d[None, :] // 2, mask=ok,
                           other=0).to(tl.int32)
            code = (byte >> (4 * (d % 2))[None, :]) & 0xF
            scale = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
            lo = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
            for g in tl.static_range(V_GROUPS):
                at = vrow * V_GROUPS + g
                here = (d // 64 == g)[None, :]
                scale = tl.where(here, tl.load(v_scale_ptr + at, mask=use, other=0.0).to(tl.float32)[:, None],
                                 scale)
                lo = tl.where(here, tl.load(v_lo_ptr + at, mask=use, other=0.0).to(tl.float32)[:, None], lo)
            dv = round_to(lo + scale * code.to(tl.float32), DTYPE, BF16_BY_HAND)
            if p == 0:
                v = tl.where(ok, dv, 0.0)
            else:
                v = tl.where(ok, round_to(v + dv, DTYPE, BF16_BY_HAND), v)
    return k, v


@triton.jit
def _reconstructed(
    recon, kv_head, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, num_kv_heads,
    r0, c0, r1, c1, r2, c2, r3, c3,
    DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PLANES: tl.constexpr, V_GROUPS: tl.constexpr, BF16_BY_HAND: tl.constexpr, PARTS: tl.constexpr = 3,
):
    """K and V [BLOCK_N, BLOCK_D] of the block's keys reconstructed at the rows' depth where
    `recon`, fp32 holding DTYPE values, 0 elsewhere: plane 0's decode plus the residual of
    each plane up to the depth with a row (planes past it have none: `_plane_rows`)."""
    k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    v = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    k, v = _plane_decode(k, v, r0, c0, recon, kv_head, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr,
                         v_scale_ptr, v_lo_ptr, num_kv_heads, 0, DTYPE, HEAD_DIM, BLOCK_N, BLOCK_D, PLANES, V_GROUPS,
                         BF16_BY_HAND, PARTS)
    k, v = _plane_decode(k, v, r1, c1, recon, kv_head, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr,
                         v_scale_ptr, v_lo_ptr, num_kv_heads, 1, DTYPE, HEAD_DIM, BLOCK_N, BLOCK_D, PLANES, V_GROUPS,
                         BF16_BY_HAND, PARTS)
    k, v = _plane_decode(k, v, r2, c2, recon, kv_head, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr,
                         v_scale_ptr, v_lo_ptr, num_kv_heads, 2, DTYPE, HEAD_DIM, BLOCK_N, BLOCK_D, PLANES, V_GROUPS,
                         BF16_BY_HAND, PARTS)
    k, v = _plane_decode(k, v, r3, c3, recon, kv_head, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr,
                         v_scale_ptr, v_lo_ptr, num_kv_heads, 3, DTYPE, HEAD_DIM, BLOCK_N, BLOCK_D, PLANES, V_GROUPS,
                         BF16_BY_HAND, PARTS)
    return k, v


@triton.jit
def _block_rows(j, j_ok, cell, depth, group_tables_ptr, row_maps_ptr, max_groups, max_len, PLANES: tl.constexpr):
    """Rows and records of the block's keys at planes 0..3 (`_plane_rows`)."""
    base = cell * PLANES  # (cell, plane 0) of the tables
    r0, c0 = _plane_rows(j, j_ok, base, depth, group_tables_ptr, row_maps_ptr, max_groups, max_len, 0, PLANES)
    r1, c1 = _plane_rows(j, j_ok, base, depth, group_tables_ptr, row_maps_ptr, max_groups, max_len, 1, PLANES)
    r2, c2 = _plane_rows(j, j_ok, base, depth, group_tables_ptr, row_maps_ptr, max_groups, max_len, 2, PLANES)
    r3, c3 = _plane_rows(j, j_ok, base, depth, group_tables_ptr, row_maps_ptr, max_groups, max_len, 3, PLANES)
    return r0, c0, r1, c1, r2, c2, r3, c3


@triton.jit
def _exact(
    j, exact, table, kv_head, k_tail_ptr, v_tail_ptr, tables_ptr, stride_ks, stride_kh, stride_vs, stride_vh,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PARTS: tl.constexpr = 3,
):
    """K and V [BLOCK_N, BLOCK_D] (the tails' dtype) of keys j from their tail slots in the
    page table at `table` where `exact`, 0 elsewhere (no other slot is loaded; PARTS as in
    `_plane_decode`: a part not asked for is all 0, nothing of it loaded)."""
    d = tl.arange(0, BLOCK_D)
    page = tl.load(tables_ptr + table + tl.where(exact, j, 0) // PAGE_SIZE, mask=exact, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + j % PAGE_SIZE
    ok = exact[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_tail_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                mask=ok & (PARTS % 2 == 1), other=0.0)
    v = tl.load(v_tail_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                mask=ok & (PARTS >= 2), other=0.0)
    return k, v


@triton.jit
def _key_block(
    j, j_ok, cell, depth, pos, table, kv_head,
    k_tail_ptr, v_tail_ptr, tables_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr,
    seal_ptr, group_tables_ptr, row_maps_ptr,
    stride_ks, stride_kh, stride_vs, stride_vh, num_kv_heads, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PLANES: tl.constexpr, V_GROUPS: tl.constexpr, BF16_BY_HAND: tl.constexpr, PARTS: tl.constexpr = 3,
):
    """K and V [BLOCK_N, BLOCK_D] of keys j (where j_ok) as one row at `pos` reads them: fp32
    holding DT values, 0 elsewhere (the attention kernel's gather for a one-row tile; PARTS
    as in `_plane_decode`)."""
    r0, c0, r1, c1, r2, c2, r3, c3 = _block_rows(j, j_ok, cell, depth, group_tables_ptr, row_maps_ptr, max_groups,
                                                 max_len, PLANES)
    seal = _key_seals(j, seal_ptr, r0, c0, r1, c1, r2, c2, r3, c3)
    recon = j_ok & (pos >= seal)
    exact = j_ok & (pos < seal)
    k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    v = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if tl.max(recon.to(tl.int32), axis=0) > 0:  # a block of exact keys skips the decode
        k, v = _reconstructed(recon, kv_head, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr,
                              v_lo_ptr, num_kv_heads, r0, c0, r1, c1, r2, c2, r3, c3, k_tail_ptr.dtype.element_ty,
                              HEAD_DIM, BLOCK_N, BLOCK_D, PLANES, V_GROUPS, BF16_BY_HAND, PARTS)
    k_exact, v_exact = _exact(j, exact, table, kv_head, k_tail_ptr, v_tail_ptr, tables_ptr, stride_ks, stride_kh,
                              stride_vs, stride_vh, PAGE_SIZE, HEAD_DIM, BLOCK_D, PARTS)
    k = tl.where(recon[:, None], k, k_exact.to(tl.float32))
    v = tl.where(recon[:, None], v, v_exact.to(tl.float32))
    return k, v


# The index arrays are slices of a pass's arrays at any offset, and the split count follows
# the pass's longest context: neither is specialized, so a new length compiles no variant
# inside a request (`bench/compile_variants.py`); nor is `read_keys`' key count.
_INDEX_POINTERS = ["tables_ptr", "cell_ptr", "depth_ptr", "position_ptr", "table_offset_ptr", "tiles_ptr"]


@triton.jit(do_not_specialize=["keys"], do_not_specialize_on_alignment=_INDEX_POINTERS)
def _read_keys_kernel(
    k_tail_ptr, v_tail_ptr, tables_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr,
    seal_ptr, group_tables_ptr, row_maps_ptr, cell_ptr, depth_ptr, position_ptr, table_offset_ptr,
    k_out_ptr, v_out_ptr,
    stride_ks, stride_kh, stride_vs, stride_vh, num_kv_heads, max_groups, max_len, keys,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BF16_BY_HAND: tl.constexpr, GROUPS: tl.constexpr,
):
    """Per (row, KV head, block of keys): the attention kernel's gather, stored, zeros past
    the row's position (every output element is written: the outputs start empty). GROUPS:
    `_read_groups_kernel` wrote the blocks of the groups it takes (BLOCK_N divides 64),
    which are skipped here."""
    n = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    pos = tl.load(position_ptr + n).to(tl.int32)
    cell = tl.load(cell_ptr + n).to(tl.int64)
    depth = tl.load(depth_ptr + n).to(tl.int32)
    start = tl.program_id(2) * BLOCK_N
    todo = True
    if GROUPS:
        done, _r0, _r1, _r2, _r3 = _dense_sealed_group(cell, depth, pos, start // 64, keys, seal_ptr,
                                                       group_tables_ptr, row_maps_ptr, max_groups, max_len, PLANES)
        todo = done == 0
    if todo:
        j = start + tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        at = ((n * keys + j) * num_kv_heads + kv_head)[:, None] * HEAD_DIM + d[None, :]
        ok = (j < keys)[:, None] & (d < HEAD_DIM)[None, :]
        dtype = k_out_ptr.dtype.element_ty
        k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        v = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        if start <= pos:  # blocks past the row's position are zeros
            k, v = _key_block(
                j, (j <= pos) & (j < keys), cell, depth, pos, tl.load(table_offset_ptr + n).to(tl.int64), kv_head,
                k_tail_ptr, v_tail_ptr, tables_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr,
                v_lo_ptr, seal_ptr, group_tables_ptr, row_maps_ptr, stride_ks, stride_kh, stride_vs, stride_vh,
                num_kv_heads, max_groups, max_len, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, PLANES, V_GROUPS,
                BF16_BY_HAND)
        tl.store(k_out_ptr + at, k.to(dtype), mask=ok)
        tl.store(v_out_ptr + at, v.to(dtype), mask=ok)


@triton.jit
def _group_plane(ok, base, depth, g, last, group_tables_ptr, row_maps_ptr, max_groups, max_len, p: tl.constexpr,
                 PLANES: tl.constexpr):
    """(ok, record) of compact group g at plane p: ok stays set where the plane is past the
    depth or holds keys 64g..last (last = 64g + 63) densely (their row is their position,
    so every position before has a row) in a record."""
    rec = tl.zeros_like(g) - 1
    if p < PLANES:
        on = ok & (depth >= p)
        row = tl.load(row_maps_ptr + (base + p) * max_len + last, mask=on, other=-1)
        rec = tl.load(group_tables_ptr + (base + p) * max_groups + g, mask=on, other=-1)
        ok = ok & ((depth < p) | ((row == last) & (rec >= 0)))
    return ok, rec


@triton.jit
def _dense_sealed_group(cell, depth, pos, g, keys, seal_ptr, group_tables_ptr, row_maps_ptr, max_groups, max_len,
                        PLANES: tl.constexpr):
    """(ok, records at planes 0..3) of keys 64g..64g + 63: ok when all lie within the row's
    position and `keys`, every plane up to the depth holds them densely in one record, and
    the row is at or past the seal of the depth's record (the seal of every key of the
    group: its deepest row is at the depth), so the row reads all 64 reconstructed."""
    last = g * 64 + 63
    ok = (last <= pos) & (last < keys)
    base = cell * PLANES
    ok, r0 = _group_plane(ok, base, depth, g, last, group_tables_ptr, row_maps_ptr, max_groups, max_len, 0, PLANES)
    ok, r1 = _group_plane(ok, base, depth, g, last, group_tables_ptr, row_maps_ptr, max_groups, max_len, 1, PLANES)
    ok, r2 = _group_plane(ok, base, depth, g, last, group_tables_ptr, row_maps_ptr, max_groups, max_len, 2, PLANES)
    ok, r3 = _group_plane(ok, base, depth, g, last, group_tables_ptr, row_maps_ptr, max_groups, max_len, 3, PLANES)
    rec = tl.where(depth == 0, r0, tl.where(depth == 1, r1, tl.where(depth == 2, r2, r3)))
    seal = tl.load(seal_ptr + tl.where(ok, rec, 0), mask=ok, other=2147483647)
    return ok & (pos >= seal), r0, r1, r2, r3


@triton.jit
def _plane_record(r0, r1, r2, r3, p: tl.constexpr):
    if p == 0:
        return r0.to(tl.int64)
    elif p == 1:
        return r1.to(tl.int64)
    elif p == 2:
        return r2.to(tl.int64)
    else:
        return r3.to(tl.int64)


@triton.jit
def _add_nibbles(even, odd, byte, scale, lo, p: tl.constexpr, DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """Plane p's decode of the low (even) and high (odd) nibbles of `byte`, DTYPE(lo + scale
    * code) in fp32 (a product and an add, never fused), taken as plane 0's values or added
    and rounded to the planes before: `_plane_decode`'s arithmetic, so the same bits."""
    de = round_to(lo + scale * (byte & 0xF).to(tl.float32), DTYPE, BF16_BY_HAND)
    do = round_to(lo + scale * (byte >> 4).to(tl.float32), DTYPE, BF16_BY_HAND)
    if p == 0:
        return de, do
    return round_to(even + de, DTYPE, BF16_BY_HAND), round_to(odd + do, DTYPE, BF16_BY_HAND)


@triton.jit
def _group_k(n, g, kv_head, depth, r0, r1, r2, r3, k_codes_ptr, k_scale_ptr, k_lo_ptr, k_out_ptr, num_kv_heads, keys,
             HEAD_DIM: tl.constexpr, PLANES: tl.constexpr, BLOCK_D: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """K of a group: even and odd rows [32, BLOCK_D] (a code byte's two nibbles), one [D]
    scale and lo load a plane, stored."""
    dtype = k_out_ptr.dtype.element_ty
    i = tl.arange(0, 32)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    d_ok = d < HEAD_DIM
    even = tl.zeros([32, BLOCK_D], tl.float32)
    odd = tl.zeros([32, BLOCK_D], tl.float32)
    for p in tl.static_range(PLANES):
        if depth >= p:
            rec = _plane_record(r0, r1, r2, r3, p)
            byte = tl.load(k_codes_ptr + ((rec * 32 + i) * num_kv_heads + kv_head) * HEAD_DIM + d, mask=d_ok,
                           other=0).to(tl.int32)
            each = (rec * num_kv_heads + kv_head) * HEAD_DIM + d
            scale = tl.load(k_scale_ptr + each, mask=d_ok, other=0.0).to(tl.float32)
            lo = tl.load(k_lo_ptr + each, mask=d_ok, other=0.0).to(tl.float32)
            even, odd = _add_nibbles(even, odd, byte, scale, lo, p, dtype, BF16_BY_HAND)
    at = ((n * keys + g * 64 + 2 * i) * num_kv_heads + kv_head) * HEAD_DIM + d
    tl.store(k_out_ptr + at, even.to(dtype), mask=d_ok)
    tl.store(k_out_ptr + at + num_kv_heads * HEAD_DIM, odd.to(dtype), mask=d_ok)


@triton.jit
def _group_v(n, g, kv_head, depth, r0, r1, r2, r3, v_codes_ptr, v_scale_ptr, v_lo_ptr, v_out_ptr, num_kv_heads, keys,
             HEAD_DIM: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr, BLOCK_D: tl.constexpr,
             BF16_BY_HAND: tl.constexpr):
    """V of a group: channels 2c and 2c + 1 [64, BLOCK_D / 2] (a code byte's two nibbles),
    scale and lo per (row, 64 channels), stored interleaved back into channel order."""
    dtype = v_out_ptr.dtype.element_ty
    i = tl.arange(0, 64)[:, None]
    c = tl.arange(0, BLOCK_D // 2)[None, :]
    c_ok = c < HEAD_DIM // 2
    even = tl.zeros([64, BLOCK_D // 2], tl.float32)
    odd = tl.zeros([64, BLOCK_D // 2], tl.float32)
    for p in tl.static_range(PLANES):
        if depth >= p:
            vrow = (_plane_record(r0, r1, r2, r3, p) * 64 + i) * num_kv_heads + kv_head
            byte = tl.load(v_codes_ptr + vrow * (HEAD_DIM // 2) + c, mask=c_ok, other=0).to(tl.int32)
            meta = vrow * V_GROUPS + (2 * c) // 64
            scale = tl.load(v_scale_ptr + meta, mask=c_ok, other=0.0).to(tl.float32)
            lo = tl.load(v_lo_ptr + meta, mask=c_ok, other=0.0).to(tl.float32)
            even, odd = _add_nibbles(even, odd, byte, scale, lo, p, dtype, BF16_BY_HAND)
    d = tl.arange(0, BLOCK_D)[None, :]
    at = ((n * keys + g * 64 + i) * num_kv_heads + kv_head) * HEAD_DIM + d
    tl.store(v_out_ptr + at, tl.interleave(even, odd).to(dtype), mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["keys"], do_not_specialize_on_alignment=_INDEX_POINTERS)
def _read_groups_kernel(
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, cell_ptr, depth_ptr, position_ptr, k_out_ptr, v_out_ptr, num_kv_heads, max_groups, max_len, keys,
    HEAD_DIM: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr, BLOCK_D: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
):
    """`read_keys`'s group pass, per (row, KV head x K | V, 64-key group): a group the row
    reads whole and reconstructed from dense planes (`_dense_sealed_group`) is decoded
    straight from its records (`_group_k`, `_group_v`) with the gather's arithmetic
    (`_plane_decode`), so the same bits. Other groups are left to `_read_keys_kernel`,
    which skips these. (K and V bodies live in functions of their own: a compiled if/else
    must give the names both branches assign one shape.)"""
    n = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // 2
    g = tl.program_id(2)
    pos = tl.load(position_ptr + n).to(tl.int32)
    depth = tl.load(depth_ptr + n).to(tl.int32)
    ok, r0, r1, r2, r3 = _dense_sealed_group(tl.load(cell_ptr + n).to(tl.int64), depth, pos, g, keys, seal_ptr,
                                             group_tables_ptr, row_maps_ptr, max_groups, max_len, PLANES)
    if ok:
        if tl.program_id(1) % 2 == 0:
            _group_k(n, g, kv_head, depth, r0, r1, r2, r3, k_codes_ptr, k_scale_ptr, k_lo_ptr, k_out_ptr,
                     num_kv_heads, keys, HEAD_DIM, PLANES, BLOCK_D, BF16_BY_HAND)
        else:
            _group_v(n, g, kv_head, depth, r0, r1, r2, r3, v_codes_ptr, v_scale_ptr, v_lo_ptr, v_out_ptr,
                     num_kv_heads, keys, HEAD_DIM, PLANES, V_GROUPS, BLOCK_D, BF16_BY_HAND)


def _check(q_or_none: torch.Tensor | None, k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor,
           packed: PackedKV, rows: tuple[torch.Tensor, ...], dtypes: tuple[torch.dtype, ...] = DTYPES) -> None:
    _, num_kv_heads, head_dim = k_tail.shape
    assert k_tail.dtype in dtypes, f"packed attention takes {', '.join(map(str, dtypes))}, not {k_tail.dtype}"
    assert v_tail.shape == k_tail.shape and v_tail.dtype == k_tail.dtype, "K and V tails must be [S, Hkv, D] alike"
    assert k_tail.stride(2) == 1 and v_tail.stride(2) == 1, "the head dim must be contiguous"
    assert head_dim % 2 == 0, "the head dim must be even"
    if q_or_none is not None:
        q = q_or_none
        assert q.dim() == 3 and q.shape[2] == head_dim and q.stride(2) == 1, "q must be [N, Hq, D], D contiguous"
        assert q.dtype == k_tail.dtype, "q and the tails share the model dtype"
        assert q.shape[1] % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    ng = packed.seal.shape[0]
    v_groups = triton.cdiv(head_dim, GROUP)
    assert packed.k.codes.shape == (ng, PAIRS, num_kv_heads, head_dim), "k codes must be [NG, 32, Hkv, D]"
    assert packed.k.scale.shape == packed.k.lo.shape == (ng, num_kv_heads, head_dim), "k scale, lo: [NG, Hkv, D]"
    assert packed.v.codes.shape == (ng * GROUP, num_kv_heads, head_dim // 2), "v codes must be [NG * 64, Hkv, D / 2]"
    assert packed.v.scale.shape == packed.v.lo.shape == (ng * GROUP, num_kv_heads, v_groups), "v scale, lo shape"
    assert packed.group_tables.dim() == 3 and packed.row_maps.dim() == 3, "tables must be [C, P, *]"
    assert packed.group_tables.shape[:2] == packed.row_maps.shape[:2], "group tables and row maps: same cells, planes"
    assert 1 <= packed.planes <= MAX_PLANES, f"1 to {MAX_PLANES} planes, got {packed.planes}"
    for t in (packed.k.codes, packed.k.scale, packed.k.lo, packed.v.codes, packed.v.scale, packed.v.lo, packed.seal,
              packed.group_tables, packed.row_maps, tables, *rows):
        assert t.is_contiguous(), "packed records, tables and row vectors must be contiguous"
    n = rows[0].shape[0]
    assert all(r.shape == (n,) and not r.is_floating_point() for r in rows), "cell, depth, position, offset: [N] int"


def _common(k_tail: torch.Tensor, packed: PackedKV, page_size: int) -> dict:
    head_dim = k_tail.shape[2]
    return dict(PAGE_SIZE=page_size, HEAD_DIM=head_dim, PLANES=packed.planes,
                V_GROUPS=triton.cdiv(head_dim, GROUP), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                BF16_BY_HAND=_INTERPRET and k_tail.dtype == torch.bfloat16)


def _storage(k_tail, v_tail, tables, packed: PackedKV) -> tuple[torch.Tensor, ...]:
    return (k_tail, v_tail, tables, packed.k.codes, packed.k.scale, packed.k.lo, packed.v.codes, packed.v.scale,
            packed.v.lo, packed.seal, packed.group_tables, packed.row_maps)


def read_keys_triton(k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor, page_size: int,
                     packed: PackedKV, cell: torch.Tensor, depth: torch.Tensor, position: torch.Tensor,
                     table_offset: torch.Tensor, keys: int, *, groups: bool = True, group_warps: int = 8,
                     block_n: int = 32, num_warps: int = 4, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention kernel's gather (`_key_block`), stored: K and V [N, keys, Hkv, D].
    `groups`: whole groups a row reads reconstructed from dense planes go to a lean pass of
    their own first (`_read_groups_kernel`); the gather kernel takes the rest, `block_n`
    keys a program. Defaults: the best of bench/int4_prefill_sweep.py on the H200 (K and V
    in programs of their own, half the registers each, ran slower everywhere). `check`
    False skips the argument checks (about 40 us of Python), for a caller that checked the
    same shapes at its pass's first layer."""
    rows = (cell, depth, position, table_offset)
    if check:
        _check(None, k_tail, v_tail, tables, packed, rows)
    assert not groups or 64 % block_n == 0, "with the group pass, block_n divides 64"
    n = cell.shape[0]
    k_out = k_tail.new_empty(n, keys, *k_tail.shape[1:])
    v_out = torch.empty_like(k_out)
    if n == 0 or keys == 0:
        return k_out, v_out
    common = _common(k_tail, packed, page_size)
    heads = k_tail.shape[1]
    if groups and keys >= GROUP:
        _read_groups_kernel[(n, heads * 2, keys // GROUP)](
            packed.k.codes, packed.k.scale, packed.k.lo, packed.v.codes, packed.v.scale, packed.v.lo, packed.seal,
            packed.group_tables, packed.row_maps, cell, depth, position, k_out, v_out, heads,
            packed.group_tables.shape[2], packed.row_maps.shape[2], keys, HEAD_DIM=common["HEAD_DIM"],
            PLANES=common["PLANES"], V_GROUPS=common["V_GROUPS"], BLOCK_D=common["BLOCK_D"],
            BF16_BY_HAND=common["BF16_BY_HAND"], enable_fp_fusion=False, num_warps=group_warps)
    _read_keys_kernel[(n, heads, triton.cdiv(keys, block_n))](
        *_storage(k_tail, v_tail, tables, packed), *rows, k_out, v_out,
        k_tail.stride(0), k_tail.stride(1), v_tail.stride(0), v_tail.stride(1), heads,
        packed.group_tables.shape[2], packed.row_maps.shape[2], keys, BLOCK_N=block_n, GROUPS=groups,
        enable_fp_fusion=False, num_warps=num_warps, **common)
    return k_out, v_out


# --- torch references -----------------------------------------------------------------

def key_seals(packed: PackedKV, cell: int, depth: int, positions: torch.Tensor) -> torch.Tensor:
    """Seal [L] (int64) of keys `positions` at depth `depth` of `cell`: the seal of the record
    holding each key's deepest row at a plane <= depth; NEVER without one."""
    cells = torch.tensor([cell], device=positions.device)
    return packed_rows.seals(packed.seal, packed.group_tables, packed.row_maps, cells, depth, positions[None])[0]


def reconstruct_keys(packed: PackedKV, cell: int, depth: int, positions: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [L, Hkv, D] in `dtype` of keys `positions` of `cell` reconstructed at depth
    `depth` (`packed_rows.reconstruct`). Every key must have a plane-0 row, and every row a
    record."""
    cells = torch.tensor([cell], device=positions.device)
    for p in range(depth + 1):
        row, record = packed_rows.rows_records(packed.group_tables, packed.row_maps, cells, p, positions[None])
        assert bool(((row < 0) | (record >= 0)).all()), f"a row of plane {p} whose group has no record"
        assert p > 0 or bool((row >= 0).all()), "a key read reconstructed without a plane-0 row"
    k, v = packed_rows.reconstruct(packed.k, packed.v, packed.group_tables, packed.row_maps, cells, depth,
                                   positions[None], dtype)
    return k[0], v[0]


def row_keys(k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor, page_size: int, packed: PackedKV,
             cell: int, depth: int, position: int, table_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [position + 1, Hkv, D] as one query row reads them: reconstructed where
    position >= the key's seal, else exact from the tail (nothing else is indexed)."""
    j = torch.arange(position + 1, device=k_tail.device)
    sealed = position >= key_seals(packed, cell, depth, j)
    k = k_tail.new_empty(position + 1, *k_tail.shape[1:])
    v = torch.empty_like(k)
    exact = j[~sealed]
    slots = tables[table_offset + exact // page_size].long() * page_size + exact % page_size
    k[~sealed], v[~sealed] = k_tail[slots], v_tail[slots]
    if sealed.any():
        k[sealed], v[sealed] = reconstruct_keys(packed, cell, depth, j[sealed], k_tail.dtype)
    return k, v


def read_keys_reference(k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor, page_size: int,
                        packed: PackedKV, cell: torch.Tensor, depth: torch.Tensor, position: torch.Tensor,
                        table_offset: torch.Tensor, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`row_keys` of every row, K and V [N, keys, Hkv, D]: key j < keys where j <= the row's
    position, zeros elsewhere (and for padding rows)."""
    _check(None, k_tail, v_tail, tables, packed, (cell, depth, position, table_offset), REFERENCE_DTYPES)
    k_out = k_tail.new_zeros(cell.shape[0], keys, *k_tail.shape[1:])
    v_out = torch.zeros_like(k_out)
    for n, (c, d, pos, off) in enumerate(zip(cell.tolist(), depth.tolist(), position.tolist(), table_offset.tolist())):
        if pos >= 0:
            k, v = row_keys(k_tail, v_tail, tables, page_size, packed, c, d, pos, off)
            k_out[n, : k.shape[0]], v_out[n, : v.shape[0]] = k[:keys], v[:keys]
    return k_out, v_out


# --- dispatch -------------------------------------------------------------------------

def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    """Triton on CUDA tensors or under TRITON_INTERPRET=1 by default; the reference otherwise."""
    if use_triton is None:
        return x.is_cuda or _INTERPRET
    assert not use_triton or x.is_cuda or _INTERPRET, "Triton runs on CUDA tensors or under TRITON_INTERPRET=1"
    return use_triton


def read_keys(k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor, page_size: int, packed: PackedKV,
              cell: torch.Tensor, depth: torch.Tensor, position: torch.Tensor, table_offset: torch.Tensor, keys: int,
              use_triton: bool | None = None, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [N, keys, Hkv, D] in the tails' dtype as each row reads them (key j <= its
    position; zeros elsewhere). `check`: the Triton launch's argument checks (the
    reference always checks)."""
    if _use_triton(k_tail, use_triton):
        return read_keys_triton(k_tail, v_tail, tables, page_size, packed, cell, depth, position, table_offset,
                                keys, check=check)
    return read_keys_reference(k_tail, v_tail, tables, page_size, packed, cell, depth, position, table_offset, keys)
