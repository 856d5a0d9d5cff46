"""Sparse decode attention: loop 2's top-b select split over several programs per (row,
query head), for small batches, where one program per (row, head) leaves most of the GPU
idle. Same kept set as the one-program select of `sparse_decode_select`, whose helpers it
shares; its torch reference is the source's (`sparse_decode_source.source_reference`).

The split select (`Blocks.select_splits` > 1, `decode_select` only): `splits` programs
per (row, query head) each take a share of whole select blocks; with 8-bit digits six
launches and one memset (eight launches until issue 38, with a count launch and a finish
launch). One launch per digit adds each share's histogram of the digit to the (row,
head)'s global one (`tl.atomic_add`; the launch boundary orders the digits) and stores
the share's own, as suffix sums; every program re-derives the prefix from the global
histograms, so all of them agree on T and `need` without talking. The write launch starts
each share's kept keys at the offset the earlier shares give (their keys above T, plus
their keys equal to T up to `need`: equal keys still go to the lowest positions), read
from their own histograms: a share's histogram of digit d counts exactly its keys whose
higher digits are T's (the digit launch's mask), and a key lies above T iff its digit is
the larger at the first digit where it differs from T, so its keys above T are the sum
over digits of those above T's digit, and its keys equal to T the last digit's at T's
digit. These are the counts a pass over the keys gives for P's patterns, all below 2^30
(P < 2); with NaN scores the kept set is undefined either way, and positions stay in
bounds. The gather launch sums the kept keys' m and C_ref over shares of the kept list
into partials; then each program of a live row takes a ticket (an int32 per (row, head),
zeroed by the histograms' memset): the barrier and the atomic's acq_rel put every
program's partial before the last ticket, whose program adds the partials (loads past L1)
as the finish launch did, writes the slot and hands the tickets back. Same kept set as
the one-program select; sums in another order. On an H100 the kept keys, counts, m and
O_ref are bit for bit the eight-launch code's, and C_ref within 1.5e-8 of it (6 of 57
random cases; the partials are added in another order), and the select took 36.5-38.3 ->
34.0-35.3 us at 1 x 8K (39.8-40.4 -> 36.5-37.0 cold) and 58.0-58.2 -> 52.3-52.5 us at
1 x 32K (bench/results/split_select_six_h100.json). `select_splits` picks the split count for
two waves of the GPU from static values (1, the one-program select, once the rows alone
fill two waves): on the H200 with 512-key blocks the split select (eight launches then)
ran 1.9x faster at 1 x 8K (8 splits) and 4.6x at 1 x 32K (17), and batch 32 keeps one
program (bench/results/sparse_decode_kernels_h200.json).
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
# (a launch boundary orders each digit after the last) and each split's own, then the kept
# positions, then partial sums over shares of the kept list (balanced however the kept
# keys bunch along the row), finished by each (row, head)'s last program. Every program of
# a (row, head) derives the threshold from the histograms alone, so the kept set is the
# one-program select's.

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
    scratch_ptr, positions_ptr, lse_ptr, hist_ptr, local_ptr, stride_xr, stride_xh, stride_ln, num_heads,
    max_context, num, den, splits,
    DIGIT: tl.constexpr, BLOCK_S: tl.constexpr, RADIX_BITS: tl.constexpr,
):
    """Per (row, head, split): its keys' histogram of digit DIGIT among those matching the
    prefix the earlier digits fixed, added to the (row, head)'s global histogram; its
    suffix sums (keys at or above each bin) stored as the split's own for the write launch."""
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
        bins = tl.arange(0, BINS)
        tl.atomic_add(hist_row + DIGIT * BINS + bins, hist)
        local_row = local_ptr + ((row * num_heads + head) * splits + split) * (DIGITS * BINS)
        tl.store(local_row + DIGIT * BINS + bins, tl.cumsum(hist, axis=0, reverse=True))


