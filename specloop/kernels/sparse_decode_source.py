"""Sparse decode attention at loop 2 (the source): each decode row's state from its scores,
in Triton (the scores kernel here, then the select of `sparse_decode_select` or
`sparse_decode_split_select`), with the torch reference of the whole step
(`source_reference`). The method, the state and the budgets: `sparse_decode_common`.

- `decode_source` (loop 2) writes, for each non-padding row, its slot's keys[:, :b], count,
  mass, c_ref and o_ref = dense[i] in fp32. `dense` [N, Hq, D] in DT is the rows' loop-2
  attention, which the caller's dense kernel has already computed: the source adds no
  output of its own. max_context is a static bound > every position: it sizes the scratch
  (positions at or past it are a caller error; the kernels clamp them to stay in bounds).
- `decode_select` (Triton only) is `decode_source` without its scores kernel: the dense
  launch kept the rows' scores and lse (`paged_attention(..., scores=, score_rows=)` or
  `packed_attention`'s), and it runs the select alone, one program per (row, query head) or
  split (`select_splits`).

Kernels (Triton), per chunk of rows (`scratch` [R, Hq, >= max_context] fp32 holds R rows'
scores; the host loops over the N rows R at a time, both kernels per chunk):

1. `_scores_kernel`, grid (R, Hkv, splits): each program takes an equal share of its row's
   keys 0..pos (the share is computed on the device from the position), loads K blocks
   through the page table once for the KV head's GQA query heads (the M dimension, padded
   to 16 for `tl.dot`) and stores s = q . k * D^-0.5 in fp32 into the scratch. No V, no
   softmax. `score_splits` picks the splits from static values (rows, Hkv, max_context, SM
   count; two waves of the GPU, shares of at least 256 keys): batch 1 at 32K keys with 16 KV
   heads on the H200's 132 SMs gets 17 splits, batch 32 gets 1.
2. `_select_kernel` (`sparse_decode_select`) over the chunk's scratch rows.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specloop.kernels.packed_keys import _key_block
from specloop.kernels.paged_attention import choose_splits
from specloop.kernels.sparse_decode_common import (
    Blocks, PackedRows, SlotState, _check, _num_sms, _per_head_kv, _row_slots, _shape, _split_share, _use_triton,
    check_capacity, key_budget,
)
from specloop.kernels.sparse_decode_select import _launch_select
from specloop.kernels.sparse_decode_split_select import _launch_split_select, select_splits

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SCRATCH_BYTES = 256 << 20  # the scratch a source allocates when it is given none


def scratch_keys(max_context: int) -> int:
    """A scores scratch row's length: max_context rounded up to 16 keys, so the scratch's
    strides are the same multiples of 16 at every context (one kernel variant)."""
    return -(-max_context // 16) * 16


def scratch_rows(num_heads: int, max_context: int, budget_bytes: int) -> int:
    """Rows of a [rows, Hq, scratch_keys(max_context)] fp32 scores scratch that fit in
    budget_bytes (at least one): a source runs its rows in chunks of that many."""
    return max(1, budget_bytes // (num_heads * scratch_keys(max_context) * 4))


def score_splits(rows: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Programs per (row, KV head) of the scores kernel, from static values only: enough for
    two waves of the GPU, no share under 256 keys (`paged_attention.choose_splits`); batch 1
    at 32K keys and 16 KV heads on 132 SMs gets 17."""
    return choose_splits(rows, num_kv_heads, max_context, num_sms)


# --- torch reference ------------------------------------------------------------------

