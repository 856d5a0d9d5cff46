"""Sparse decode attention at loops >= 3 (the correction): each decode row reads only its
slot's kept keys at its own depth and corrects the result with what loop 2 saw of the rest,
in Triton, with its torch reference (`correction_reference`). The method, the state and
the budgets: `sparse_decode_common`.

- `decode_correction` (loops >= 3) writes out[i] = O_ref - C_ref + m * sum_S p V_r,
  rounded once to DT, for rows with a position >= 0 whose slot's count is > 0; every other
  row of `out` (the caller's dense output, corrected in place) is left untouched.

`_correction_kernel`, grid (N, Hkv, splits): for each head of the KV head, gathers K_r
and V_r of its split's share of the slot's kept keys through the row's depth-r page
table and runs an online softmax over them. With one split it writes
O_ref - C_ref + m * sum p V_r into out[i] in DT; with more (`correction_splits`: batch 1
would otherwise run 16 programs on 132 SMs) each split writes its max, sum and
unnormalised sum of p V to fp32 partials, and `_combine_kernel`, grid (N, Hq), merges
the splits that held keys and writes out[i].
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specloop.kernels.packed_keys import _key_block
from specloop.kernels.rounding import round_to
from specloop.kernels.sparse_decode_common import (
    Blocks, PackedRows, SlotState, _check, _num_sms, _per_head_kv, _row_slots, _shape, _split_share, _use_triton,
)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def correction_splits(rows: int, num_kv_heads: int, capacity: int, num_sms: int) -> int:
    """Programs per (row, KV head) of the correction, from static values only: eight waves
    of the GPU and at least one split per 256 kept keys of the capacity, no share under 64
    keys, at most 64 splits. Its gathers are bound by latency, not bandwidth, so more
    programs in flight pay past the two waves a bandwidth-bound kernel wants: at batch 1
    and 32K (capacity 3303; this rule gives 51) 32 and 64 splits took 30 and 24 us a call
    against 41 for the 17 of two waves, on the H200 with the layers' data cold in L2
    (bench/results/sparse_decode_kernels_cold_skew0_h200.json).
    Shares are cut on the device from each row's count, so splits past a short row's keys
    exit at once."""
    waves = -(-8 * num_sms // max(1, rows * num_kv_heads))
    return max(1, min(64, capacity // 64, max(waves, capacity // 256)))


# --- torch reference ------------------------------------------------------------------

def correction_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                         positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, *,
                         slots: torch.Tensor, state: SlotState, out: torch.Tensor,
                         dense_rows: torch.Tensor | None = None) -> None:
    """Loop >= 3 output row by row: out[i] = O_ref - C_ref + m * softmax(q . K[S] / sqrt(D)) V[S]
    in the state's dtype (at least fp32), rounded once to out's; rows with a negative
    position or a slot of count 0 are left untouched. A row set in `dense_rows` ([N] bool:
    its slot's state is missing) gets dense attention over its keys 0..pos instead and
    reads nothing of the state."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    acc = torch.promote_types(q.dtype, state.o_ref.dtype)
    for i in range(q.shape[0]):
        pos = int(positions[i])
        if pos < 0:
            continue
        slot = int(slots[i])
        full = dense_rows is not None and bool(dense_rows[i])
        b = pos + 1 if full else int(state.count[slot])
        if b == 0:
            continue
        keys = torch.arange(b, device=q.device).expand(num_heads, -1) if full else state.keys[slot, :, :b]
        kv = _row_slots(tables, int(table_offsets[i]), keys, page_size)  # [Hq, b]
        k = _per_head_kv(k_cache, kv, num_heads).to(acc)
        v = _per_head_kv(v_cache, kv, num_heads).to(acc)
        local = torch.einsum("hb,hbd->hd", (torch.einsum("hd,hbd->hb", q[i].to(acc), k) * head_dim ** -0.5)
                             .softmax(-1), v)
        if full:
            out[i] = local.to(out.dtype)
            continue
        o = state.o_ref[slot].to(acc) - state.c_ref[slot].to(acc) + state.mass[slot].to(acc)[:, None] * local
        out[i] = o.to(out.dtype)


# --- Triton kernels -------------------------------------------------------------------

@triton.jit
def _kept_block(start, keys_row, count, g_ok, table, kv_head, tables_ptr, cache_ptr, stride_s, stride_h, full,
                PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Kept keys start..start+BLOCK_N of each head (`keys_row` [G] pointers; every key in
    order when `full`; ok: a real entry [G, BLOCK_N]) and their rows of `cache` through the
    row's page table, fp32 [G, BLOCK_N, BLOCK_D]."""
    i = start + tl.arange(0, BLOCK_N)
    ok = g_ok[:, None] & (i[None, :] < count)
    kept = (i[None, :] * 0 + full.to(tl.int32)) == 0  # (a tensor: the interpreter cannot mask by a scalar)
    j = tl.load(keys_row[:, None] + i[None, :], mask=ok & kept, other=0)
    j = tl.where(full, i[None, :], j).to(tl.int64)
    page = tl.load(tables_ptr + table + j // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + j % PAGE_SIZE
    d = tl.arange(0, BLOCK_D)
    mask = ok[:, :, None] & (d < HEAD_DIM)[None, None, :]
    x = tl.load(cache_ptr + slot[:, :, None] * stride_s + kv_head * stride_h + d[None, None, :], mask=mask, other=0.0)
    return ok, x.to(tl.float32)


@triton.jit
def _kept_packed_block(
    start, keys_row, count, g_ok, full, pos, cell, depth, table, kv_head, k_tail_ptr, v_tail_ptr, tables_ptr,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, stride_ks, stride_kh, stride_vs, stride_vh, num_kv_heads, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    """`_kept_block` for K and V at once over INT4 residual planes: each head's kept keys
    (ok [G, BLOCK_N]) read as the row at `pos` reads them, fp32 [G, BLOCK_N, BLOCK_D] each.
    The heads' positions are gathered as one vector of G x BLOCK_N keys (`_key_block` works
    key by key, so the positions need not be contiguous)."""
    i = start + tl.arange(0, BLOCK_N)
    ok = g_ok[:, None] & (i[None, :] < count)
    kept = (i[None, :] * 0 + full.to(tl.int32)) == 0  # (a tensor: the interpreter cannot mask by a scalar)
    j = tl.load(keys_row[:, None] + i[None, :], mask=ok & kept, other=0)
    j = tl.where(full, i[None, :], j)
    k, v = _key_block(
        tl.reshape(j, [BLOCK_G * BLOCK_N]), tl.reshape(ok, [BLOCK_G * BLOCK_N]), cell, depth, pos, table, kv_head,
        k_tail_ptr, v_tail_ptr, tables_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr,
        seal_ptr, group_tables_ptr, row_maps_ptr, stride_ks, stride_kh, stride_vs, stride_vh, num_kv_heads,
        max_groups, max_len, PAGE_SIZE, HEAD_DIM, BLOCK_G * BLOCK_N, BLOCK_D, PLANES, V_GROUPS, BF16_BY_HAND)
    return ok, tl.reshape(k, [BLOCK_G, BLOCK_N, BLOCK_D]), tl.reshape(v, [BLOCK_G, BLOCK_N, BLOCK_D])


@triton.jit
def _correction_row(row, pos, slots_ptr, count_ptr, dense_rows_ptr, HAS_DENSE_ROWS: tl.constexpr):
    """A correction row's slot, whether it runs dense (its state missing) and its key count
    (the slot's b, or pos + 1 for a dense row)."""
    slot = tl.load(slots_ptr + row).to(tl.int64)
    full = pos < 0  # False, as a tensor
    if HAS_DENSE_ROWS:
        full = tl.load(dense_rows_ptr + row) != 0
    count = tl.where(full, pos + 1, tl.load(count_ptr + slot))  # (a decode slot: in bounds)
    return slot, full, count


@triton.jit
def _correction_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, positions_ptr, offsets_ptr, slots_ptr, keys_ptr, count_ptr, mass_ptr,
    o_ref_ptr, c_ref_ptr, out_ptr, part_ptr, stats_ptr, dense_rows_ptr, stride_qn, stride_qh, stride_ks, stride_kh,
    stride_vs, stride_vh, stride_on, stride_oh, num_heads, capacity, splits, scale,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, cell_ptr, depth_ptr, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BF16_BY_HAND: tl.constexpr, DIRECT: tl.constexpr,
    HAS_DENSE_ROWS: tl.constexpr, PACKED: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr,
):
    """Per (row, KV head, split): an online softmax of q_r . K_r over the split's share of
    each head's kept keys. DIRECT (one split): corrected by the slot's state into out (in
    place); otherwise the split's running max, sum and unnormalised sum of p V go to the
    partials for `_combine_kernel`. A dense row (`dense_rows`: its state is missing) runs
    over its keys 0..pos and reads nothing of the state. PACKED: k / v are INT4 residual
    planes' BF16 tails and each kept key is read as the row reads it, exact from the tail or
    reconstructed from the packed records (the packed reader's gather, `_key_block`)."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(positions_ptr + row)
    if pos >= 0:
        slot, full, count = _correction_row(row, pos, slots_ptr, count_ptr, dense_rows_ptr, HAS_DENSE_ROWS)
        if count > 0:
            lo, hi = _split_share(count, split, splits, BLOCK_N)
            table = tl.load(offsets_ptr + row).to(tl.int64)
            g = tl.arange(0, BLOCK_G)
            g_ok = g < GROUP
            head = kv_head * GROUP + g
            at = slot * num_heads + head
            keys_row = keys_ptr + at * capacity
            d = tl.arange(0, BLOCK_D)
            ok_gd = g_ok[:, None] & (d < HEAD_DIM)[None, :]
            q = tl.load(q_ptr + row * stride_qn + head[:, None] * stride_qh + d[None, :], mask=ok_gd, other=0.0)
            q = q.to(tl.float32)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            cell = row * 0
            depth = kv_head * 0
            if PACKED:
                cell = tl.load(cell_ptr + row).to(tl.int64)
                depth = tl.load(depth_ptr + row).to(tl.int32)
            for start in range(lo, hi, BLOCK_N):
                if PACKED:
                    ok, k, v = _kept_packed_block(
                        start, keys_row, hi, g_ok, full, pos.to(tl.int32), cell, depth, table, kv_head, k_ptr,
                        v_ptr, tables_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr,
                        seal_ptr, group_tables_ptr, row_maps_ptr, stride_ks, stride_kh, stride_vs, stride_vh,
                        num_heads // GROUP, max_groups, max_len, PAGE_SIZE, HEAD_DIM, BLOCK_G, BLOCK_N, BLOCK_D,
                        PLANES, V_GROUPS, BF16_BY_HAND)
                else:
                    ok, k = _kept_block(start, keys_row, hi, g_ok, table, kv_head, tables_ptr, k_ptr, stride_ks,
                                        stride_kh, full, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D)
                    _ok, v = _kept_block(start, keys_row, hi, g_ok, table, kv_head, tables_ptr, v_ptr, stride_vs,
                                         stride_vh, full, PAGE_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D)
                s = tl.sum(q[:, None, :] * k, axis=2) * scale  # [G, BLOCK_N], fp32 products
                s = tl.where(ok, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded heads see no key
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, axis=1)
                m_i = m_new
            if DIRECT:
                local = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
                _write_corrected(local, at, row, head, g_ok, ok_gd, d, full, mass_ptr, o_ref_ptr, c_ref_ptr, out_ptr,
                                 stride_on, stride_oh, HEAD_DIM, BF16_BY_HAND)
            else:
                part = (row * num_heads + head) * splits + split  # [G] partial rows
                tl.store(stats_ptr + part * 2, m_i, mask=g_ok)
                tl.store(stats_ptr + part * 2 + 1, l_i, mask=g_ok)
                tl.store(part_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=ok_gd)


@triton.jit
def _write_corrected(local, at, row, head, g_ok, ok_gd, d, full, mass_ptr, o_ref_ptr, c_ref_ptr, out_ptr,
                     stride_on, stride_oh, HEAD_DIM: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """out[row, head] = O_ref - C_ref + m * local (a dense row: local), rounded once to
    out's dtype."""
    vec = at[:, None] * HEAD_DIM + d[None, :]
    state = (at * 0 + full.to(tl.int32)) == 0  # [G] (a tensor: the interpreter cannot mask by a scalar)
    o_ref = tl.load(o_ref_ptr + vec, mask=ok_gd & state[:, None], other=0.0)
    c_ref = tl.load(c_ref_ptr + vec, mask=ok_gd & state[:, None], other=0.0)
    mass = tl.load(mass_ptr + at, mask=g_ok & state, other=1.0)
    o = round_to(o_ref - c_ref + mass[:, None] * local, out_ptr.dtype.element_ty, BF16_BY_HAND)
    tl.store(out_ptr + row * stride_on + head[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=ok_gd)


@triton.jit
def _combine_kernel(
    positions_ptr, slots_ptr, count_ptr, mass_ptr, o_ref_ptr, c_ref_ptr, out_ptr, part_ptr, stats_ptr,
    dense_rows_ptr, stride_on, stride_oh, num_heads, splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    BF16_BY_HAND: tl.constexpr, HAS_DENSE_ROWS: tl.constexpr,
):
    """Per (row, query head): merges the splits' partial softmaxes (splits whose share is
    empty wrote nothing and are skipped) and writes the corrected output."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(positions_ptr + row)
    if pos >= 0:
        slot, full, count = _correction_row(row, pos, slots_ptr, count_ptr, dense_rows_ptr, HAS_DENSE_ROWS)
        if count > 0:
            i = tl.arange(0, BLOCK_P)
            d = tl.arange(0, BLOCK_D)
            part = (row * num_heads + head) * splits + i
            first, _last = _split_share(count, i, splits, BLOCK_N)  # `_correction_kernel`'s shares
            ran = (i < splits) & (first < count)  # a split ran iff its share holds a kept key
            m = tl.load(stats_ptr + part * 2, mask=ran, other=float("-inf"))
            l = tl.load(stats_ptr + part * 2 + 1, mask=ran, other=0.0)
            acc = tl.load(part_ptr + part[:, None] * HEAD_DIM + d[None, :],
                          mask=ran[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
            top = tl.max(m, axis=0)
            w = tl.where(ran, tl.exp(m - top), 0.0)
            local = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
            at = slot * num_heads + head
            ok_d = d < HEAD_DIM
            _write_corrected(local[None, :], at + tl.zeros([1], tl.int64), row, head + tl.zeros([1], tl.int32),
                             tl.full([1], True, tl.int1), ok_d[None, :], d, full, mass_ptr, o_ref_ptr, c_ref_ptr,
                             out_ptr, stride_on, stride_oh, HEAD_DIM, BF16_BY_HAND)


# --- launcher -------------------------------------------------------------------------

def correction_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                      positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, *,
                      slots: torch.Tensor, state: SlotState, out: torch.Tensor, blocks: Blocks = Blocks(),
                      dense_rows: torch.Tensor | None = None, packed: PackedRows | None = None) -> None:
    """Loop >= 3 outputs into `out` in place: programs per (row, KV head, split) over shares
    of the slot's kept keys (a `dense_rows` row: of its keys 0..pos), then (more than one
    split) a combine per (row, query head); no host sync, a fixed launch sequence for fixed
    shapes. `packed`: the caches are INT4 residual planes' tails (`PackedRows`)."""
    _check(q, k_cache, v_cache, tables, positions, table_offsets, slots, state)
    n, num_heads, head_dim = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, "out: [N, Hq, D] in q's dtype"
    if n == 0:
        return
    shape = _shape(num_heads, k_cache, page_size)
    capacity = state.keys.shape[2]
    splits = blocks.correction_splits or correction_splits(n, k_cache.shape[1], capacity, _num_sms(q.device))
    direct = splits == 1
    part = q.new_empty((1 if direct else n * num_heads * splits, head_dim), dtype=torch.float32)
    stats = q.new_empty((1 if direct else n * num_heads * splits, 2), dtype=torch.float32)
    by_hand = _INTERPRET and q.dtype == torch.bfloat16
    has_dense = dense_rows is not None
    if has_dense:
        assert dense_rows.shape == (n,) and dense_rows.is_contiguous(), "dense_rows: [N]"
        dense_rows = dense_rows.view(torch.uint8) if dense_rows.dtype == torch.bool else dense_rows
    planes, extra = packed.kernel_args(n, head_dim) if packed is not None else PackedRows.no_args(positions)
    _correction_kernel[(n, k_cache.shape[1], splits)](
        q, k_cache, v_cache, tables, positions, table_offsets, slots, state.keys, state.count, state.mass,
        state.o_ref, state.c_ref, out, part, stats, dense_rows if has_dense else positions, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        num_heads, capacity, splits, head_dim ** -0.5, *planes, BLOCK_G=triton.next_power_of_2(shape["GROUP"]),
        BLOCK_N=blocks.correction, BF16_BY_HAND=by_hand, DIRECT=direct, HAS_DENSE_ROWS=has_dense, **shape, **extra,
    )
    if not direct:
        _combine_kernel[(n, num_heads)](
            positions, slots, state.count, state.mass, state.o_ref, state.c_ref, out, part, stats,
            dense_rows if has_dense else positions, out.stride(0), out.stride(1), num_heads, splits,
            HEAD_DIM=head_dim, BLOCK_D=shape["BLOCK_D"], BLOCK_N=blocks.correction,
            BLOCK_P=triton.next_power_of_2(splits), BF16_BY_HAND=by_hand, HAS_DENSE_ROWS=has_dense,
        )


# --- dispatch -------------------------------------------------------------------------

def decode_correction(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                      positions: torch.Tensor, table_offsets: torch.Tensor, page_size: int, *,
                      slots: torch.Tensor, state: SlotState, out: torch.Tensor,
                      use_triton: bool | None = None, dense_rows: torch.Tensor | None = None,
                      packed: PackedRows | None = None) -> None:
    """Loop >= 3 outputs of the rows from their slots' state, into `out` in place (module
    docstring); rows set in `dense_rows` ([N] bool: a missing state) get dense attention
    over their keys 0..pos at that depth instead. `packed`: the caches and tables are INT4
    residual planes' tails, and each key is read as the row reads it (`PackedRows`)."""
    if _use_triton(q, use_triton):
        correction_triton(q, k_cache, v_cache, tables, positions, table_offsets, page_size, slots=slots, state=state,
                          out=out, dense_rows=dense_rows, packed=packed)
        return
    if packed is not None:  # the reference reads the rows' keys into a paged copy first
        k_cache, v_cache, tables, table_offsets, page_size = packed.gather(k_cache, v_cache, tables, positions,
                                                                           table_offsets, page_size)
    correction_reference(q, k_cache, v_cache, tables, positions, table_offsets, page_size, slots=slots, state=state,
                         out=out, dense_rows=dense_rows)