@triton.jit
def _split_threshold(hist_ptr, scratch_ptr, row, head, num_heads, b, stride_xr, stride_xh,
                     RADIX_BITS: tl.constexpr):
    """The threshold T and `need` from every digit's global histogram of a (row, head), and
    its scores row."""
    BINS: tl.constexpr = 1 << RADIX_BITS
    DIGITS: tl.constexpr = (_PATTERN_BITS + RADIX_BITS - 1) // RADIX_BITS
    threshold, need = _threshold(hist_ptr + (row * num_heads + head) * (DIGITS * BINS), b, DIGITS, RADIX_BITS)
    return threshold, need, scratch_ptr + row * stride_xr + head * stride_xh


@triton.jit
def _counts_before(local_ptr, row, head, num_heads, split, splits, threshold, BLOCK_P: tl.constexpr,
                   RADIX_BITS: tl.constexpr):
    """The keys above the threshold T and equal to it in the splits before `split`, from
    their digit launches' suffix sums. A split's digit d counts exactly its keys whose
    higher digits are T's (the digit launch's mask, with the prefix it derives, T's), and
    a key lies above T iff its digit is larger at the first digit where it differs from
    T: above = the sum over digits d of the keys above T's digit d, equal = the last
    digit's keys at T's digit (exact as P's patterns lie below 2^30, spelt by the digits)."""
    BINS: tl.constexpr = 1 << RADIX_BITS
    DIGITS: tl.constexpr = (_PATTERN_BITS + RADIX_BITS - 1) // RADIX_BITS
    i = tl.arange(0, BLOCK_P)
    earlier = i < split  # earlier splits are never empty: shares are cut from key 0
    local_rows = local_ptr + ((row * num_heads + head) * splits + i) * (DIGITS * BINS)
    above = split * 0
    for digit in tl.static_range(DIGITS - 1):  # above T's digit, the higher ones equal to T's
        t_digit = (threshold >> ((DIGITS - 1 - digit) * RADIX_BITS)) & (BINS - 1)
        above += _at_least(local_rows + digit * BINS, earlier, t_digit + 1, BINS)
    last = local_rows + (DIGITS - 1) * BINS
    t_last = threshold & (BINS - 1)
    over = _at_least(last, earlier, t_last + 1, BINS)
    return above + over, _at_least(last, earlier, t_last, BINS) - over


@triton.jit
def _at_least(local_digit, earlier, bin, BINS: tl.constexpr):
    """The earlier splits' keys at or above `bin` of a digit (0 for bin BINS)."""
    count = tl.sum(tl.load(local_digit + tl.minimum(bin, BINS - 1), mask=earlier, other=0), axis=0)
    return tl.where(bin < BINS, count, 0)


@triton.jit(do_not_specialize=["max_context"])
def _split_write_kernel(
    scratch_ptr, positions_ptr, slots_ptr, lse_ptr, hist_ptr, local_ptr, keys_ptr, stride_xr, stride_xh,
    stride_ln, num_heads, capacity, max_context, num, den, splits,
    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, RADIX_BITS: tl.constexpr,
):
    """Per (row, head, split): its kept keys' positions, at the offset the earlier splits'
    counts give (`_counts_before`)."""
    row, head, split, pos, n, b, lse, lo, hi = _split_row(positions_ptr, lse_ptr, stride_ln, max_context, num,
                                                         den, splits, BLOCK_S)
    if lo < hi:
        threshold, need, x_row = _split_threshold(hist_ptr, scratch_ptr, row, head, num_heads, b, stride_xr,
                                                  stride_xh, RADIX_BITS)
        above_before, ties_before = _counts_before(local_ptr, row, head, num_heads, split, splits, threshold,
                                                   BLOCK_P, RADIX_BITS)
        first = above_before + tl.minimum(ties_before, need)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        keys_row = keys_ptr + (slot * num_heads + head) * capacity
        _write_kept_range(x_row, keys_row, lo, hi, lse, threshold, need, b, first, ties_before, BLOCK_S)


