"""Sparse decode attention: loop 2's exact top-b select, one program per (row, query head)
over the row's scores (`_select_kernel`, launched by `sparse_decode_source`), with the
helpers the split select (`sparse_decode_split_select`) shares: the probabilities' bits,
one digit of the radix select, the compacted write of the kept keys, their sums and the
slot's state. Its torch reference is the source's (`sparse_decode_source.source_reference`,
selection and sums in one); the method and the state: `sparse_decode_common`.

`_select_kernel`, grid (R, Hq), one program per (row, query head) over its scratch row:
pass 1: lse (a running max and sum per lane; `decode_select` takes the dense launch's
lse instead and skips this pass, its scores having been stored by that launch); P = exp(s - lse), recomputed by the same
expression in every later pass. P is a nonnegative fp32 below 2, so its bits, as int32,
order like its values and fit in 30 bits. A radix select over those bits, most
significant digit first (8-bit digits: 4 passes of `tl.histogram` with a mask, each
counting only the keys whose higher digits match the prefix found so far), finds the
b-th largest pattern T and `need`, how many keys equal to T belong to the top b. A last
pass in key order keeps P > T and the first `need` keys with P == T (one `tl.cumsum` of
both counts, with running offsets across blocks) and writes their positions compacted,
ascending, to the slot's keys; then a loop over those b positions sums m and C_ref with V
gathered through the page table (only the kept keys are loaded). It writes count, mass,
c_ref and o_ref (dense copied to fp32).

Why the selection is exact. The kept set is defined by values only: every key with P > T
and the lowest-positioned keys with P == T, T being the b-th largest P. That is the set of
the first b keys of a stable descending sort of P (`flashloop_reference.top_positions`), so
no tie-breaking is left to the hardware or to block boundaries. Every pass computes P by
one expression, so the histograms and the final pass see the same bits. Selection is thus
exact with respect to the P the kernel computed; it equals the reference's whenever the
kernel's and the reference's P agree in order at the boundary, i.e. unless the b-th and
(b+1)-th probabilities differ by about fp32 rounding (the tests state the gap they
require). Keys with equal scores get equal P on both sides, so exact ties break alike.

Not done: the one-program select has Hq
programs per row, so at batch 1 it runs on 16 of 132 SMs, its passes bound by latency
(lse could come from the scores kernel, one pass fewer, and the V gather is not
software-pipelined); block sizes and warps are barely measured on the H200 (`Blocks`;
bench/sparse_decode_kernels.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specloop.kernels.packed_keys import _key_block
from specloop.kernels.sparse_decode_common import Blocks, PackedRows, SlotState, _shape, retention_fraction

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
PATTERN_BITS = 30  # P < 2, so the bits of a nonnegative fp32 P fit in 30 bits
_PATTERN_BITS = tl.constexpr(PATTERN_BITS)


# --- Triton kernels -------------------------------------------------------------------
# `max_context` is not specialized (`sparse_decode_source`).

@triton.jit
def _probs(x_row, j, ok, lse):
    """P = exp(s - lse) of keys j of a scratch row (0 where not ok) and its bits as int32:
    P is a nonnegative fp32 below 2, so its bits order like its values and fit in 30 bits.
    Every pass computes P by this one expression, so every pass sees the same bits."""
    p = tl.exp(tl.load(x_row + j, mask=ok, other=float("-inf")) - lse)
    return p, p.to(tl.int32, bitcast=True)


@triton.jit
def _prob_bits(x_row, j, ok, lse):
    """`_probs`'s bits alone (no throwaway name: Triton carries `_` through loops as a
    variable, and its type may not change from one assignment to the next)."""
    p, bits = _probs(x_row, j, ok, lse)
    return bits


@triton.jit
def _row_lse(x_row, n, BLOCK_S: tl.constexpr):
    """log sum_j exp(s_j) over keys 0..n-1 of a scratch row (a running max and sum per lane)."""
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_S], tl.float32)
    for start in range(0, n, BLOCK_S):
        j = start + tl.arange(0, BLOCK_S)
        s = tl.load(x_row + j, mask=j < n, other=float("-inf"))
        m_new = tl.maximum(m, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane that has seen no key yet
        l = l * tl.exp(m - m_safe) + tl.exp(s - m_safe)
        m = m_new
    top = tl.max(m, axis=0)  # key 0 exists: finite
    return top + tl.log(tl.sum(l * tl.exp(m - top), axis=0))


@triton.jit
def _radix_select(x_row, n, lse, b, BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr):
    """The b-th largest P bit pattern T of keys 0..n-1 and `need`, how many keys equal to T
    are among the top b (1 <= need <= their count): one histogram pass per digit, most
    significant first, over the keys whose higher digits match T's."""
    BINS: tl.constexpr = 1 << RADIX_BITS
    DIGITS: tl.constexpr = (_PATTERN_BITS + RADIX_BITS - 1) // RADIX_BITS
    bins = tl.arange(0, BINS)
    need = b  # rank of T among the keys that match the prefix found so far
    prefix = b * 0
    for digit in tl.static_range(DIGITS):
        shift = (DIGITS - 1 - digit) * RADIX_BITS
        hist = tl.zeros([BINS], tl.int32)
        for start in range(0, n, BLOCK_S):
            j = start + tl.arange(0, BLOCK_S)
            ok = j < n
            x = _prob_bits(x_row, j, ok, lse)
            if digit > 0:
                ok = ok & ((x >> (shift + RADIX_BITS)) == (prefix >> (shift + RADIX_BITS)))
            hist += tl.histogram((x >> shift) & (BINS - 1), BINS, mask=ok)
        prefix, need = _digit_step(hist, bins, prefix, need, shift)
    return prefix, need