def source_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, key_retention: float,
                     *, dense: torch.Tensor, slots: torch.Tensor, state: SlotState,
                     max_context: int | None = None) -> None:
    """Loop-2 state row by row in plain PyTorch (fp32 math, fp64 for fp64 inputs): the top-b
    keys of each head by a stable descending sort of P, stored in ascending position order.
    Raises ValueError when a row's budget exceeds the capacity or its position reaches
    max_context."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    capacity = state.keys.shape[2]
    for i in range(q.shape[0]):
        pos = int(positions[i])
        if pos < 0:
            continue
        if max_context is not None and pos >= max_context:
            raise ValueError(f"row {i} at position {pos} is past max_context {max_context}")
        b = key_budget(pos + 1, key_retention)
        if b > capacity:
            raise ValueError(f"capacity {capacity} is below row {i}'s key budget {b} (position {pos})")
        j = torch.arange(pos + 1, device=q.device).expand(num_heads, -1)  # [Hq, n]
        kv = _row_slots(tables, int(table_offsets[i]), j, page_size)
        k = _per_head_kv(k_cache, kv, num_heads).to(acc)  # [Hq, n, D]
        v = _per_head_kv(v_cache, kv, num_heads).to(acc)
        probs = (torch.einsum("hd,hnd->hn", q[i].to(acc), k) * head_dim ** -0.5).softmax(-1)
        top = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :b]  # ties: lower first
        kept = top.sort(-1).values  # [Hq, b], ascending positions
        p = probs.gather(-1, kept)
        slot = int(slots[i])
        state.keys[slot, :, :b] = kept.to(torch.int32)
        state.count[slot] = b
        state.mass[slot] = p.sum(-1)
        state.c_ref[slot] = torch.einsum("hb,hbd->hd", p, v.gather(1, kept[..., None].expand(-1, -1, head_dim)))
        state.o_ref[slot] = dense[i]


# --- Triton kernels -------------------------------------------------------------------
# `max_context` is not specialized: an eager pass passes its own longest context, and a
# new divisibility by 16 would compile a new variant inside a request
# (`bench/compile_variants.py`); the scratch's strides stay multiples of 16 instead
# (`scratch_keys`).

@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit(do_not_specialize=["max_context"])
def _scores_kernel(
    q_ptr, k_ptr, tables_ptr, positions_ptr, offsets_ptr, scratch_ptr,
    first, stride_qn, stride_qh, stride_ks, stride_kh, stride_xr, stride_xh, max_context, splits, scale,
    v_ptr, stride_vs, stride_vh, num_kv_heads,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, cell_ptr, depth_ptr, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
    PACKED: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    """Per (row of the chunk, KV head, split): s = q . k * D^-0.5 (fp32) of the split's share
    of keys 0..pos, for the KV head's query heads, into the scratch. PACKED: k (and v) are
    INT4 residual planes' tails and each key is read as the row reads it (`_key_block`)."""
    r = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = first + r
    pos = tl.load(positions_ptr + row).to(tl.int64)
    if pos >= 0:
        lo, hi = _split_share(tl.minimum(pos + 1, max_context), split, splits, BLOCK_N)
        table = tl.load(offsets_ptr + row).to(tl.int64)
        g = tl.arange(0, BLOCK_M)
        g_ok = g < GROUP
        head = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + row * stride_qn + head[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        at = r * stride_xr + head * stride_xh  # each head's scratch row
        cell = row * 0
        depth = kv_head * 0
        if PACKED:
            cell = tl.load(cell_ptr + row).to(tl.int64)
            depth = tl.load(depth_ptr + row).to(tl.int32)
        for start in range(lo, hi, BLOCK_N):
            # One block of keys through the page table, shared by the KV head's query heads.
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < hi
            if PACKED:
                k, _v = _key_block(
                    j, j_ok, cell, depth, pos.to(tl.int32), table, kv_head, k_ptr, v_ptr, tables_ptr, k_codes_ptr,
                    k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
                    row_maps_ptr, stride_ks, stride_kh, stride_vs, stride_vh, num_kv_heads, max_groups, max_len,
                    PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, PLANES, V_GROUPS, BF16_BY_HAND, 1)  # K alone
                k = k.to(q_ptr.dtype.element_ty)  # fp32 holding the dtype's values: exact
            else:
                page = tl.load(tables_ptr + table + j // PAGE_SIZE, mask=j_ok, other=0).to(tl.int64)
                slot = page * PAGE_SIZE + j % PAGE_SIZE
                k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                            mask=j_ok[:, None] & d_ok[None, :], other=0.0)
            s = _dot(q, tl.trans(k), DOT_FP32) * scale
            tl.store(scratch_ptr + at[:, None] + j[None, :], s, mask=g_ok[:, None] & j_ok[None, :])


# --- launchers ------------------------------------------------------------------------

def source_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, key_retention: float,
                  *, dense: torch.Tensor, slots: torch.Tensor, state: SlotState, max_context: int,
                  scratch: torch.Tensor | None = None, blocks: Blocks = Blocks(),
                  packed: PackedRows | None = None) -> None:
    """Loop-2 state on the device: per chunk of scratch rows, the scores kernel then the
    select kernel; no host sync, a fixed launch sequence for fixed shapes (CUDA graphs).
    max_context (static, > every position) bounds the keys and the budgets that the state's
    capacity must cover (checked here from Python ints). `packed`: the caches are INT4
    residual planes' tails (`PackedRows`)."""
    _check(q, k_cache, v_cache, tables, positions, table_offsets, slots, state)
    n, num_heads, head_dim = q.shape
    capacity = state.keys.shape[2]
    check_capacity(max_context, key_retention, capacity)
    assert dense.shape == q.shape and dense.dtype == q.dtype and dense.stride(2) == 1, "dense: [N, Hq, D] in q's dtype"
    _check_blocks(blocks)
    if n == 0:
        return
    if scratch is None:
        rows = min(n, scratch_rows(num_heads, max_context, SCRATCH_BYTES))
        scratch = torch.empty(rows, num_heads, scratch_keys(max_context), dtype=torch.float32, device=q.device)
    assert (scratch.dtype == torch.float32 and scratch.dim() == 3 and scratch.shape[1] == num_heads
            and scratch.shape[2] >= max_context and scratch.stride(2) == 1), "scratch: fp32 [rows, Hq, >= max_context]"
    chunk = scratch.shape[0]
    splits = blocks.splits or score_splits(min(n, chunk), k_cache.shape[1], max_context, _num_sms(q.device))
    for first in range(0, n, chunk):
        rows = min(chunk, n - first)
        _launch_scores(q, k_cache, v_cache, tables, positions, table_offsets, page_size, scratch, first, rows,
                       max_context, splits, blocks, packed)
        _launch_select(v_cache, tables, positions, table_offsets, page_size, key_retention, dense, slots, state,
                       scratch, first, rows, max_context, blocks, k_cache=k_cache, packed=packed)