@triton.jit
def _split_finish(part_row, slots_ptr, dense_ptr, count_ptr, mass_ptr, o_ref_ptr, c_ref_ptr, row, head, b,
                  stride_dn, stride_dh, num_heads, splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr):
    """A (row, head)'s m and C_ref from the partials of the gather's splits that held kept
    entries (loaded past L1: other programs stored them), O_ref, and the count. m by
    `tl.sum`, C_ref split after split: fixed orders, so a graph replays the same bits (on
    an H100, C_ref came within 1.5e-8 of the eight-launch code's finish, which added the
    splits in another order)."""
    i = tl.arange(0, BLOCK_P)
    lo, _hi = _split_share(b, i, splits, BLOCK_V)  # `_split_gather_kernel`'s shares
    mass = tl.sum(tl.load(part_row + i * (1 + HEAD_DIM), mask=(i < splits) & (lo < b), other=0.0,
                          cache_modifier=".cg"), axis=0)
    d = tl.arange(0, BLOCK_D)
    c_ref = tl.load(part_row + 1 + d, mask=d < HEAD_DIM, other=0.0, cache_modifier=".cg")  # split 0 always ran
    for k in tl.static_range(1, BLOCK_P):
        k_lo, _k_hi = _split_share(b, k, splits, BLOCK_V)
        ran = (k < splits) & (k_lo < b)
        c_ref += tl.load(part_row + k * (1 + HEAD_DIM) + 1 + d, mask=d < tl.where(ran, HEAD_DIM, 0), other=0.0,
                         cache_modifier=".cg")
    slot = tl.load(slots_ptr + row).to(tl.int64)
    _store_state(dense_ptr, row, head, stride_dn, stride_dh, slot, slot * num_heads + head, b, mass, c_ref,
                 count_ptr, mass_ptr, o_ref_ptr, c_ref_ptr, HEAD_DIM, BLOCK_D)


