"""Steps the packed reader's two kernels share (`packed_attention`'s general kernel and
`packed_sealed`'s sealed pass): a tile's header, the product in DT or IEEE fp32, and one key
block's online-softmax step."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _tile(t, tiles_ptr, table_offset_ptr, HAS_TILES: tl.constexpr):
    """(first row, rows, table offset) of tile t; without tiles, tile t is row t."""
    if HAS_TILES:
        first = tl.load(tiles_ptr + t * 3).to(tl.int64)
        rows = tl.load(tiles_ptr + t * 3 + 1).to(tl.int32)
        table = tl.load(tiles_ptr + t * 3 + 2).to(tl.int64)
    else:
        first = t
        rows = 1
        table = tl.load(table_offset_ptr + t).to(tl.int64)
    return first, rows, table


@triton.jit
def _online(s, seen, j, m_i, l_i, scale, score_row, score_ok, score_keys, STORE_SCORES: tl.constexpr):
    """One key block's online-softmax step on raw scores s [M, N]: the probabilities (not
    yet normalised), the factor the accumulator is rescaled by, and the new max and sum;
    with STORE_SCORES the scaled scores of the seen keys go to each lane's scores row."""
    if STORE_SCORES:  # never past a scores row
        keep = seen & (j < score_keys)[None, :] & score_ok[:, None]
        tl.store(score_row[:, None] + j[None, :], s * scale, mask=keep)
    s = tl.where(seen, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)