def decode_select(v_cache: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                  table_offsets: torch.Tensor, page_size: int, key_retention: float, *, dense: torch.Tensor,
                  lse: torch.Tensor, scores: torch.Tensor, slots: torch.Tensor, state: SlotState,
                  max_context: int, blocks: Blocks = Blocks(), k_cache: torch.Tensor | None = None,
                  packed: PackedRows | None = None) -> None:
    """Loop-2 state from a dense launch that kept the rows' scores and lse (Triton only):
    `paged_attention(..., scores=scores, score_rows=..., return_lse=True)` (or
    `packed_attention`'s) stored row i's scaled scores in scores[i] (i-th row here) and gave
    `lse` [N, Hq] and `dense`; this runs the select kernel alone, which is `decode_source`
    without its scores kernel and lse pass. scores [>= N, Hq, >= max_context] fp32; the rest
    as `decode_source`. `packed` (with the K tail `k_cache`): V of the kept keys from INT4
    residual planes, as each row reads it."""
    n, num_heads, head_dim = dense.shape
    assert positions.shape == table_offsets.shape == slots.shape == (n,), "positions, table offsets, slots: [N]"
    assert lse.shape == (n, num_heads) and lse.dtype == torch.float32 and lse.stride(1) == 1, "lse: fp32 [N, Hq]"
    assert (scores.dtype == torch.float32 and scores.dim() == 3 and scores.shape[0] >= n
            and scores.shape[1] == num_heads and scores.shape[2] >= max_context and scores.stride(2) == 1), (
        "scores: fp32 [>= N, Hq, >= max_context]")
    assert dense.stride(2) == 1 and v_cache.stride(2) == 1, "the head dim must be contiguous"
    check_capacity(max_context, key_retention, state.keys.shape[2])
    _check_blocks(blocks)
    if n == 0:
        return
    splits = blocks.select_splits or select_splits(n, num_heads, max_context, _num_sms(dense.device),
                                                   blocks.split_select)
    if splits == 1:
        _launch_select(v_cache, tables, positions, table_offsets, page_size, key_retention, dense, slots, state,
                       scores, 0, n, max_context, blocks, lse=lse, k_cache=k_cache, packed=packed)
    else:
        _launch_split_select(v_cache, tables, positions, table_offsets, page_size, key_retention, dense, lse,
                             scores, slots, state, max_context, splits, blocks, k_cache, packed)