@triton.jit(do_not_specialize=["max_context"])
def _split_gather_kernel(
    scratch_ptr, v_ptr, tables_ptr, positions_ptr, offsets_ptr, slots_ptr, lse_ptr, part_ptr, keys_ptr,
    dense_ptr, count_ptr, mass_ptr, o_ref_ptr, c_ref_ptr, tickets_ptr,
    stride_xr, stride_xh, stride_vs, stride_vh, stride_ln, stride_dn, stride_dh, num_heads, capacity, max_context,
    num, den, splits, k_ptr, stride_ks, stride_kh,
    k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, cell_ptr, depth_ptr, max_groups, max_len,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr, PACKED: tl.constexpr, PLANES: tl.constexpr,
    V_GROUPS: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    """Per (row, head, split): m and C_ref summed over the split's share of the b kept
    entries (shares of the kept list, not of the keys: kept keys bunched in a few key
    ranges, as recent keys and sinks are, still spread over every split) into its partial
    [1 + D]; then a ticket, and the (row, head)'s last program adds the partials and
    writes the slot (`_split_finish`). PACKED: V of the kept keys from INT4 residual
    planes (k / v their tails), as the row reads it."""
    row, head, split, pos, n, b = _split_program(positions_ptr, max_context, num, den)
    lo, hi = _split_share(b, split, splits, BLOCK_V)
    part_row = part_ptr + (row * num_heads + head) * splits * (1 + HEAD_DIM)
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
        part = part_row + split * (1 + HEAD_DIM)
        d = tl.arange(0, BLOCK_D)
        tl.store(part, mass)
        tl.store(part + 1 + d, c_ref, mask=d < HEAD_DIM)
    if pos >= 0:
        # Every program of a live row takes a ticket once its warps' partial is stored (the
        # barrier, then acq_rel); the one that draws the last sees every partial, finishes
        # the (row, head) and hands the `splits` tickets back: the count is 0 again for the
        # next call and CUDA graph replays (subtracted, not reset: were the last ticket
        # miscounted, a program finishing early would not restart the count for a later
        # one to finish again, so the tests see it).
        tl.debug_barrier()
        tickets = tickets_ptr + row * num_heads + head
        if tl.atomic_add(tickets, 1, sem="acq_rel") == splits - 1:
            _split_finish(part_row, slots_ptr, dense_ptr, count_ptr, mass_ptr, o_ref_ptr, c_ref_ptr, row, head, b,
                          stride_dn, stride_dh, num_heads, splits, HEAD_DIM, BLOCK_D, BLOCK_V, BLOCK_P)
            tl.atomic_add(tickets, -splits)


# --- launcher -------------------------------------------------------------------------

def _launch_split_select(v_cache: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor,
                         table_offsets: torch.Tensor, page_size: int, key_retention: float, dense: torch.Tensor,
                         lse: torch.Tensor, scores: torch.Tensor, slots: torch.Tensor, state: SlotState,
                         max_context: int, splits: int, blocks: Blocks, k_cache: torch.Tensor | None = None,
                         packed: PackedRows | None = None) -> None:
    """The select split over `splits` programs per (row, head): one histogram launch per
    digit, the kept keys, and their partial sums over shares of the kept list (`packed`: V
    from INT4 residual planes), finished by each (row, head)'s last gather program (no host
    sync; a fixed launch sequence for fixed shapes)."""
    n, num_heads, head_dim = dense.shape
    num, den = retention_fraction(key_retention)
    bins = 1 << blocks.radix_bits
    digits = -(-PATTERN_BITS // blocks.radix_bits)
    # One memset: the global histograms, then each (row, head)'s ticket count.
    zeroed = torch.zeros(n * num_heads * (digits * bins + 1), dtype=torch.int32, device=dense.device)
    hist, tickets = zeroed[:n * num_heads * digits * bins], zeroed[n * num_heads * digits * bins:]
    local = torch.empty(n * num_heads * splits * digits * bins, dtype=torch.int32, device=dense.device)
    part = torch.empty(n * num_heads * splits * (1 + head_dim), dtype=torch.float32, device=dense.device)
    grid = (n, num_heads, splits)
    common = (scores.stride(0), scores.stride(1))
    for digit in range(digits):
        _split_digit_kernel[grid](scores, positions, lse, hist, local, *common, lse.stride(0), num_heads,
                                  max_context, num, den, splits, DIGIT=digit, BLOCK_S=blocks.split_select,
                                  RADIX_BITS=blocks.radix_bits, num_warps=blocks.select_warps)
    block_p = max(2, triton.next_power_of_2(splits))
    _split_write_kernel[grid](scores, positions, slots, lse, hist, local, state.keys, *common, lse.stride(0),
                              num_heads, state.keys.shape[2], max_context, num, den, splits,
                              BLOCK_S=blocks.split_select, BLOCK_P=block_p, RADIX_BITS=blocks.radix_bits,
                              num_warps=blocks.select_warps)
    shape = _shape(num_heads, v_cache, page_size)
    planes, extra = packed.kernel_args(n, head_dim) if packed is not None else PackedRows.no_args(positions)
    k_cache = v_cache if k_cache is None else k_cache
    _split_gather_kernel[grid](scores, v_cache, tables, positions, table_offsets, slots, lse, part, state.keys,
                               dense, state.count, state.mass, state.o_ref, state.c_ref, tickets, *common,
                               v_cache.stride(0), v_cache.stride(1), lse.stride(0), dense.stride(0), dense.stride(1),
                               num_heads, state.keys.shape[2], max_context, num, den, splits, k_cache,
                               k_cache.stride(0), k_cache.stride(1), *planes, BLOCK_V=blocks.gather, BLOCK_P=block_p,
                               BF16_BY_HAND=_INTERPRET and dense.dtype == torch.bfloat16, **shape,
                               num_warps=blocks.select_warps, **extra)
