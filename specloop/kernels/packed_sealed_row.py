"""The sealed pass for one-lane tiles (a decode row of a model without GQA, such as Ouro):
the same scan, stop keys and partial slots as `packed_sealed`, with the codes multiplied on
CUDA cores instead of tensor cores.

Why: a tile of one row and one query head pads `tl.dot`'s M to 16, so the tensor-core pass
spent 15/16 of every product, and turning codes into the products' operand layouts
(through shared memory, with barriers) cost most of its 1.96 G warp instructions at 32 x 8K
(docs/flashloop.md, "The reader's registers and the sealed pass"). Here a code costs two
integer ops and one FMA, and nothing leaves the registers it was loaded into:

- Codes are read as int32 words: a K word holds 4 channels of rows 2i and 2i + 1 (the even
  row in each byte's low nibble), a V word 8 channels of one row (channel 2c in byte c's
  low nibble).
- A word is shifted so that two of its nibbles sit at bits 15..18 and 19..22, and each is
  masked and or-ed into 1.0's mantissa (one LOP3): 1 + c / 256 and 1 + c / 16, exact.
- q * scale (K, per channel) and p * scale (V, per row and 64 channels) are multiplied by
  256 or 16, so each FMA adds scale * c plus 256 or 16 times the scale, a term every key
  (channel) of the group shares; those are summed beside the products and subtracted once
  a group (K) or at the end (V). In fp32 that costs a few low bits (the products hold 256
  or 16 times the code's term), well inside bf16's; fp32 inputs take EXACT instead: 1.0 is
  subtracted from each unit before its FMA (one FADD a code), so the products are fp32's.
- The shared K terms (q . lo, the biases) and the shared V terms (p . lo) are accumulated
  elementwise and summed once a group (K) or once a program (V), so no plane pays a sum
  across lanes.
- Each plane's loads are issued before the plane before it is multiplied; V's even and odd
  rows are [32, 8-word] tiles a channel group, their scale and lo [32] vectors.

A program per (tile, KV head, split) as `packed_sealed`; only tiles of one row take this
pass (the launcher runs it only for GQA 1, and `packed_sealed`'s kernel skips one-row tiles
when this one runs beside it), so the choice needs no host sync. Precision: within the
reference's tolerance, not its bits (module `packed_sealed`). Head dims: multiples of 8,
32..256 (`supported`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specloop.kernels.packed_sealed import GROUP, SCAN, _record, _scan
from specloop.kernels.packed_steps import _tile

_GROUP = tl.constexpr(GROUP)


def supported(head_dim: int) -> bool:
    """Whether the one-lane pass takes this head dim: a multiple of 8 (a V word is 8
    channels of a row) in 32..128 (at most two V channel groups)."""
    return head_dim % 8 == 0 and 32 <= head_dim <= 128


@triton.jit
def _shifted(word, s: tl.constexpr):
    """word << s (s >= 0) or >> -s: nibbles 2j and 2j + 1 to bits 15 and 19 for s = 15 - 8j
    (the bits a right shift brings in from the sign are masked off by `_unit`)."""
    if s >= 0:
        return word << s
    else:
        return word >> (-s)


@triton.jit
def _unit(x, one, AT: tl.constexpr, EXACT: tl.constexpr):
    """The nibble of x at bits AT..AT+3 (AT 15 or 19) as 1 + c * 2^(AT - 23), or with EXACT
    c * 2^(AT - 23). `one` is 1.0's bits as a kernel argument, not a literal: with two
    literals ptxas kept the and and the or apart (two LOP3s a code on sm_90); with one in a
    register they fuse into one LOP3."""
    u = ((x & (15 << AT)) | one).to(tl.float32, bitcast=True)
    if EXACT:
        u -= 1.0
    return u


@triton.jit
def _k_byte(s_even, s_odd, words, one, q256, q16, S: tl.constexpr, EXACT: tl.constexpr):
    """Byte j of every K word (S = 15 - 8j): rows 2i (low nibble, weight q256 = 256 q * scale
    of channel 4w + j) and 2i + 1 (high nibble, q16) of the words' channels."""
    x = _shifted(words, S)
    s_even += _unit(x, one, 15, EXACT) * q256[None, :]
    s_odd += _unit(x, one, 19, EXACT) * q16[None, :]
    return s_even, s_odd