def _check_blocks(blocks: Blocks) -> None:
    assert 16 <= blocks.scores and 32 <= min(blocks.select, blocks.split_select) and max(
        blocks.select, blocks.split_select) <= 1 << 15, (
        "scores blocks feed tl.dot; select blocks count in 16 bits and hold at least a warp's 32 keys (Triton "
        "3.6 on the H200 miscounted 16-key blocks)")


def _launch_scores(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                   positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, scratch: torch.Tensor,
                   first: int, rows: int, max_context: int, splits: int, blocks: Blocks,
                   packed: PackedRows | None = None) -> None:
    """The scores kernel over rows first..first+rows-1 into scratch rows 0..rows-1."""
    shape = _shape(q.shape[1], k_cache, page_size)
    planes, extra = (packed.kernel_args(q.shape[0], q.shape[2]) if packed is not None
                     else PackedRows.no_args(positions))
    _scores_kernel[(rows, k_cache.shape[1], splits)](
        q, k_cache, tables, positions, table_offsets, scratch,
        first, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), scratch.stride(0), scratch.stride(1),
        max_context, splits, q.shape[2] ** -0.5, v_cache, v_cache.stride(0), v_cache.stride(1), k_cache.shape[1],
        *planes, BLOCK_M=max(16, triton.next_power_of_2(shape["GROUP"])), BLOCK_N=blocks.scores,
        DOT_FP32=_INTERPRET or q.dtype == torch.float32, BF16_BY_HAND=_INTERPRET and q.dtype == torch.bfloat16,
        **shape, **extra,
    )


# --- dispatch -------------------------------------------------------------------------

def decode_source(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, key_retention: float, *,
                  dense: torch.Tensor, slots: torch.Tensor, state: SlotState, max_context: int,
                  scratch: torch.Tensor | None = None, use_triton: bool | None = None,
                  packed: PackedRows | None = None) -> None:
    """Loop-2 state of the rows into their slots (module docstring); checks the capacity
    against max_context on the host from Python ints before either implementation runs.
    `packed`: the caches and tables are INT4 residual planes' tails, and each key is read
    as the row reads it (`PackedRows`)."""
    check_capacity(max_context, key_retention, state.keys.shape[2])
    if _use_triton(q, use_triton):
        source_triton(q, k_cache, v_cache, tables, positions, table_offsets, page_size, key_retention, dense=dense,
                      slots=slots, state=state, max_context=max_context, scratch=scratch, packed=packed)
        return
    if packed is not None:  # the reference reads the rows' keys into a paged copy first
        k_cache, v_cache, tables, table_offsets, page_size = packed.gather(k_cache, v_cache, tables, positions,
                                                                           table_offsets, page_size)
    source_reference(q, k_cache, v_cache, tables, positions, table_offsets, page_size, key_retention, dense=dense,
                     slots=slots, state=state, max_context=max_context)
