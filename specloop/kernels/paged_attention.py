"""Paged attention for mixed-depth rows in Triton, with its torch reference.

    out, lse = paged_attention(q, k_cache, v_cache, tables, positions, tiles, page_size,
                               tile_rows=..., num_splits=...)

One kernel serves every row a forward call holds: a decode row, a verification's k+1 rows,
a prompt chunk. Rows come in *query tiles*: up to `tile_rows` consecutive rows of one row
group, which share the group's page table (one depth plane of one request).

- q [N, Hq, D]: the call's query rows, already rotated;
- k_cache, v_cache [S, Hkv, D]: one layer of the KV pool, S = pages * page_size;
- tables [T] int: page tables, flat; key j of a tile sits at
  tables[table + j // page_size] * page_size + j % page_size;
- positions [N] int: each row's absolute position; row i reads keys j <= positions[i]
  (causal by position, so positions need not be consecutive or sorted);
- tiles [M, 3] int: (first row, rows, table offset) per tile; tiles with 0 rows are padding
  (a CUDA graph launches a fixed grid and a plan fills fewer tiles);
- returns out [N, Hq, D] (q's dtype) and, with `return_lse`, lse [N, Hq] (fp32 natural log
  of the softmax denominator of the scaled scores; sparse decode attention needs it).
  Rows no tile covers are left unwritten.
- `scores` / `score_rows` (optional, STORE_SCORES): each row with a scores row r >= 0 also
  stores its scaled scores of keys 0..pos (below `keys`) into scores[r] (fp32, [R, Hq, keys]), which
  sparse decode's select kernel reads (`sparse_decode.decode_select`) instead of reading
  K a second time.

Inside a program the M dimension of the score tile is (row of the tile, query head of the
KV head), so GQA heads and a verification's rows share every key tile that is loaded.
Split-KV (flash decoding): `num_splits` programs per (tile, KV head) each take an equal
share of the tile's keys [0, max position + 1) and write a partial output and its
log-sum-exp; a second kernel combines them. That is what fills the GPU at batch 1 and at
long contexts. Softmax statistics are fp32; QK and PV run on tensor cores in the input
dtype with fp32 accumulation, the probabilities rounded to that dtype for PV as flash
attention does (fp32 inputs use IEEE fp32 products). An IEEE fp32 PV product for bf16
decodes measured 2.6x slower attention at batch 32 on the H200 for no gain in the
logprob error (bench/results/model_check_ouro-1.4b.json), so it is not used. Under
`TRITON_INTERPRET=1` tiles are cast to fp32 before `tl.dot` (the interpreter's bf16 dot
is wrong, ../shared/docs/gpu.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from specloop.kernels import pdl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TILE_COLUMNS = 3  # first row, rows, table offset
# Key blocks of every launch, whatever its tile size: a row's output then does not depend on
# the tiles it was cut into (graph replays of decode tiles and eager prompt tiles agree bit
# for bit). On the H100 an 8K prompt's chunks ran at 238 TFLOP/s with block_n 32 and 4
# stages against 213 with 64 (bench/results/prefill_attention_sweep_h100.json), 279 with
# 128-row tiles, block_n 128 and 8 warps: decode tiles would need the same block_n.
BLOCK_N = 64


@triton.jit
def qk(q, k, DOT_FP32: tl.constexpr):
    """Scores q . k^T [M, N] with fp32 accumulation (IEEE fp32 products for fp32 tiles)."""
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s


@triton.jit
def online_softmax(s, v, m_i, l_i, acc, DOT_FP32: tl.constexpr):
    """One key block of flash attention's online softmax: `s` the scaled scores (-inf where
    hidden), `v` the block's values; returns the new running max, denominator and output.
    Rows with nothing visible yet keep max -inf and add nothing. The probabilities go to v's
    dtype for the PV product (fp32 tiles: IEEE products), as flash attention does."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, positions_ptr, tiles_ptr, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr,
    scores_ptr, score_rows_ptr,
    stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_on, stride_oh, stride_ln,
    stride_sr, stride_sh, score_keys, num_heads, scale,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr, WRITE_LSE: tl.constexpr, STORE_SCORES: tl.constexpr, RELEASE: tl.constexpr,
):
    if RELEASE:  # (unsplit) a programmatic dependent launch after it may start now (`pdl`)
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    first = tl.load(tiles_ptr + tile * 3)
    rows = tl.load(tiles_ptr + tile * 3 + 1)
    table = tl.load(tiles_ptr + tile * 3 + 2)
    if rows > 0:
        BLOCK_M: tl.constexpr = TILE_ROWS * BLOCK_G
        i = tl.arange(0, BLOCK_M)
        r = i // BLOCK_G
        g = i % BLOCK_G
        r_ok = r < rows
        ok = r_ok & (g < GROUP)
        row = (first + r).to(tl.int64)
        head = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        pos = tl.load(positions_ptr + row, mask=r_ok, other=-1)
        if STORE_SCORES:  # each row's scores row, -1 for none
            score_at = tl.load(score_rows_ptr + row, mask=r_ok, other=-1).to(tl.int64)
            score_row = scores_ptr + score_at * stride_sr + head * stride_sh
        context = tl.max(pos, axis=0) + 1
        chunk = tl.cdiv(tl.cdiv(context, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(context, lo + chunk)
        q = tl.load(q_ptr + row[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Key blocks below the tile's lowest position are visible to every row: no masks there
        # (a prompt chunk's whole context but its diagonal); the rest is masked per pair.
        lowest = tl.min(tl.where(r_ok, pos, 2147483647), axis=0)
        open_hi = tl.minimum(hi, tl.maximum(lo, (lowest + 1) // BLOCK_N * BLOCK_N))
        for start in range(lo, open_hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            page = tl.load(tables_ptr + table + j // PAGE_SIZE).to(tl.int64)
            slot = page * PAGE_SIZE + j % PAGE_SIZE
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=d_ok[None, :], other=0.0)
            s = qk(q, k, DOT_FP32) * scale
            if STORE_SCORES:
                keep = (j < score_keys)[None, :] & (ok & (score_at >= 0))[:, None]
                tl.store(score_row[:, None] + j[None, :], s, mask=keep)
            m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, DOT_FP32)
        for start in range(open_hi, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            j_ok = j < hi
            page = tl.load(tables_ptr + table + j // PAGE_SIZE, mask=j_ok, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + j % PAGE_SIZE
            kv_mask = j_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
            s = qk(q, k, DOT_FP32)
            visible = j_ok[None, :] & (j[None, :] <= pos[:, None])
            if STORE_SCORES:
                keep = visible & (j < score_keys)[None, :] & (ok & (score_at >= 0))[:, None]  # never past a row
                tl.store(score_row[:, None] + j[None, :], s * scale, mask=keep)
            s = tl.where(visible, s * scale, float("-inf"))
            m_i, l_i, acc = online_softmax(s, v, m_i, l_i, acc, DOT_FP32)
        empty = l_i == 0.0  # a split past a row's position
        l_safe = tl.where(empty, 1.0, l_i)
        o = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log(l_safe))
        if SPLITS == 1:
            tl.store(out_ptr + row[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])
            if WRITE_LSE:
                tl.store(lse_ptr + row * stride_ln + head, lse, mask=ok)
        else:
            at = (row * num_heads + head) * SPLITS + split
            tl.store(part_o_ptr + at[:, None] * BLOCK_D + d[None, :], o, mask=ok[:, None])
            tl.store(part_lse_ptr + at, lse, mask=ok)


@triton.jit
def _combine_kernel(
    part_o_ptr, part_lse_ptr, tiles_ptr, out_ptr, lse_ptr, stride_on, stride_oh, stride_ln, num_heads,
    HEAD_DIM: tl.constexpr, TILE_ROWS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr, RELEASE: tl.constexpr,
):
    """Per (tile, query head): weight each split's output by exp(lse_s - lse) and sum.
    RELEASE: a programmatic dependent launch after it may start now (`pdl`)."""
    if RELEASE:
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(tiles_ptr + tile * 3)
    rows = tl.load(tiles_ptr + tile * 3 + 1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < SPLITS
    for r in range(0, rows):
        row = (first + r).to(tl.int64)
        at = (row * num_heads + head) * SPLITS + s
        lse_s = tl.load(part_lse_ptr + at, mask=s_ok, other=float("-inf"))
        top = tl.max(lse_s, axis=0)
        w = tl.exp(lse_s - top)
        total = tl.sum(w, axis=0)
        o = tl.load(part_o_ptr + at[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
        o = tl.sum(w[:, None] * o, axis=0) / total
        tl.store(out_ptr + row * stride_on + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
        if WRITE_LSE:
            tl.store(lse_ptr + row * stride_ln + head, top + tl.log(total))


def launch_options(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    """Triton launch options given (None: the default)."""
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return {name: value for name, value in options.items() if value is not None}


def block_g(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head, padded to a power of two (the M dimension's inner factor)."""
    return triton.next_power_of_2(num_heads // num_kv_heads)


def query_tiles(groups: Iterable[tuple[int, int, int]], tile_rows: int) -> list[int]:
    """Flat tile columns for groups given as (first row, rows, table offset): each group is
    cut into tiles of at most `tile_rows` rows (the host side of the launch)."""
    out: list[int] = []
    for first, rows, table in groups:
        for start in range(0, rows, tile_rows):
            out.extend((first + start, min(tile_rows, rows - start), table))
    return out


def check_scores(scores: torch.Tensor | None, score_rows: torch.Tensor | None, n: int, num_heads: int) -> bool:
    """Whether a launch over n rows keeps scores (`scores` fp32 [R, Hq, keys], `score_rows`
    [N] int, -1 for none); asserts their layout (here and in `packed_attention`)."""
    if scores is None:
        return False
    assert (scores.dtype == torch.float32 and scores.dim() == 3 and scores.shape[1] == num_heads
            and scores.stride(2) == 1), "scores: fp32 [rows, Hq, keys]"
    assert (score_rows is not None and score_rows.shape == (n,) and score_rows.is_contiguous()
            and not score_rows.is_floating_point()), "score_rows: [N] ints"
    return True


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    positions: torch.Tensor, tiles: torch.Tensor, page_size: int, *, tile_rows: int,
                    num_splits: int = 1, block_n: int | None = None, return_lse: bool = False,
                    out: torch.Tensor | None = None, scores: torch.Tensor | None = None,
                    score_rows: torch.Tensor | None = None, num_warps: int | None = None,
                    num_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch (tiles, KV heads, splits) programs, plus the combine when split. `tiles` must
    have been cut with at most `tile_rows` rows each; tile_rows x block_g >= 16 (tl.dot).
    With `scores` (fp32 [R, Hq, >= every scored row's position + 1]) and `score_rows` ([N]
    int, -1 for none), row i's scaled scores q . k / sqrt(D) of keys 0..pos also go to
    scores[score_rows[i]] (sparse decode's loop-2 source reads them: no second pass over K).
    `block_n`, `num_warps`, `num_stages`: the launch's (None: `BLOCK_N`, Triton's defaults)."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim, "K and V caches must be [S, Hkv, D]"
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, "the head dim must be contiguous"
    assert tiles.dim() == 2 and tiles.shape[1] == TILE_COLUMNS and tiles.is_contiguous()
    bg = block_g(num_heads, num_kv_heads)
    assert tile_rows * bg >= 16, "a tile's M dimension (tile_rows x padded GQA group) must be at least 16"
    block_d = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(n, num_heads, dtype=torch.float32, device=q.device) if return_lse else None
    num_tiles = tiles.shape[0]
    if n == 0 or num_tiles == 0:
        return out, lse
    lse_arg = lse if lse is not None else out  # never written without WRITE_LSE
    part_o = part_lse = out
    if num_splits > 1:
        part_o = torch.empty(n * num_heads * num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(n * num_heads * num_splits, dtype=torch.float32, device=q.device)
    dot_fp32 = _INTERPRET or q.dtype == torch.float32
    store_scores = check_scores(scores, score_rows, n, num_heads)
    block_n = block_n or BLOCK_N
    _attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, tables, positions, tiles, out, lse_arg, part_o, part_lse,
        scores if store_scores else out, score_rows if store_scores else positions,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
        scores.stride(0) if store_scores else 0, scores.stride(1) if store_scores else 0,
        scores.shape[2] if store_scores else 0, num_heads, head_dim ** -0.5,
        PAGE_SIZE=page_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, TILE_ROWS=tile_rows,
        BLOCK_G=bg, BLOCK_N=block_n, BLOCK_D=block_d, SPLITS=num_splits, DOT_FP32=dot_fp32,
        WRITE_LSE=return_lse, STORE_SCORES=store_scores, RELEASE=num_splits == 1 and pdl.release(q),
        **launch_options(num_warps, num_stages),
    )
    if num_splits > 1:
        _combine_kernel[(num_tiles, num_heads)](
            part_o, part_lse, tiles, out, lse_arg, out.stride(0), out.stride(1),
            lse.stride(0) if lse is not None else 0, num_heads,
            HEAD_DIM=head_dim, TILE_ROWS=tile_rows, SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, WRITE_LSE=return_lse,
            RELEASE=pdl.release(q),
        )
    return out, lse


def choose_splits(num_tiles: int, num_kv_heads: int, max_context: int, num_sms: int,
                  min_keys: int = 256, max_splits: int = 32) -> int:
    """Splits per (tile, KV head): enough programs for two waves of the GPU, but no split
    shorter than `min_keys` keys (a split's fixed cost is its partial write and the combine)."""
    programs = max(1, num_tiles * num_kv_heads)
    want = -(-2 * num_sms // programs)
    return max(1, min(want, max_splits, max_context // min_keys))


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                              positions: torch.Tensor, tiles: torch.Tensor,
                              page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, row by row in plain PyTorch (fp32 scores, softmax and weighted sum); rows
    no tile covers come back as zeros (lse -inf)."""
    n, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((n, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for first, rows, table in tiles.tolist():
        for i in range(first, first + rows):
            j = torch.arange(int(positions[i]) + 1, device=q.device)
            slots = tables[table + j // page_size].long() * page_size + j % page_size
            k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
            v = v_cache[slots].float().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * head_dim ** -0.5
            lse[i] = torch.logsumexp(scores, dim=-1)
            out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out, lse
