"""The packed reader's sealed pass: the leading dense, sealed key groups of each split,
read straight from the INT4 codes in a lean kernel of its own (`packed_attention` runs it
before its general kernel, which starts where this one stops).

Why a kernel of its own: the packed reader's one kernel, with its per-key gather for
sparse planes and seal-straddling tiles, compiled to 225-255 registers a thread whatever
the block path did, so 2 programs ran on a multiprocessor and the reader stayed latency-
bound (docs/flashloop.md, "The reader's registers"). Here only the common case is
compiled: a whole 64-key group (one record a plane) that every plane up to the depth holds
densely and that every lane of the tile reads reconstructed.

A program per (tile, KV head, split), the same tiles, lanes and split bounds as the general
kernel (chunks rounded to whole 64-key groups). With SKIP_ONE_ROW, one-row tiles are left to
`packed_sealed_row` (the same pass on CUDA cores, for GQA 1).

1. Scan: from the split's first key, its whole groups g (keys 64g..64g+63, all below the
   split's end) qualify while, at every plane p up to the depth, the row map sends key
   64g + 63 to row 64g + 63 (compact rows increase with the position, so that row has every
   position 0..64g+63 before it: keys 64g.. are rows 0..63 of compact group g), group g
   has a record, and the tile's lowest position is at or past the seal of the depth's
   record (the seal of every key of the group: its deepest row is at the depth). The scan
   reads SCAN groups' metadata at once as vectors; the first group that fails is `stop`,
   stored per (tile, KV head, split) for the general kernel.
2. The groups before `stop`, 64 keys a step: K's codes are scaled per channel, so the
   reconstructed key's score is sum over planes of (q * scale_p) . code_p + q . lo_p; the
   codes (0..15) go straight into `tl.dot` and q * scale goes as hi + lo in DT (two
   products, as exact as fp32 ones: a single DT rounding put the lse 6e-3 from the
   reference on the H100). A code byte holds rows 2i and 2i + 1 of a channel, so the
   group's keys are scored as two halves, even rows and odd rows, each [M, 32]; the online
   softmax takes both. V's codes are scaled per row and 64-channel group:
   sum_j p_j v_j = sum over planes and groups of (p * scale) . code + p . lo, with p * scale
   rounded to DT as flash attention rounds p; a V byte holds channels 2c and 2c + 1, so
   each (group, channel parity) has its own accumulator [M, GW / 2], interleaved back into
   channel order when the partial is stored.
3. The partial output and lse go to slot `split` of each row's 2 x splits slots (the
   general kernel's go to splits + split); `_combine_kernel` merges them by lse.

Codes become DT without an int-to-float conversion when BIAS is set (bf16, fp16): the
4-bit code or-ed into the mantissa of 2^7 (bf16) or 2^10 (fp16) is that power plus the
code, one logic op; the products then carry BIAS times the other operand's sum, which is
subtracted (fp32 sums of the same rounded operands).

Precision: within the reference's tolerance, not its bits (the reference reconstructs each
key in DT plane by plane and multiplies once; here the planes' products are summed in
fp32). fp32 inputs use IEEE fp32 products and no bias. Supported head dims: even, 32..128
(`supported`); others run the general kernel alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specloop.kernels.packed_steps import _dot, _lanes, _score_rows

GROUP = 64  # keys a record holds at a plane
SCAN = 64  # groups a scan step reads at once
_GROUP = tl.constexpr(GROUP)  # (what a kernel may read of a global)
_NEVER = tl.constexpr(2147483647)


def supported(head_dim: int) -> bool:
    """Whether the sealed pass takes this head dim: an even one of 32..128 (a V channel
    group's codes, half its channels, are a `tl.dot` operand of at least 16 columns; at most
    two channel groups, two accumulators each)."""
    return head_dim % 2 == 0 and 32 <= head_dim <= 128


def channel_group(head_dim: int) -> int:
    """GW: the channels a V channel group spans in registers (64, or the padded head dim
    when it is smaller)."""
    return 64 if head_dim > 64 else max(16, triton.next_power_of_2(head_dim))


@triton.jit
def _nibbles(byte, DOT_DTYPE: tl.constexpr, BIAS: tl.constexpr):
    """The low and high 4-bit codes of uint8 `byte` as DOT_DTYPE: the codes, or with BIAS
    (128: bf16, 1024: fp16) BIAS + code, made by or-ing the code into BIAS's mantissa."""
    b = byte.to(tl.int16)
    low = b & 0xF
    high = (b >> 4) & 0xF
    if BIAS == 128:
        return (low | 0x4300).to(tl.bfloat16, bitcast=True), (high | 0x4300).to(tl.bfloat16, bitcast=True)
    elif BIAS == 1024:
        return (low | 0x6400).to(tl.float16, bitcast=True), (high | 0x6400).to(tl.float16, bitcast=True)
    else:
        return low.to(DOT_DTYPE), high.to(DOT_DTYPE)


