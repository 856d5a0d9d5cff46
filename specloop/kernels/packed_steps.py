"""Steps the packed reader's two kernels share (`packed_attention`'s general kernel and
`packed_sealed`'s sealed pass): a tile's header and lanes, each lane's scores row, the
product in DT or IEEE fp32, and one key block's online-softmax step."""

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


@triton.jit
def _lanes(tiles_ptr, table_offset_ptr, position_ptr, HAS_TILES: tl.constexpr, GQA: tl.constexpr,
           BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, TILE_ROWS: tl.constexpr):
    """The program's tile and its M lanes, (row of the tile, query head of the KV head):
    first row, rows, table offset, each lane's row r and head g within the KV head, its row
    index and position (-1 past the tile's rows), whether it is a real lane, and the tile's
    context (max position + 1; 0 for a padding tile)."""
    first, rows, table = _tile(tl.program_id(0).to(tl.int64), tiles_ptr, table_offset_ptr, HAS_TILES)
    i = tl.arange(0, BLOCK_M)
    r = i // BLOCK_G
    g = i % BLOCK_G
    row = first + r
    pos = tl.load(position_ptr + row, mask=(r < rows) & (r < TILE_ROWS), other=-1).to(tl.int32)
    lane_ok = (pos >= 0) & (g < GQA)
    return first, rows, table, r, g, row, pos, lane_ok, tl.max(pos, axis=0) + 1


@triton.jit
def _score_rows(scores_ptr, score_rows_ptr, row, r, rows, head, lane_ok, stride_sr, stride_sh,
                TILE_ROWS: tl.constexpr, STORE_SCORES: tl.constexpr):
    """Each lane's scores row pointer and whether it keeps scores (STORE_SCORES: rows with
    a scores row, -1 for none; otherwise placeholders, never read)."""
    score_row = scores_ptr
    score_ok = lane_ok
    if STORE_SCORES:
        score_at = tl.load(score_rows_ptr + row, mask=(r < rows) & (r < TILE_ROWS), other=-1).to(tl.int64)
        score_row = scores_ptr + score_at * stride_sr + head * stride_sh
        score_ok = lane_ok & (score_at >= 0)
    return score_row, score_ok