@triton.jit
def _digit_step(hist, bins, prefix, need, shift):
    """One digit of the radix select: from the digit's histogram over the keys matching
    the prefix so far, the digit of the need-th largest and its rank among the keys that
    share it."""
    at_least = tl.cumsum(hist, axis=0, reverse=True)  # keys whose digit is >= each bin
    value = tl.max(tl.where(at_least >= need, bins, 0), axis=0)  # the digit of the need-th
    need -= tl.sum(tl.where(bins == value, at_least - hist, 0), axis=0)  # minus those above it
    return prefix | (value << shift), need


@triton.jit
def _write_kept(x_row, keys_row, n, lse, threshold, need, b, BLOCK_S: tl.constexpr):
    """Keys 0..n-1 in order: keep P > T and the first `need` keys with P == T; write their
    positions compacted (ascending) to keys_row[0..b)."""
    _write_kept_range(x_row, keys_row, 0, n, lse, threshold, need, b, b * 0, b * 0, BLOCK_S)


@triton.jit
def _write_kept_range(x_row, keys_row, lo, hi, lse, threshold, need, b, kept, ties, BLOCK_S: tl.constexpr):
    """`_write_kept` over keys lo..hi-1, given `kept` keys kept and `ties` keys equal to T
    seen before lo; returns the kept count after hi."""
    for start in range(lo, hi, BLOCK_S):
        j = start + tl.arange(0, BLOCK_S)
        ok = j < hi
        x = _prob_bits(x_row, j, ok, lse)
        above = (ok & (x > threshold)).to(tl.int32)
        tie = (ok & (x == threshold)).to(tl.int32)
        # One scan for both counts: ties in the low 16 bits, keys above T in the high ones.
        packed = tie | (above << 16)
        both = tl.cumsum(packed, axis=0) - packed  # exclusive
        ties_before = both & 0xFFFF
        tie_ok = tie * ((ties + ties_before) < need).to(tl.int32)
        at = kept + (both >> 16) + tl.minimum(ties_before, tl.maximum(need - ties, 0))
        keep = (above | tie_ok) != 0
        tl.store(keys_row + at, j.to(tl.int32), mask=keep & (at < b))
        kept += tl.sum(above | tie_ok, axis=0)
        ties += tl.sum(tie, axis=0)
    return kept