@triton.jit
def _plane_scores(s_even, s_odd, t, q_at, lane_ok, rec, kv_head, q_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr,
                  num_kv_heads, DOT_DTYPE: tl.constexpr, DOT_FP32: tl.constexpr, BIAS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """One plane's share of the scores [M, 32] of the group's even and odd rows, record
    `rec` (-1: no plane here, the scores returned as given), CHUNK channels at a time: a
    product's left operand (q * scale, [M, channels]) is held whole by every warp, so whole
    head dims took 255 registers a thread (q's rows at q_at [M] are loaded a chunk at a time,
    from L1, rather than kept). The terms every key shares (q . lo, the bias) go into t
    [M, CHUNK], summed once a group by the caller: a sum across a warp's lanes costs
    shuffles and a barrier, so none is paid per chunk or plane."""
    if rec >= 0:
        r = rec.to(tl.int64)
        pair = (r * (_GROUP // 2) + tl.arange(0, _GROUP // 2)) * num_kv_heads + kv_head
        for c0 in tl.static_range(0, BLOCK_D, CHUNK):
            d = c0 + tl.arange(0, CHUNK)
            d_ok = d < HEAD_DIM
            each = (r * num_kv_heads + kv_head) * HEAD_DIM + d
            scale = tl.load(k_scale_ptr + each, mask=d_ok, other=0.0).to(tl.float32)
            lo = tl.load(k_lo_ptr + each, mask=d_ok, other=0.0).to(tl.float32)
            byte = tl.load(k_codes_ptr + pair[:, None] * HEAD_DIM + d[None, :], mask=d_ok[None, :], other=0)
            even, odd = _nibbles(byte, DOT_DTYPE, BIAS)
            even = tl.trans(even)
            odd = tl.trans(odd)
            q = tl.load(q_ptr + q_at[:, None] + d[None, :], mask=lane_ok[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)
            qs = q * scale[None, :]
            hi = qs.to(DOT_DTYPE)
            t += q * lo[None, :]
            s_even += _dot(hi, even, DOT_FP32)
            s_odd += _dot(hi, odd, DOT_FP32)
            if not DOT_FP32:  # q * scale as hi + lo in DT
                rest = (qs - hi.to(tl.float32)).to(DOT_DTYPE)
                s_even += _dot(rest, even, DOT_FP32)
                s_odd += _dot(rest, odd, DOT_FP32)
                if BIAS != 0:
                    t -= BIAS * (hi.to(tl.float32) + rest.to(tl.float32))
    return s_even, s_odd, t


@triton.jit
def _group_values(acc_even, acc_odd, u, p, vrow, g: tl.constexpr, v_codes_ptr, v_scale_ptr, v_lo_ptr,
                  DOT_DTYPE: tl.constexpr, DOT_FP32: tl.constexpr, BIAS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  V_GROUPS: tl.constexpr, GW: tl.constexpr):
    """Channel group g's share of sum_j p_j v_j for V rows `vrow` [32] (p [M, 32] fp32):
    its even channels into acc_even, its odd ones into acc_odd ([M, GW / 2] each); the
    terms every channel of the group shares (p . lo, the bias) into u [M, 32], summed once a
    group by the caller."""
    c = tl.arange(0, GW // 2)
    c_ok = g * GW + 2 * c < HEAD_DIM
    byte = tl.load(v_codes_ptr + vrow[:, None] * (HEAD_DIM // 2) + (g * GW // 2 + c)[None, :], mask=c_ok[None, :],
                   other=0)
    low, high = _nibbles(byte, DOT_DTYPE, BIAS)
    scale = tl.load(v_scale_ptr + vrow * V_GROUPS + g).to(tl.float32)
    lo = tl.load(v_lo_ptr + vrow * V_GROUPS + g).to(tl.float32)
    ps = (p * scale[None, :]).to(DOT_DTYPE)
    u += p * lo[None, :]
    if BIAS != 0:
        u -= BIAS * ps.to(tl.float32)
    acc_even += _dot(ps, low, DOT_FP32)
    acc_odd += _dot(ps, high, DOT_FP32)
    return acc_even, acc_odd, u


@triton.jit
def _plane_values(a0e, a0o, a1e, a1o, u0, u1, p_even, p_odd, rec, kv_head, v_codes_ptr, v_scale_ptr, v_lo_ptr, num_kv_heads,
                  DOT_DTYPE: tl.constexpr, DOT_FP32: tl.constexpr, BIAS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  V_GROUPS: tl.constexpr, GW: tl.constexpr):
    """One plane's share of the output (record `rec`, -1: none) in the four accumulators
    (channel group 0 / 1, even / odd channels) and the shared terms of each group (u0, u1)."""
    if rec >= 0:
        n = tl.arange(0, _GROUP // 2)
        even_rows = (rec.to(tl.int64) * _GROUP + 2 * n) * num_kv_heads + kv_head
        odd_rows = even_rows + num_kv_heads
        a0e, a0o, u0 = _group_values(a0e, a0o, u0, p_even, even_rows, 0, v_codes_ptr, v_scale_ptr, v_lo_ptr, DOT_DTYPE,
                                 DOT_FP32, BIAS, HEAD_DIM, V_GROUPS, GW)
        a0e, a0o, u0 = _group_values(a0e, a0o, u0, p_odd, odd_rows, 0, v_codes_ptr, v_scale_ptr, v_lo_ptr, DOT_DTYPE,
                                 DOT_FP32, BIAS, HEAD_DIM, V_GROUPS, GW)
        if V_GROUPS > 1:
            a1e, a1o, u1 = _group_values(a1e, a1o, u1, p_even, even_rows, 1, v_codes_ptr, v_scale_ptr, v_lo_ptr, DOT_DTYPE,
                                     DOT_FP32, BIAS, HEAD_DIM, V_GROUPS, GW)
            a1e, a1o, u1 = _group_values(a1e, a1o, u1, p_odd, odd_rows, 1, v_codes_ptr, v_scale_ptr, v_lo_ptr, DOT_DTYPE,
                                     DOT_FP32, BIAS, HEAD_DIM, V_GROUPS, GW)
    return a0e, a0o, a1e, a1o, u0, u1


@triton.jit
def _record(base, depth, grp, group_tables_ptr, max_groups, p):
    """The record of compact group `grp` at plane p (-1 past the depth)."""
    return tl.load(group_tables_ptr + (base + p) * max_groups + grp, mask=depth >= p, other=-1)


@triton.jit
def _scan(lo, end, low_pos, base, depth, seal_ptr, group_tables_ptr, row_maps_ptr, max_groups, max_len,
          PLANES: tl.constexpr, SCAN_GROUPS: tl.constexpr):
    """The first key of lo..end (whole groups) whose group the sealed pass cannot read:
    the scan of the module docstring, SCAN_GROUPS groups a step."""
    stop = lo
    go = lo < end
    while go:
        grp = stop // _GROUP + tl.arange(0, SCAN_GROUPS)
        last = grp * _GROUP + _GROUP - 1
        inside = last < end
        deep = tl.zeros_like(grp) + depth  # (a scalar in a vector mask fails under the interpreter)
        fast = inside
        rec_deep = tl.zeros_like(grp) - 1
        for p in tl.static_range(PLANES):
            on = inside & (deep >= p)
            row = tl.load(row_maps_ptr + (base + p) * max_len + last, mask=on, other=-1)
            rec = tl.load(group_tables_ptr + (base + p) * max_groups + grp, mask=on, other=-1)
            fast &= ((row == last) & (rec >= 0)) | ~on
            rec_deep = tl.where(deep == p, rec, rec_deep)
        seal = tl.load(seal_ptr + tl.maximum(rec_deep, 0), mask=fast, other=_NEVER)
        fast &= low_pos >= seal
        bad = tl.min(tl.where(fast | ~inside, _NEVER, grp), axis=0)
        go = (bad == _NEVER) & ((stop // _GROUP + SCAN_GROUPS) * _GROUP < end)
        stop = tl.where(bad == _NEVER, tl.minimum((stop // _GROUP + SCAN_GROUPS) * _GROUP, end), bad * _GROUP)
    return stop


@triton.jit
def _store_half(part_o_ptr, at, acc_even, acc_odd, l_safe, ch0: tl.constexpr, GW: tl.constexpr,
                BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, lane_ok):
    """A channel group's accumulators, normalised, back in channel order in the partial."""
    c = tl.arange(0, GW // 2)
    ch = ch0 + 2 * c
    ok = lane_ok[:, None] & (ch < HEAD_DIM)[None, :]
    tl.store(part_o_ptr + at[:, None] * BLOCK_D + ch[None, :], acc_even / l_safe[:, None], mask=ok)
    tl.store(part_o_ptr + at[:, None] * BLOCK_D + ch[None, :] + 1, acc_odd / l_safe[:, None], mask=ok)


@triton.jit(do_not_specialize=["splits", "min_split"],
            do_not_specialize_on_alignment=["cell_ptr", "depth_ptr", "position_ptr", "table_offset_ptr", "tiles_ptr",
                                            "scores_ptr", "score_rows_ptr"])
def _sealed_kernel(
    q_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, v_codes_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, cell_ptr, depth_ptr, position_ptr, table_offset_ptr, tiles_ptr, part_o_ptr, part_lse_ptr,
    stop_ptr, scores_ptr, score_rows_ptr,
    stride_qn, stride_qh, stride_sr, stride_sh, score_keys, num_heads, num_kv_heads, max_groups, max_len, scale,
    splits, min_split,
    GQA: tl.constexpr, BLOCK_G: tl.constexpr, TILE_ROWS: tl.constexpr, HAS_TILES: tl.constexpr,
    HEAD_DIM: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr, GW: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, SCAN_GROUPS: tl.constexpr, DOT_FP32: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BIAS: tl.constexpr, STORE_SCORES: tl.constexpr, CHUNK: tl.constexpr, SKIP_ONE_ROW: tl.constexpr,
):
    first, rows, table, r, g, row, pos, lane_ok, context = _lanes(
        tiles_ptr, table_offset_ptr, position_ptr, HAS_TILES, GQA, BLOCK_G, BLOCK_M, TILE_ROWS)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    live = context > 0
    if SKIP_ONE_ROW:  # one-row tiles are packed_sealed_row's
        live = live & (rows > 1)
    if live:
        chunk = tl.maximum(tl.cdiv(tl.cdiv(context, splits), _GROUP) * _GROUP, min_split)
        lo = split * chunk
        hi = tl.minimum(context, lo + chunk)
        end = lo + tl.maximum(hi - lo, 0) // _GROUP * _GROUP  # the split's whole groups end here
        cell = tl.load(cell_ptr + first).to(tl.int64)  # the tile's rows share cell and depth
        depth = tl.load(depth_ptr + first).to(tl.int32)
        base = cell * PLANES
        low_pos = tl.min(tl.where(lane_ok, pos, _NEVER), axis=0)
        stop = _scan(lo, end, low_pos, base, depth, seal_ptr, group_tables_ptr, row_maps_ptr, max_groups, max_len,
                     PLANES, SCAN_GROUPS)
        tl.store(stop_ptr + (tl.program_id(0).to(tl.int64) * num_kv_heads + kv_head) * splits + split, stop)
        head = kv_head * GQA + g
        score_row, score_ok = _score_rows(scores_ptr, score_rows_ptr, row, r, rows, head, lane_ok, stride_sr,
                                          stride_sh, TILE_ROWS, STORE_SCORES)
        q_at = row * stride_qn + head * stride_qh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        a0e = tl.zeros([BLOCK_M, GW // 2], tl.float32)
        a0o = tl.zeros([BLOCK_M, GW // 2], tl.float32)
        a1e = tl.zeros([BLOCK_M, GW // 2], tl.float32)
        a1o = tl.zeros([BLOCK_M, GW // 2], tl.float32)
        n = tl.arange(0, _GROUP // 2)
        for start in range(lo, stop, _GROUP):
            grp = start // _GROUP
            s_even = tl.zeros([BLOCK_M, _GROUP // 2], tl.float32)
            s_odd = tl.zeros([BLOCK_M, _GROUP // 2], tl.float32)
            k_terms = tl.zeros([BLOCK_M, CHUNK], tl.float32)
            # planes as a loop, not unrolled: unrolled, one plane's tiles and the next's were
            # live at once (255 registers and spills, against 168) and it ran 1.1-1.9x slower
            for p in range(0, depth + 1):
                s_even, s_odd, k_terms = _plane_scores(
                    s_even, s_odd, k_terms, q_at, lane_ok, _record(base, depth, grp, group_tables_ptr, max_groups, p),
                    kv_head, q_ptr, k_codes_ptr, k_scale_ptr, k_lo_ptr, num_kv_heads, DOT_DTYPE, DOT_FP32, BIAS,
                    HEAD_DIM, BLOCK_D, CHUNK)
            shared = tl.sum(k_terms, axis=1)[:, None]
            s_even += shared
            s_odd += shared
            j_even = start + 2 * n
            seen_even = j_even[None, :] <= pos[:, None]
            seen_odd = (j_even + 1)[None, :] <= pos[:, None]
            # the online softmax over both halves: one max, one rescale
            if STORE_SCORES:
                tl.store(score_row[:, None] + j_even[None, :], s_even * scale,
                         mask=seen_even & (j_even < score_keys)[None, :] & score_ok[:, None])
                tl.store(score_row[:, None] + j_even[None, :] + 1, s_odd * scale,
                         mask=seen_odd & (j_even + 1 < score_keys)[None, :] & score_ok[:, None])
            s_even = tl.where(seen_even, s_even * scale, float("-inf"))
            s_odd = tl.where(seen_odd, s_odd * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.maximum(tl.max(s_even, axis=1), tl.max(s_odd, axis=1)))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
            alpha = tl.exp(m_i - m_safe)
            p_even = tl.exp(s_even - m_safe[:, None])
            p_odd = tl.exp(s_odd - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p_even, axis=1) + tl.sum(p_odd, axis=1)
            m_i = m_new
            a0e *= alpha[:, None]
            a0o *= alpha[:, None]
            a1e *= alpha[:, None]
            a1o *= alpha[:, None]
            u0 = tl.zeros([BLOCK_M, _GROUP // 2], tl.float32)
            u1 = tl.zeros([BLOCK_M, _GROUP // 2], tl.float32)
            for p in range(0, depth + 1):
                a0e, a0o, a1e, a1o, u0, u1 = _plane_values(
                    a0e, a0o, a1e, a1o, u0, u1, p_even, p_odd,
                    _record(base, depth, grp, group_tables_ptr, max_groups, p), kv_head, v_codes_ptr, v_scale_ptr,
                    v_lo_ptr, num_kv_heads, DOT_DTYPE, DOT_FP32, BIAS, HEAD_DIM, V_GROUPS, GW)
            shared = tl.sum(u0, axis=1)[:, None]
            a0e += shared
            a0o += shared
            if V_GROUPS > 1:
                shared = tl.sum(u1, axis=1)[:, None]
                a1e += shared
                a1o += shared
        empty = l_i == 0.0  # nothing sealed at the split's start (the general kernel reads it)
        l_safe = tl.where(empty, 1.0, l_i)
        at = (row * num_heads + head) * (2 * splits) + split
        _store_half(part_o_ptr, at, a0e, a0o, l_safe, 0, GW, BLOCK_D, HEAD_DIM, lane_ok)
        if V_GROUPS > 1:
            _store_half(part_o_ptr, at, a1e, a1o, l_safe, GW, GW, BLOCK_D, HEAD_DIM, lane_ok)
        tl.store(part_lse_ptr + at, tl.where(empty, float("-inf"), m_i + tl.log(l_safe)), mask=lane_ok)


def sealed_pass(q: torch.Tensor, storage: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                tiles_arg: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor, stop: torch.Tensor,
                num_tiles: int, num_splits: int, min_split: int, *, tile_rows: int, has_tiles: bool, num_kv_heads: int,
                max_groups: int, max_len: int, planes: int, block_m: int, block_g: int, block_d: int,
                dot_fp32: bool, dot_dtype, store_scores: bool, scores: torch.Tensor, score_rows: torch.Tensor,
                num_warps: int | None = None, chunk: int = 32, skip_one_row: bool = False) -> None:
    """Launch the sealed pass over (tiles, KV heads, splits): partials in slots 0..splits-1
    of each row's 2 x splits, each program's stop key in `stop` [tiles * Hkv * splits]
    (packed_attention_triton prepares the arguments); with `skip_one_row` its programs of
    one-row tiles do nothing (`packed_sealed_row` reads those)."""
    n, num_heads, head_dim = q.shape
    k_codes, k_scale, k_lo, v_codes, v_scale, v_lo, seal, group_tables, row_maps = storage
    bias = 0 if dot_fp32 else (128 if q.dtype == torch.bfloat16 else 1024)
    cell, depth, position, table_offset = rows
    _sealed_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_codes, k_scale, k_lo, v_codes, v_scale, v_lo, seal, group_tables, row_maps, cell, depth, position,
        table_offset, tiles_arg, part_o, part_lse, stop, scores, score_rows,
        q.stride(0), q.stride(1), scores.stride(0) if store_scores else 0, scores.stride(1) if store_scores else 0,
        scores.shape[2] if store_scores else 0, num_heads, num_kv_heads, max_groups, max_len, head_dim ** -0.5,
        num_splits, min_split, GQA=num_heads // num_kv_heads, BLOCK_G=block_g, TILE_ROWS=tile_rows, HAS_TILES=has_tiles,
        HEAD_DIM=head_dim, PLANES=planes, V_GROUPS=triton.cdiv(head_dim, GROUP), GW=channel_group(head_dim),
        BLOCK_M=block_m, BLOCK_D=block_d, SCAN_GROUPS=SCAN, DOT_FP32=dot_fp32, DOT_DTYPE=dot_dtype, BIAS=bias,
        STORE_SCORES=store_scores, CHUNK=min(chunk, block_d), SKIP_ONE_ROW=skip_one_row,
        **({} if num_warps is None else {"num_warps": num_warps}),
    )