@triton.jit
def _v_words(a0, a1, a2, a3, a4, a5, a6, a7, words, one, w256, w16, EXACT: tl.constexpr):
    """V words [32, CW] of one channel group, into a_k (channel 8w + k of the group): byte j's low nibble (channel 8w + 2j) weighed by w256 = 256 p * scale, its
    high nibble by w16."""
    x = _shifted(words, 15)
    a0 += _unit(x, one, 15, EXACT) * w256
    a1 += _unit(x, one, 19, EXACT) * w16
    x = _shifted(words, 7)
    a2 += _unit(x, one, 15, EXACT) * w256
    a3 += _unit(x, one, 19, EXACT) * w16
    x = _shifted(words, -1)
    a4 += _unit(x, one, 15, EXACT) * w256
    a5 += _unit(x, one, 19, EXACT) * w16
    x = _shifted(words, -9)
    a6 += _unit(x, one, 15, EXACT) * w256
    a7 += _unit(x, one, 19, EXACT) * w16
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _k_plane(rec, kv_head, i, w, w_ok, c4, c_ok, k_words_ptr, k_scale_ptr, k_lo_ptr, num_kv_heads,
             HEAD_DIM: tl.constexpr):
    """One plane's K of the group, record `rec` (none loaded for -1): words [32, KW], scale and
    lo [KW, 4] (channel 4w + j)."""
    r = rec.to(tl.int64)
    on = (tl.zeros_like(w) + rec) >= 0  # (a scalar in a vector mask fails under the interpreter)
    words = tl.load(k_words_ptr + ((r * (_GROUP // 2) + i) * num_kv_heads + kv_head)[:, None] * (HEAD_DIM // 4)
                    + w[None, :], mask=(w_ok & on)[None, :], other=0)
    at = (r * num_kv_heads + kv_head) * HEAD_DIM + c4
    ok = c_ok & on[:, None]
    return words, tl.load(k_scale_ptr + at, mask=ok, other=0.0), tl.load(k_lo_ptr + at, mask=ok, other=0.0)


@triton.jit
def _plane_scores(s_even, s_odd, terms, qsum, q4, one, words, k_scale, k_lo, EXACT: tl.constexpr):
    """One plane's share of the group's even and odd rows' scores ([32, KW] each, summed over
    words by the caller) from its `_k_plane`; q4 [KW, 4] is 16 q at channel 4w + j."""
    qs16 = q4 * k_scale.to(tl.float32)
    terms += q4 * k_lo.to(tl.float32)
    if not EXACT:
        qsum += qs16
    a, b = tl.split(tl.reshape(qs16, [qs16.shape[0], 2, 2]))  # channels 4w + 2x, 4w + 2x + 1
    q0, q2 = tl.split(a)
    q1, q3 = tl.split(b)
    s_even, s_odd = _k_byte(s_even, s_odd, words, one, q0 * 16.0, q0, 15, EXACT)
    s_even, s_odd = _k_byte(s_even, s_odd, words, one, q1 * 16.0, q1, 7, EXACT)
    s_even, s_odd = _k_byte(s_even, s_odd, words, one, q2 * 16.0, q2, -1, EXACT)
    s_even, s_odd = _k_byte(s_even, s_odd, words, one, q3 * 16.0, q3, -9, EXACT)
    return s_even, s_odd, terms, qsum


@triton.jit
def _v_plane(rec, kv_head, i, cw, g: tl.constexpr, v_words_ptr, v_scale_ptr, v_lo_ptr, num_kv_heads,
             HEAD_DIM: tl.constexpr, V_GROUPS: tl.constexpr):
    """Channel group g (64 channels, 8 words a row) of one plane's V rows of the group,
    record `rec` (none loaded for -1): words of the even rows 2i and the odd rows [32, CW],
    and their scale and lo, [32] each. As [32] vectors broadcast over the words: a gather
    of them shaped like the words took a layout of its own, and every product then went
    through shared memory (about 30 barriers a plane on sm_90)."""
    r = rec.to(tl.int64)
    on = (tl.zeros_like(i) + rec) >= 0
    even = (r * _GROUP + 2 * i) * num_kv_heads + kv_head
    odd = even + num_kv_heads
    word = g * 8 + cw
    ok = on[:, None] & (word < HEAD_DIM // 8)[None, :]
    we = tl.load(v_words_ptr + even[:, None] * (HEAD_DIM // 8) + word[None, :], mask=ok, other=0)
    wo = tl.load(v_words_ptr + odd[:, None] * (HEAD_DIM // 8) + word[None, :], mask=ok, other=0)
    se = tl.load(v_scale_ptr + even * V_GROUPS + g, mask=on, other=0.0)
    so = tl.load(v_scale_ptr + odd * V_GROUPS + g, mask=on, other=0.0)
    le = tl.load(v_lo_ptr + even * V_GROUPS + g, mask=on, other=0.0)
    lo = tl.load(v_lo_ptr + odd * V_GROUPS + g, mask=on, other=0.0)
    return we, wo, se, so, le, lo


@triton.jit
def _group_values(a0, a1, a2, a3, a4, a5, a6, a7, u, psum, p_even, p_odd, one, we, wo, se, so, le, lo,
                  EXACT: tl.constexpr):
    """A channel group's plane (`_v_plane`) into a_k [32, CW] (channel 8w + k, row slot i:
    rows 2i and 2i + 1 summed), the shared terms p . lo into u [32] and p * scale into
    psum [32]."""
    pe = p_even * se.to(tl.float32)
    po = p_odd * so.to(tl.float32)
    u += p_even * le.to(tl.float32) + p_odd * lo.to(tl.float32)
    if not EXACT:
        psum += pe + po
    a0, a1, a2, a3, a4, a5, a6, a7 = _v_words(a0, a1, a2, a3, a4, a5, a6, a7, we, one, (pe * 256.0)[:, None],
                                              (pe * 16.0)[:, None], EXACT)
    return _v_words(a0, a1, a2, a3, a4, a5, a6, a7, wo, one, (po * 256.0)[:, None], (po * 16.0)[:, None], EXACT) + (
        u, psum)


@triton.jit
def _store_group(part_o_ptr, at, a0, a1, a2, a3, a4, a5, a6, a7, u, psum, l_safe, cw, g: tl.constexpr,
                 BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, EXACT: tl.constexpr):
    """Channel group g of the partial: channel 64g + 8w + k is a_k summed over the rows, plus
    the shared terms, less (without EXACT) 256 (even k) or 16 (odd k) times sum p * scale,
    normalised."""
    shared = tl.sum(u, axis=0)
    bias = tl.sum(psum, axis=0)
    ch = g * 64 + 8 * cw
    ok = ch < HEAD_DIM
    out = part_o_ptr + at * BLOCK_D + ch
    even = shared - 256.0 * bias
    odd = shared - 16.0 * bias
    tl.store(out, (tl.sum(a0, axis=0) + even) / l_safe, mask=ok)
    tl.store(out + 1, (tl.sum(a1, axis=0) + odd) / l_safe, mask=ok)
    tl.store(out + 2, (tl.sum(a2, axis=0) + even) / l_safe, mask=ok)
    tl.store(out + 3, (tl.sum(a3, axis=0) + odd) / l_safe, mask=ok)
    tl.store(out + 4, (tl.sum(a4, axis=0) + even) / l_safe, mask=ok)
    tl.store(out + 5, (tl.sum(a5, axis=0) + odd) / l_safe, mask=ok)
    tl.store(out + 6, (tl.sum(a6, axis=0) + even) / l_safe, mask=ok)
    tl.store(out + 7, (tl.sum(a7, axis=0) + odd) / l_safe, mask=ok)


@triton.jit(do_not_specialize=["splits", "min_split", "one"],
            do_not_specialize_on_alignment=["cell_ptr", "depth_ptr", "position_ptr", "table_offset_ptr", "tiles_ptr",
                                            "scores_ptr", "score_rows_ptr"])
def _row_kernel(
    q_ptr, k_words_ptr, k_scale_ptr, k_lo_ptr, v_words_ptr, v_scale_ptr, v_lo_ptr, seal_ptr, group_tables_ptr,
    row_maps_ptr, cell_ptr, depth_ptr, position_ptr, table_offset_ptr, tiles_ptr, part_o_ptr, part_lse_ptr,
    stop_ptr, scores_ptr, score_rows_ptr,
    stride_qn, stride_qh, stride_sr, stride_sh, score_keys, num_heads, num_kv_heads, max_groups, max_len, scale,
    splits, min_split, one,
    HAS_TILES: tl.constexpr, HEAD_DIM: tl.constexpr, PLANES: tl.constexpr, V_GROUPS: tl.constexpr,
    KW: tl.constexpr, CW: tl.constexpr, BLOCK_D: tl.constexpr, SCAN_GROUPS: tl.constexpr, EXACT: tl.constexpr,
    STORE_SCORES: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    first, rows, table = _tile(tile, tiles_ptr, table_offset_ptr, HAS_TILES)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if rows == 1:  # (longer tiles are the tensor-core pass's; padding tiles have none)
        pos = tl.load(position_ptr + first).to(tl.int32)
        if pos >= 0:
            chunk = tl.maximum(tl.cdiv(tl.cdiv(pos + 1, splits), _GROUP) * _GROUP, min_split)
            lo = split * chunk
            hi = tl.minimum(pos + 1, lo + chunk)
            end = lo + tl.maximum(hi - lo, 0) // _GROUP * _GROUP
            cell = tl.load(cell_ptr + first).to(tl.int64)
            depth = tl.load(depth_ptr + first).to(tl.int32)
            base = cell * PLANES
            stop = _scan(lo, end, pos, base, depth, seal_ptr, group_tables_ptr, row_maps_ptr, max_groups, max_len,
                         PLANES, SCAN_GROUPS)
            tl.store(stop_ptr + (tile * num_kv_heads + kv_head) * splits + split, stop)
            head = kv_head  # GQA 1
            score_row = scores_ptr
            score_ok = pos >= 0
            if STORE_SCORES:
                score_at = tl.load(score_rows_ptr + first).to(tl.int64)
                score_row = scores_ptr + score_at * stride_sr + head * stride_sh
                score_ok = score_at >= 0
            i = tl.arange(0, _GROUP // 2)
            w = tl.arange(0, KW)
            w_ok = w < HEAD_DIM // 4
            c4 = w[:, None] * 4 + tl.arange(0, 4)[None, :]
            c_ok = c4 < HEAD_DIM
            q4 = tl.load(q_ptr + first * stride_qn + head * stride_qh + c4, mask=c_ok, other=0.0).to(tl.float32) * 16.0
            cw = tl.arange(0, CW)
            m_i = tl.max(tl.full([2], float("-inf"), tl.float32), axis=0)
            l_i = tl.sum(tl.zeros([2], tl.float32), axis=0)
            a0 = tl.zeros([_GROUP // 2, CW], tl.float32)  # channel group 0
            a1 = tl.zeros_like(a0)
            a2 = tl.zeros_like(a0)
            a3 = tl.zeros_like(a0)
            a4 = tl.zeros_like(a0)
            a5 = tl.zeros_like(a0)
            a6 = tl.zeros_like(a0)
            a7 = tl.zeros_like(a0)
            b0 = tl.zeros_like(a0)  # channel group 1
            b1 = tl.zeros_like(a0)
            b2 = tl.zeros_like(a0)
            b3 = tl.zeros_like(a0)
            b4 = tl.zeros_like(a0)
            b5 = tl.zeros_like(a0)
            b6 = tl.zeros_like(a0)
            b7 = tl.zeros_like(a0)
            u0 = tl.zeros([_GROUP // 2], tl.float32)
            u1 = tl.zeros_like(u0)
            psum0 = tl.zeros_like(u0)
            psum1 = tl.zeros_like(u0)
            for start in range(lo, stop, _GROUP):
                grp = start // _GROUP
                s_even = tl.zeros([_GROUP // 2, KW], tl.float32)
                s_odd = tl.zeros([_GROUP // 2, KW], tl.float32)
                terms = tl.zeros_like(q4)
                qsum = tl.zeros_like(q4)
                # each plane's loads are issued before the plane before it is multiplied
                kw_at, ks_at, kl_at = _k_plane(_record(base, depth, grp, group_tables_ptr, max_groups, 0), kv_head, i,
                                               w, w_ok, c4, c_ok, k_words_ptr, k_scale_ptr, k_lo_ptr, num_kv_heads,
                                               HEAD_DIM)
                for pl in range(0, depth + 1):
                    kw_next, ks_next, kl_next = _k_plane(
                        _record(base, depth, grp, group_tables_ptr, max_groups, pl + 1), kv_head, i, w, w_ok, c4, c_ok,
                        k_words_ptr, k_scale_ptr, k_lo_ptr, num_kv_heads, HEAD_DIM)
                    s_even, s_odd, terms, qsum = _plane_scores(s_even, s_odd, terms, qsum, q4, one, kw_at, ks_at,
                                                               kl_at, EXACT)
                    kw_at, ks_at, kl_at = kw_next, ks_next, kl_next
                # (q4 is 16 q: the shared terms and the biases, 256 and 16 q * scale, are 1/16 of
                # 16 q . lo, 256 and 16 times qsum / 16)
                shared = tl.sum(tl.sum(terms, axis=1), axis=0) * 0.0625
                sq = tl.sum(tl.sum(qsum, axis=1), axis=0)
                s_even = tl.sum(s_even, axis=1) + (shared - 16.0 * sq)
                s_odd = tl.sum(s_odd, axis=1) + (shared - sq)
                key = start + 2 * i
                if STORE_SCORES:
                    keep = (key < score_keys) & score_ok
                    tl.store(score_row + key, s_even * scale, mask=keep)
                    tl.store(score_row + key + 1, s_odd * scale, mask=(key + 1 < score_keys) & score_ok)
                s_even *= scale
                s_odd *= scale
                m_new = tl.maximum(m_i, tl.maximum(tl.max(s_even, axis=0), tl.max(s_odd, axis=0)))
                alpha = tl.exp(m_i - m_new)
                p_even = tl.exp(s_even - m_new)
                p_odd = tl.exp(s_odd - m_new)
                l_i = l_i * alpha + tl.sum(p_even, axis=0) + tl.sum(p_odd, axis=0)
                m_i = m_new
                a0, a1, a2, a3, a4, a5, a6, a7 = a0 * alpha, a1 * alpha, a2 * alpha, a3 * alpha, a4 * alpha, \
                    a5 * alpha, a6 * alpha, a7 * alpha
                u0 *= alpha
                psum0 *= alpha
                if V_GROUPS > 1:
                    b0, b1, b2, b3, b4, b5, b6, b7 = b0 * alpha, b1 * alpha, b2 * alpha, b3 * alpha, b4 * alpha, \
                        b5 * alpha, b6 * alpha, b7 * alpha
                    u1 *= alpha
                    psum1 *= alpha
                rec = _record(base, depth, grp, group_tables_ptr, max_groups, 0)
                we0, wo0, se0, so0, le0, lo0 = _v_plane(rec, kv_head, i, cw, 0, v_words_ptr, v_scale_ptr, v_lo_ptr,
                                                        num_kv_heads, HEAD_DIM, V_GROUPS)
                if V_GROUPS > 1:
                    we1, wo1, se1, so1, le1, lo1 = _v_plane(rec, kv_head, i, cw, 1, v_words_ptr, v_scale_ptr, v_lo_ptr,
                                                            num_kv_heads, HEAD_DIM, V_GROUPS)
                for pl in range(0, depth + 1):
                    rec = _record(base, depth, grp, group_tables_ptr, max_groups, pl + 1)
                    nwe0, nwo0, nse0, nso0, nle0, nlo0 = _v_plane(rec, kv_head, i, cw, 0, v_words_ptr, v_scale_ptr,
                                                                  v_lo_ptr, num_kv_heads, HEAD_DIM, V_GROUPS)
                    a0, a1, a2, a3, a4, a5, a6, a7, u0, psum0 = _group_values(
                        a0, a1, a2, a3, a4, a5, a6, a7, u0, psum0, p_even, p_odd, one, we0, wo0, se0, so0, le0, lo0,
                        EXACT)
                    we0, wo0, se0, so0, le0, lo0 = nwe0, nwo0, nse0, nso0, nle0, nlo0
                    if V_GROUPS > 1:
                        nwe1, nwo1, nse1, nso1, nle1, nlo1 = _v_plane(rec, kv_head, i, cw, 1, v_words_ptr, v_scale_ptr,
                                                                      v_lo_ptr, num_kv_heads, HEAD_DIM, V_GROUPS)
                        b0, b1, b2, b3, b4, b5, b6, b7, u1, psum1 = _group_values(
                            b0, b1, b2, b3, b4, b5, b6, b7, u1, psum1, p_even, p_odd, one, we1, wo1, se1, so1, le1,
                            lo1, EXACT)
                        we1, wo1, se1, so1, le1, lo1 = nwe1, nwo1, nse1, nso1, nle1, nlo1
            empty = l_i == 0.0  # nothing sealed at the split's start (the general kernel reads it)
            l_safe = tl.where(empty, 1.0, l_i)
            at = (first * num_heads + head) * (2 * splits) + split
            _store_group(part_o_ptr, at, a0, a1, a2, a3, a4, a5, a6, a7, u0, psum0, l_safe, cw, 0, BLOCK_D, HEAD_DIM,
                         EXACT)
            if V_GROUPS > 1:
                _store_group(part_o_ptr, at, b0, b1, b2, b3, b4, b5, b6, b7, u1, psum1, l_safe, cw, 1, BLOCK_D,
                             HEAD_DIM, EXACT)
            tl.store(part_lse_ptr + at, tl.where(empty, float("-inf"), m_i + tl.log(l_safe)))


def row_pass(q: torch.Tensor, storage: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
             tiles_arg: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor, stop: torch.Tensor,
             num_tiles: int, num_splits: int, min_split: int, *, has_tiles: bool, num_kv_heads: int, max_groups: int, max_len: int,
             planes: int, block_d: int, exact: bool, store_scores: bool, scores: torch.Tensor,
             score_rows: torch.Tensor, num_warps: int | None = None) -> None:
    """Launch the one-lane pass over (tiles, KV heads, splits) for the one-row tiles (every
    row without tiles); the arguments as `packed_sealed.sealed_pass` takes them, GQA 1."""
    n, num_heads, head_dim = q.shape
    assert num_heads == num_kv_heads, "the one-lane pass reads tiles of one query head a KV head"
    k_codes, k_scale, k_lo, v_codes, v_scale, v_lo, seal, group_tables, row_maps = storage
    k_words = k_codes.view(torch.int32)  # [NG, 32, Hkv, D / 4]
    v_words = v_codes.view(torch.int32)  # [NG * 64, Hkv, D / 8]
    cell, depth, position, table_offset = rows
    _row_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_words, k_scale, k_lo, v_words, v_scale, v_lo, seal, group_tables, row_maps, cell, depth, position,
        table_offset, tiles_arg, part_o, part_lse, stop, scores, score_rows,
        q.stride(0), q.stride(1), scores.stride(0) if store_scores else 0, scores.stride(1) if store_scores else 0,
        scores.shape[2] if store_scores else 0, num_heads, num_kv_heads, max_groups, max_len, head_dim ** -0.5,
        num_splits, min_split, 0x3F800000, HAS_TILES=has_tiles, HEAD_DIM=head_dim, PLANES=planes, V_GROUPS=triton.cdiv(head_dim, GROUP),
        KW=triton.next_power_of_2(head_dim // 4), CW=min(8, triton.next_power_of_2(head_dim // 8)), BLOCK_D=block_d,
        SCAN_GROUPS=SCAN, EXACT=exact, STORE_SCORES=store_scores,
        **({} if num_warps is None else {"num_warps": num_warps}),
    )
