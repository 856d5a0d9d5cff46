"""Sparse decode attention: loop 2's top-b select split over several programs per (row,
query head), for small batches, where one program per (row, head) leaves most of the GPU
idle. Same kept set as the one-program select of `sparse_decode_select`, whose helpers it
shares; its torch reference is the source's (`sparse_decode_source.source_reference`).

The split select (`Blocks.select_splits` > 1, `decode_select` only): `splits` programs
per (row, query head) each take a share of whole select blocks. One launch per digit adds
each share's histogram of the digit to the (row, head)'s global one (`tl.atomic_add`; the
launch boundary orders the digits); every program re-derives the prefix from the global
histograms, so all of them agree on T and `need` without talking. A count launch gives
each share's keys above T and equal to it; the write launch starts each share's kept keys
at the offset the earlier shares' counts give (equal keys still go to the lowest
positions) and sums its kept keys' m and C_ref into a partial; a finish launch adds the
partials and writes the slot. Same kept set as the one-program select; sums in another
order. `select_splits` picks the split count for two waves of the GPU from static values
(1, the one-program select, once the rows alone fill two waves): on the H200 with 512-key
blocks the split select ran 1.9x faster at 1 x 8K (8 splits) and 4.6x at 1 x 32K (17),
and batch 32 keeps one program (bench/results/sparse_decode_kernels_h200.json).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specloop.kernels.paged_attention import choose_splits
from specloop.kernels.sparse_decode_common import (
    Blocks, PackedRows, SlotState, _shape, _split_share, retention_fraction,
)
from specloop.kernels.sparse_decode_select import (
    PATTERN_BITS, _PATTERN_BITS, _digit_step, _kept_sums, _kept_sums_packed, _prob_bits, _store_state,
    _write_kept_range,
)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def select_splits(rows: int, num_heads: int, max_context: int, num_sms: int, block: int) -> int:
    """Programs per (row, query head) of the split select, from static values only: two
    waves of the GPU, shares of at least two select blocks, at most 32 (1: the one-program
    select; the default, `Blocks.select_splits` None)."""
    return choose_splits(rows, num_heads, max_context, num_sms, min_keys=2 * block, max_splits=32)


# --- Triton kernels -------------------------------------------------------------------
# `max_context` is not specialized (`sparse_decode_source`).

# The select split over `splits` programs per (row, query head), for small batches, where
# one program per (row, head) leaves most of the GPU idle. Its rows' scores and lse come
# from the dense launch (`decode_select`); the launches share global per-digit histograms
# (a launch boundary orders each digit after the last), then the keys kept and tied per
# split, then the kept positions, then partial sums over shares of the kept list (balanced
# however the kept keys bunch along the row). Every program of a (row, head) derives the
# threshold from the histograms alone, so the kept set is the one-program select's.

@triton.jit
def _split_program(positions_ptr, max_context, num, den):
    """The program's row, head and split; its position, key count n (0 for a padding row)
    and budget b (`key_budget`)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    pos = tl.load(positions_ptr + row).to(tl.int64)
    n = tl.maximum(tl.minimum(pos + 1, max_context), 0)
    b = tl.minimum(n, tl.maximum((n * num + den - 1) // den, 1)).to(tl.int32)
    return row, head, split, pos, n, b


@triton.jit
def _split_row(positions_ptr, lse_ptr, stride_ln, max_context, num, den, splits, BLOCK_S: tl.constexpr):
    """`_split_program`, the row's lse and the split's key range."""
    row, head, split, pos, n, b = _split_program(positions_ptr, max_context, num, den)
    lse = tl.load(lse_ptr + row * stride_ln + head, mask=pos >= 0, other=0.0)
    lo, hi = _split_share(n, split, splits, BLOCK_S)
    return row, head, split, pos, n, b, lse, lo, hi


@triton.jit
def _threshold(hist_row, b, DIGIT: tl.constexpr, RADIX_BITS: tl.constexpr):
    """(prefix, need) after the first DIGIT digits, from their global histograms."""
    BINS: tl.constexpr = 1 << RADIX_BITS
    DIGITS: tl.constexpr = (_PATTERN_BITS + RADIX_BITS - 1) // RADIX_BITS
    bins = tl.arange(0, BINS)
    need = b
    prefix = b * 0
    for digit in tl.static_range(DIGIT):
        prefix, need = _digit_step(tl.load(hist_row + digit * BINS + bins), bins, prefix, need,
                                   (DIGITS - 1 - digit) * RADIX_BITS)
    return prefix, need


@triton.jit(do_not_specialize=["max_context"])
def _split_digit_kernel(
    scratch_ptr, positions_ptr, lse_ptr, hist_ptr, stride_xr, stride_xh, stride_ln, num_heads, max_context, num,
    den, splits,
    DIGIT: tl.constexpr, BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr,
):
    """Per (row, head, split): its keys' histogram of digit DIGIT among those matching the
    prefix the earlier digits fixed, added to the (row, head)'s global histogram."""
    row, head, split, pos, n, b, lse, lo, hi = _split_row(positions_ptr, lse_ptr, stride_ln, max_context, num,
                                                         den, splits, BLOCK_S)
    if lo < hi:
        BINS: tl.constexpr = 1 << RADIX_BITS
        DIGITS: tl.constexpr = (_PATTERN_BITS + RADIX_BITS - 1) // RADIX_BITS
        shift: tl.constexpr = (DIGITS - 1 - DIGIT) * RADIX_BITS
        hist_row = hist_ptr + (row * num_heads + head) * (DIGITS * BINS)
        prefix, _need = _threshold(hist_row, b, DIGIT, RADIX_BITS)
        x_row = scratch_ptr + row * stride_xr + head * stride_xh
        hist = tl.zeros([BINS], tl.int32)
        for start in range(lo, hi, BLOCK_S):
            j = start + tl.arange(0, BLOCK_S)
            ok = j < hi
            x = _prob_bits(x_row, j, ok, lse)
            if DIGIT > 0:
                ok = ok & ((x >> (shift + RADIX_BITS)) == (prefix >> (shift + RADIX_BITS)))
            hist += tl.histogram((x >> shift) & (BINS - 1), BINS, mask=ok)
        tl.atomic_add(hist_row + DIGIT * BINS + tl.arange(0, BINS), hist)


@triton.jit
def _split_threshold(hist_ptr, scratch_ptr, row, head, num_heads, b, stride_xr, stride_xh,
                     RADIX_BITS: tl.constexpr):
    """The threshold T and `need` from every digit's global histogram of a (row, head), and
    its scores row."""
    BINS: tl.constexpr = 1 << RADIX_BITS
    DIGITS: tl.constexpr = (_PATTERN_BITS + RADIX_BITS - 1) // RADIX_BITS
    threshold, need = _threshold(hist_ptr + (row * num_heads + head) * (DIGITS * BINS), b, DIGITS, RADIX_BITS)
    return threshold, need, scratch_ptr + row * stride_xr + head * stride_xh


@triton.jit(do_not_specialize=["max_context"])
def _split_count_kernel(
    scratch_ptr, positions_ptr, lse_ptr, hist_ptr, counts_ptr, stride_xr, stride_xh, stride_ln, num_heads,
    max_context, num, den, splits,
    BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr,
):
    """Per (row, head, split): how many of its keys lie above the threshold T and equal it."""
    row, head, split, pos, n, b, lse, lo, hi = _split_row(positions_ptr, lse_ptr, stride_ln, max_context, num,
                                                         den, splits, BLOCK_S)
    if lo < hi:
        threshold, _need, x_row = _split_threshold(hist_ptr, scratch_ptr, row, head, num_heads, b, stride_xr, stride_xh,
                                               RADIX_BITS)
        above = b * 0
        ties = b * 0
        for start in range(lo, hi, BLOCK_S):
            j = start + tl.arange(0, BLOCK_S)
            ok = j < hi
            x = _prob_bits(x_row, j, ok, lse)
            above += tl.sum((ok & (x > threshold)).to(tl.int32), axis=0)
            ties += tl.sum((ok & (x == threshold)).to(tl.int32), axis=0)
        at = ((row * num_heads + head) * splits + split) * 2
        tl.store(counts_ptr + at, above)
        tl.store(counts_ptr + at + 1, ties)


@triton.jit(do_not_specialize=["max_context"])
def _split_write_kernel(
    scratch_ptr, positions_ptr, slots_ptr, lse_ptr, hist_ptr, counts_ptr, keys_ptr, stride_xr, stride_xh,
    stride_ln, num_heads, capacity, max_context, num, den, splits,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, RADIX_BITS: tl.constexpr,
):
    """Per (row, head, split): its kept keys' positions, at the offset the earlier splits'
    counts give."""
    row, head, split, pos, n, b, lse, lo, hi = _split_row(positions_ptr, lse_ptr, stride_ln, max_context, num,
                                                         den, splits, BLOCK_S)
    if lo < hi:
        threshold, need, x_row = _split_threshold(hist_ptr, scratch_ptr, row, head, num_heads, b, stride_xr,
                                                  stride_xh, RADIX_BITS)
        i = tl.arange(0, BLOCK_P)
        earlier = i < split  # earlier splits are never empty: shares are cut from key 0
        at = ((row * num_heads + head) * splits + i) * 2
        above_before = tl.sum(tl.load(counts_ptr + at, mask=earlier, other=0), axis=0)
        ties_before = tl.sum(tl.load(counts_ptr + at + 1, mask=earlier, other=0), axis=0)
        first = above_before + tl.minimum(ties_before, need)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        keys_row = keys_ptr + (slot * num_heads + head) * capacity
        _write_kept_range(x_row, keys_row, lo, hi, lse, threshold, need, b, first, ties_before, BLOCK_S)


@triton.jit(do_not_specialize=["max_context"])
def _split_gather_kernel(
    scratch_ptr, v_ptr, tables_ptr, positions_ptr, offsets_ptr, slots_ptr, lse_ptr, part_ptr, keys_ptr,
    stride_xr, stride_xh, stride_vs, stride_vh, stride_ln, num_heads, capacity, max_context, num, den, splits,
    k_ptr, stride_ks, stride_kh,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, cell_ptr, depth_ptr, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr, PACKED: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
):
    """Per (row, head, split): m and C_ref summed over the split's share of the b kept
    entries (shares of the kept list, not of the keys: kept keys bunched in a few key
    ranges, as recent keys and sinks are, still spread over every split) into its partial
    [1 + D]. PACKED: V of the kept keys from INT4 residual planes (k / v their tails), as
    the row reads it."""
    row, head, split, pos, n, b = _split_program(positions_ptr, max_context, num, den)
    lo, hi = _split_share(b, split, splits, BLOCK_V)
    if lo < hi:
        lse = tl.load(lse_ptr + row * stride_ln + head)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        keys_row = keys_ptr + (slot * num_heads + head) * capacity
        x_row = scratch_ptr + row * stride_xr + head * stride_xh
        table = tl.load(offsets_ptr + row).to(tl.int64)
        if PACKED:
            mass, c_ref = _kept_sums_packed(
                x_row, keys_row, n, lse, hi, pos.to(tl.int32), tl.load(cell_ptr + row).to(tl.int64),
                tl.load(depth_ptr + row).to(tl.int32), table, head // GROUP, k_ptr, v_ptr, tables_ptr, k_codes_ptr,
                k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr, row_maps_ptr,
                stride_ks, stride_kh, stride_vs, stride_vh, num_heads // GROUP, max_groups, max_len, PAGE_SIZE,
                HEAD_DIM, BLOCK_V, BLOCK_D, PLANES, V_GROUPS, BF16_BY_HAND, first=lo)
        else:
            mass, c_ref = _kept_sums(x_row, keys_row, v_ptr, tables_ptr, table, head // GROUP, stride_vs,
                                     stride_vh, n, lse, hi, PAGE_SIZE, HEAD_DIM, BLOCK_V, BLOCK_D, first=lo)
        part = part_ptr + ((row * num_heads + head) * splits + split) * (1 + HEAD_DIM)
        d = tl.arange(0, BLOCK_D)
        tl.store(part, mass)
        tl.store(part + 1 + d, c_ref, mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["max_context"])
def _split_finish_kernel(
    positions_ptr, slots_ptr, dense_ptr, part_ptr, count_ptr, mass_ptr, o_ref_ptr, c_ref_ptr, stride_dn, stride_dh,
    num_heads, max_context, num, den, splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Per (row, head): m and C_ref from the gather's splits that held kept entries, O_ref,
    and the count."""
    row, head, _split, pos, n, b = _split_program(positions_ptr, max_context, num, den)  # grid (rows, heads)
    if pos >= 0:
        i = tl.arange(0, BLOCK_P)
        lo, _hi = _split_share(b, i, splits, BLOCK_V)  # `_split_gather_kernel`'s shares
        ran = (i < splits) & (lo < b)
        part = part_ptr + ((row * num_heads + head) * splits + i) * (1 + HEAD_DIM)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        mass = tl.sum(tl.load(part, mask=ran, other=0.0), axis=0)
        c_ref = tl.sum(tl.load(part[:, None] + 1 + d[None, :], mask=ran[:, None] & d_ok[None, :], other=0.0), axis=0)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        _store_state(dense_ptr, row, head, stride_dn, stride_dh, slot, slot * num_heads + head, b, mass, c_ref,
                     count_ptr, mass_ptr, o_ref_ptr, c_ref_ptr, HEAD_DIM, BLOCK_D)


# --- launcher -------------------------------------------------------------------------

def _launch_split_select(v_cache: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                         table_offsets: torch.Tensor, page_size: int, key_retention: float, dense: torch.Tensor,
                         lse: torch.Tensor, scores: torch.Tensor, slots: torch.Tensor, state: SlotState,
                         max_context: int, splits: int, blocks: Blocks, k_cache: torch.Tensor | None = None,
                         packed: PackedRows | None = None) -> None:
    """The select split over `splits` programs per (row, head): one histogram launch per
    digit, the kept and tied counts per split, the kept keys, their partial sums over
    shares of the kept list (`packed`: V from INT4 residual planes), and the finish (no
    host sync; a fixed launch sequence for fixed shapes)."""
    n, num_heads, head_dim = dense.shape
    num, den = retention_fraction(key_retention)
    bins = 1 << blocks.radix_bits
    digits = -(-PATTERN_BITS // blocks.radix_bits)
    hist = torch.zeros(n * num_heads * digits * bins, dtype=torch.int32, device=dense.device)
    counts = torch.empty(n * num_heads * splits * 2, dtype=torch.int32, device=dense.device)
    part = torch.empty(n * num_heads * splits * (1 + head_dim), dtype=torch.float32, device=dense.device)
    grid = (n, num_heads, splits)
    common = (scores.stride(0), scores.stride(1))
    for digit in range(digits):
        _split_digit_kernel[grid](scores, positions, lse, hist, *common, lse.stride(0), num_heads, max_context, num,
                                  den, splits, DIGIT=digit, BLOCK_S=blocks.split_select, RADIX_BITS=blocks.radix_bits,
                                  num_warps=blocks.select_warps)
    _split_count_kernel[grid](scores, positions, lse, hist, counts, *common, lse.stride(0), num_heads, max_context,
                              num, den, splits, BLOCK_S=blocks.split_select, RADIX_BITS=blocks.radix_bits,
                              num_warps=blocks.select_warps)
    block_p = max(2, triton.next_power_of_2(splits))
    _split_write_kernel[grid](scores, positions, slots, lse, hist, counts, state.keys, *common, lse.stride(0),
                              num_heads, state.keys.shape[2], max_context, num, den, splits,
                              BLOCK_S=blocks.split_select, BLOCK_P=block_p, RADIX_BITS=blocks.radix_bits,
                              num_warps=blocks.select_warps)
    shape = _shape(num_heads, v_cache, page_size)
    planes, extra = packed.kernel_args(n, head_dim) if packed is not None else PackedRows.no_args(positions)
    k_cache = v_cache if k_cache is None else k_cache
    _split_gather_kernel[grid](scores, v_cache, tables, positions, table_offsets, slots, lse, part, state.keys,
                               *common, v_cache.stride(0), v_cache.stride(1), lse.stride(0), num_heads,
                               state.keys.shape[2], max_context, num, den, splits, k_cache, k_cache.stride(0),
                               k_cache.stride(1), *planes, BLOCK_V=blocks.gather,
                               BF16_BY_HAND=_INTERPRET and dense.dtype == torch.bfloat16, **shape,
                               num_warps=blocks.select_warps, **extra)
    _split_finish_kernel[(n, num_heads)](positions, slots, dense, part, state.count, state.mass, state.o_ref,
                                         state.c_ref, dense.stride(0), dense.stride(1), num_heads, max_context, num,
                                         den, splits, HEAD_DIM=head_dim, BLOCK_D=shape["BLOCK_D"],
                                         BLOCK_V=blocks.gather, BLOCK_P=block_p)