@triton.jit
def _kept_sums(x_row, keys_row, v_ptr, tables_ptr, table, kv_head, stride_vs, stride_vh, n, lse, b,
               PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
               first=0):
    """m = sum P and C_ref = sum P V over kept entries first..b-1 (all b by default; V
    through the page table)."""
    d = tl.arange(0, BLOCK_D)
    mass = tl.zeros([BLOCK_V], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(first, b, BLOCK_V):
        i = start + tl.arange(0, BLOCK_V)
        ok = i < b
        j = tl.load(keys_row + i, mask=ok, other=0, cache_modifier=".cg")  # written by this program
        j = tl.where((j >= 0) & (j < n), j, 0).to(tl.int64)  # in bounds even for NaN scores
        p, _bits = _probs(x_row, j, ok, lse)
        page = tl.load(tables_ptr + table + j // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + j % PAGE_SIZE
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                    mask=ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        mass += p
        acc += tl.sum(p[:, None] * v.to(tl.float32), axis=0)
    return tl.sum(mass, axis=0), acc


@triton.jit
def _kept_sums_packed(
    x_row, keys_row, n, lse, b, pos, cell, depth, table, kv_head, k_tail_ptr, v_tail_ptr, tables_ptr,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, stride_ks, stride_kh, stride_vs, stride_vh, num_kv_heads, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    PLANES: tl.constexpr, V_GROUPS: tl.constexpr, BF16_BY_HAND: tl.constexpr, first=0,
):
    """`_kept_sums` over INT4 residual planes: V of each kept key as the row at `pos` reads
    it (`_key_block`)."""
    mass = tl.zeros([BLOCK_V], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(first, b, BLOCK_V):
        i = start + tl.arange(0, BLOCK_V)
        ok = i < b
        j = tl.load(keys_row + i, mask=ok, other=0, cache_modifier=".cg")  # written by this program
        j = tl.where((j >= 0) & (j < n), j, 0)  # in bounds even for NaN scores
        p, _bits = _probs(x_row, j.to(tl.int64), ok, lse)
        _k, v = _key_block(
            j, ok, cell, depth, pos, table, kv_head, k_tail_ptr, v_tail_ptr, tables_ptr, k_codes_ptr, k_scale_ptr,
            k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr, row_maps_ptr, stride_ks,
            stride_kh, stride_vs, stride_vh, num_kv_heads, max_groups, max_len, PAGE_SIZE, HEAD_DIM, BLOCK_V,
            BLOCK_D, PLANES, V_GROUPS, BF16_BY_HAND, 2)  # V alone
        mass += p
        acc += tl.sum(p[:, None] * v, axis=0)
    return tl.sum(mass, axis=0), acc


@triton.jit
def _store_state(dense_ptr, row, head, stride_dn, stride_dh, slot, at, b, mass, c_ref, count_ptr, mass_ptr,
                 o_ref_ptr, c_ref_ptr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (row, head)'s state into its slot: O_ref = the dense output in fp32, C_ref, m, and
    (head 0) the count b."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    dense = tl.load(dense_ptr + row * stride_dn + head * stride_dh + d, mask=d_ok, other=0.0)
    tl.store(o_ref_ptr + at * HEAD_DIM + d, dense.to(tl.float32), mask=d_ok)
    tl.store(c_ref_ptr + at * HEAD_DIM + d, c_ref, mask=d_ok)
    tl.store(mass_ptr + at, mass)
    if head == 0:
        tl.store(count_ptr + slot, b)


@triton.jit(do_not_specialize=["max_context"])
def _select_kernel(
    scratch_ptr, v_ptr, tables_ptr, positions_ptr, offsets_ptr, slots_ptr, dense_ptr, lse_ptr,
    keys_ptr, count_ptr, mass_ptr, o_ref_ptr, c_ref_ptr,
    first, stride_xr, stride_xh, stride_vs, stride_vh, stride_dn, stride_dh, stride_ln, num_heads, capacity,
    max_context, num, den, k_ptr, stride_ks, stride_kh,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, cell_ptr, depth_ptr, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, RADIX_BITS: tl.constexpr,
    HAVE_LSE: tl.constexpr, PACKED: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
):
    """Per (row of the chunk, query head): lse (HAVE_LSE: the dense launch's), the exact
    top-b of P, and the slot's state. PACKED: V of the kept keys from INT4 residual planes
    (k / v their tails), as the row reads it."""
    r = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = first + r
    pos = tl.load(positions_ptr + row).to(tl.int64)
    if pos >= 0:
        n = tl.minimum(pos + 1, max_context)
        b = tl.minimum(n, tl.maximum((n * num + den - 1) // den, 1)).to(tl.int32)  # `key_budget`
        slot = tl.load(slots_ptr + row).to(tl.int64)
        x_row = scratch_ptr + r * stride_xr + head * stride_xh
        if HAVE_LSE:
            lse = tl.load(lse_ptr + row * stride_ln + head)
        else:
            lse = _row_lse(x_row, n, BLOCK_S)
        threshold, need = _radix_select(x_row, n, lse, b, BLOCK_S, RADIX_BITS)
        at = slot * num_heads + head
        keys_row = keys_ptr + at * capacity
        _write_kept(x_row, keys_row, n, lse, threshold, need, b, BLOCK_S)
        tl.debug_barrier()  # the kept positions, written above by other threads, are read below
        table = tl.load(offsets_ptr + row).to(tl.int64)
        if PACKED:
            mass, c_ref = _kept_sums_packed(
                x_row, keys_row, n, lse, b, pos.to(tl.int32), tl.load(cell_ptr + row).to(tl.int64),
                tl.load(depth_ptr + row).to(tl.int32), table, head // GROUP, k_ptr, v_ptr, tables_ptr, k_codes_ptr,
                k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr, row_maps_ptr,
                stride_ks, stride_kh, stride_vs, stride_vh, num_heads // GROUP, max_groups, max_len, PAGE_SIZE,
                HEAD_DIM, BLOCK_V, BLOCK_D, PLANES, V_GROUPS, BF16_BY_HAND)
        else:
            mass, c_ref = _kept_sums(x_row, keys_row, v_ptr, tables_ptr, table, head // GROUP, stride_vs, stride_vh,
                                     n, lse, b, PAGE_SIZE, HEAD_DIM, BLOCK_V, BLOCK_D)
        _store_state(dense_ptr, row, head, stride_dn, stride_dh, slot, at, b, mass, c_ref, count_ptr, mass_ptr,
                     o_ref_ptr, c_ref_ptr, HEAD_DIM, BLOCK_D)


# --- launcher -------------------------------------------------------------------------

def _launch_select(v_cache: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                   table_offsets: torch.Tensor, page_size: int, key_retention: float, dense: torch.Tensor,
                   slots: torch.Tensor, state: SlotState, scratch: torch.Tensor, first: int, rows: int,
                   max_context: int, blocks: Blocks, lse: torch.Tensor | None = None,
                   k_cache: torch.Tensor | None = None, packed: PackedRows | None = None) -> None:
    """The select kernel over rows first..first+rows-1, whose scores are in scratch rows
    0..rows-1 (and whose lse [N, Hq], when given, is the dense launch's). `packed` (with the
    K tail `k_cache`): V from INT4 residual planes."""
    num_heads = dense.shape[1]
    num, den = retention_fraction(key_retention)
    planes, extra = (packed.kernel_args(dense.shape[0], dense.shape[2]) if packed is not None
                     else PackedRows.no_args(positions))
    k_cache = v_cache if k_cache is None else k_cache
    _select_kernel[(rows, num_heads)](
        scratch, v_cache, tables, positions, table_offsets, slots, dense, dense if lse is None else lse,
        state.keys, state.count, state.mass, state.o_ref, state.c_ref,
        first, scratch.stride(0), scratch.stride(1), v_cache.stride(0), v_cache.stride(1), dense.stride(0),
        dense.stride(1), 0 if lse is None else lse.stride(0), num_heads, state.keys.shape[2], max_context, num, den,
        k_cache, k_cache.stride(0), k_cache.stride(1), *planes,
        BLOCK_S=blocks.select, BLOCK_V=blocks.gather, RADIX_BITS=blocks.radix_bits,
        HAVE_LSE=lse is not None, BF16_BY_HAND=_INTERPRET and dense.dtype == torch.bfloat16,
        **_shape(num_heads, v_cache, page_size), num_warps=blocks.select_warps, **extra,
    )
