"""A prompt chunk's attention over two key sources in Triton, with its torch reference.

    out = two_source_attention(q, k_read, v_read, k_tail, v_tail, tables, table, page_size,
                               positions, seals, last)

A prompt chunk over FlashLoop's packed planes (`specloop.flashloop.kv_residual.chunks`):
rows of one request at one depth plane, at `positions` (any order; causal by position), reading
keys [0, C), C = the largest position + 1. Each key j has a seal (int32 [C]: the first query
position that reads it reconstructed; 2^31 - 1 for none) and the read rule is: a query at q
reads j reconstructed iff q >= seal[j], exact otherwise.

- k_read, v_read [C, Hkv, D]: every key as the chunk's last query (position `last`, a [1]
  int tensor on the device) reads it (`packed_keys.read_keys`): reconstructed where
  last >= seal, exact elsewhere;
- k_tail, v_tail [S, Hkv, D]: one layer of the BF16 pages (the exact values), key j at
  tables[table + j // page_size] * page_size + j % page_size, as in `paged_attention`.

So a pair (q, j <= q) reads k_read[j] unless q < seal[j] <= last (j seals inside the chunk,
after q): then the tail. Only the keys that seal inside the chunk (at most the chunk's rows
plus a group, per plane) are ever read from the tail. Keys below both the tile's lowest
row and the tile's band (the first key sealing after that row and by the chunk's last query,
found by a binary search over `seal_reach`) are read as unmasked contiguous blocks, as in a
dense prefill; the blocks above are masked per pair, and one holding keys that seal inside
the chunk also loads their tail slots (masked to them: the tail pages of keys nobody reads
exact may be gone) and picks per pair. (With every block masked, the kernel took 425 ms of
an 8K prompt's first token on the H100 at 1c126c0, 2.6x the dense kernel's 166 ms; with the
unmasked blocks 94 ms on the H200 against the dense kernel's 137.) Replaces a masked
scaled-dot-product attention over both versions of the context (2C keys and a [rows, 2C]
mask, built per pass).

`two_source_chunks_triton` attends several chunks of a pass (a wavefront's, one per depth)
in one launch: their reads stacked [n, K, Hkv, D], seals and `seal_reach` end to end, and
a chunk table (`chunk_launch`) from which each tile finds its chunk.

Tiles of TILE_ROWS rows x the padded GQA group form the M dimension, a program per (tile,
KV head); QK and PV run on tensor cores in the input dtype with fp32 accumulation and fp32
softmax statistics (fp32 inputs: IEEE products; under TRITON_INTERPRET=1 tiles go to fp32
before `tl.dot`), as `paged_attention` does.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from specloop.kernels.paged_attention import block_g, launch_options, online_softmax, qk

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
NEVER = 2**31 - 1
# Launch options. M = tile rows x padded GQA group. On the H100 (8K chunk,
# bench/results/prefill_attention_sweep_two_source_h100.json) 64 x 64 tiles with 4 warps and 3
# stages ran best (248 TFLOP/s); 128-row tiles with 8 warps ran 223 (block_n 64) and 204
# (block_n 128): the masked band's per-pair selects cost more in larger tiles. (fp32 inputs,
# used by tests, must stay at 64 x 64 too: larger tiles exceed shared memory.)
LAUNCH = {"m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}


# One launch attends several chunks (a pass's wavefront): each program reads its chunk's
# rows, keys, table offset and key offset from `chunks_ptr` (int32 [n, 6]: first row, rows,
# first tile, table offset, context, offset of its seals and reach), so nothing about a
# chunk is specialized and a new prompt compiles no variant inside a request
# (`bench/compile_variants.py`); positions are a slice of the pass's.
@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _two_source_kernel(
    q_ptr, kr_ptr, vr_ptr, kt_ptr, vt_ptr, tables_ptr, positions_ptr, seals_ptr, last_ptr, reach_ptr, out_ptr,
    tile_chunk_ptr, chunks_ptr,
    stride_qn, stride_qh, stride_krb, stride_krn, stride_krh, stride_vrb, stride_vrn, stride_vrh, stride_ks,
    stride_kh, stride_vs, stride_vh, stride_on, stride_oh, scale,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
):
    b = tl.load(tile_chunk_ptr + tl.program_id(0))  # the tile's chunk
    info = chunks_ptr + b * 6
    first = tl.load(info)
    num_rows = tl.load(info + 1)
    tile = tl.program_id(0) - tl.load(info + 2)
    table = tl.load(info + 3)
    num_keys = tl.load(info + 4)
    key_offset = tl.load(info + 5)
    kr_ptr += b.to(tl.int64) * stride_krb
    vr_ptr += b.to(tl.int64) * stride_vrb
    seals_ptr += key_offset
    reach_ptr += key_offset
    kv_head = tl.program_id(1)
    BLOCK_M: tl.constexpr = TILE_ROWS * BLOCK_G
    i = tl.arange(0, BLOCK_M)
    r = tile * TILE_ROWS + i // BLOCK_G
    g = i % BLOCK_G
    r_ok = r < num_rows
    ok = r_ok & (g < GROUP)
    row = (first + r).to(tl.int64)
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pos = tl.load(positions_ptr + row, mask=r_ok, other=-1)
    context = tl.max(pos, axis=0) + 1
    lowest = tl.min(tl.where(r_ok, pos, 2147483647), axis=0)
    last = tl.load(last_ptr + b)
    q = tl.load(q_ptr + row[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The tile's band: the first key j with reach[j] > lowest (reach is nondecreasing: the
    # latest seal inside the chunk among keys <= j), found by bisection. Key blocks below it and
    # the tile's lowest position are visible to every row and read from k_read alone: one
    # contiguous, unmasked read, as in a dense prefill.
    band_lo = 0
    band_hi = num_keys
    while band_lo < band_hi:
        mid = (band_lo + band_hi) // 2
        if tl.load(reach_ptr + mid) > lowest:
            band_hi = mid
        else:
            band_lo = mid + 1
    open_hi = tl.minimum(lowest + 1, band_lo) // BLOCK_N * BLOCK_N
    for start in range(0, open_hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        k = tl.load(kr_ptr + j[:, None] * stride_krn + kv_head * stride_krh + d[None, :], mask=d_ok[None, :], other=0.0)
        v = tl.load(vr_ptr + j[:, None] * stride_vrn + kv_head * stride_vrh + d[None, :], mask=d_ok[None, :], other=0.0)
        m_i, l_i, acc = online_softmax(qk(q, k, DOT_FP32) * scale, v, m_i, l_i, acc, DOT_FP32)
    for start in range(open_hi, context, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < context
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(kr_ptr + j[:, None] * stride_krn + kv_head * stride_krh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vr_ptr + j[:, None] * stride_vrn + kv_head * stride_vrh + d[None, :], mask=kv_mask, other=0.0)
        s = qk(q, k, DOT_FP32)
        seal = tl.load(seals_ptr + j, mask=j_ok, other=2147483647)
        visible = j_ok[None, :] & (j[None, :] <= pos[:, None])
        # keys that may seal between the tile's first row and the chunk's last query
        maybe = j_ok & (seal > lowest) & (seal <= last)
        any_tail = tl.max(maybe.to(tl.int32), axis=0) > 0
        use_tail = visible & maybe[None, :] & (pos[:, None] < seal[None, :])  # pairs read from the tail
        v_t = tl.zeros_like(v)
        # (Branches yield tiles, not the loop's running state: with the online-softmax update
        # inside an if/else, Triton 3.6's software pipeliner failed to compile the loop.)
        if any_tail:  # (the other blocks load no table entry or tail slot)
            exact = tl.max(use_tail.to(tl.int32), axis=0) > 0  # keys some row of the tile reads from the tail
            page = tl.load(tables_ptr + table + j // PAGE_SIZE, mask=exact, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + j % PAGE_SIZE
            tail_mask = exact[:, None] & d_ok[None, :]
            k_t = tl.load(kt_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=tail_mask,
                          other=0.0)
            v_t = tl.load(vt_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=tail_mask,
                          other=0.0)
            s = tl.where(use_tail, qk(q, k_t, DOT_FP32), s)
        s = tl.where(visible, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if any_tail:  # the tail's probabilities against v_t
            p_t = tl.where(use_tail, p, 0.0)
            p = tl.where(use_tail, 0.0, p)
            if DOT_FP32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                pv += tl.dot(p_t, v_t.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
                pv += tl.dot(p_t.to(v_t.dtype), v_t)
        else:
            if DOT_FP32:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + row[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


def _check(q: torch.Tensor, k_read: torch.Tensor, v_read: torch.Tensor, k_tail: torch.Tensor,
           v_tail: torch.Tensor, positions: torch.Tensor, seals: torch.Tensor, last: torch.Tensor) -> None:
    n, num_heads, head_dim = q.shape
    assert k_read.shape == v_read.shape and k_read.shape[1:] == k_tail.shape[1:] == v_tail.shape[1:], \
        "k_read, v_read: [C, Hkv, D] as the tail's [S, Hkv, D]"
    assert k_tail.shape[2] == head_dim and num_heads % k_tail.shape[1] == 0, "heads or head dim do not match"
    assert positions.shape == (n,) and not positions.is_floating_point(), "positions: [N] ints"
    assert seals.shape == (k_read.shape[0],) and seals.dtype == torch.int32, "seals: int32 [C]"
    assert last.shape == (1,) and not last.is_floating_point(), "last: a [1] int tensor"
    for x in (q, k_read, v_read, k_tail, v_tail):
        assert x.stride(2) == 1, "the head dim must be contiguous"


def seal_reach(seals: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """reach[j] (int32 [C]): the latest seal at or before the chunk's last query among keys
    0..j, -1 for none. A tile whose lowest row is at or past reach[j] reads keys 0..j from
    k_read with every row, so the kernel reads them unmasked; it bisects reach for its band.
    Device ops only (no sync); a chunk's seals are fixed for its pass, so callers that attend
    per layer compute it once."""
    inside = torch.where(seals.long() <= last.long(), seals.long(), -1)
    return inside.cummax(0).values.to(torch.int32)


@dataclasses.dataclass
class ChunkLaunch:
    """What one launch over several chunks needs on the device: each tile's chunk (int32
    [T]) and each chunk's int32 row (first row, rows, first tile, table offset, context,
    key offset) [n, 6]; built once for a pass's chunks (`chunk_launch`), device ops only."""

    tile_chunk: torch.Tensor
    chunks: torch.Tensor
    tiles: int


def tile_rows_for(num_heads: int, num_kv_heads: int, tile_rows: int | None = None) -> int:
    """Rows a tile holds: `LAUNCH`'s M over the padded GQA group, unless given."""
    return tile_rows or max(1, LAUNCH["m"] // block_g(num_heads, num_kv_heads))


def chunk_launch(spans: list[tuple[int, int, int, int]], tile_rows: int, device: torch.device) -> ChunkLaunch:
    """`spans`: per chunk (first row, rows, table offset, context) in the pass; the chunks'
    seals and reach lie end to end in that order. One host-to-device copy of the int32 rows
    and tile chunks, from pinned memory on CUDA (a copy from pageable memory would wait
    for the stream; filling each value on the device was about 7 launches a chunk)."""
    rows_info, tile_chunk, tiles, keys = [], [], 0, 0
    for b, (first, rows, table, context) in enumerate(spans):
        count = triton.cdiv(rows, tile_rows)
        rows_info += [first, rows, tiles, table, context, keys]
        tile_chunk += [b] * count
        tiles += count
        keys += context
    host = torch.tensor(rows_info + tile_chunk, dtype=torch.int32)
    if torch.device(device).type == "cuda":
        ints = host.pin_memory().to(device, non_blocking=True)
    else:
        ints = host.to(device)
    return ChunkLaunch(ints[len(rows_info):], ints[:len(rows_info)].view(-1, 6), tiles)


def two_source_chunks_triton(q: torch.Tensor, k_read: torch.Tensor, v_read: torch.Tensor, k_tail: torch.Tensor,
                             v_tail: torch.Tensor, tables: torch.Tensor, page_size: int, positions: torch.Tensor,
                             seals: torch.Tensor, last: torch.Tensor, reach: torch.Tensor, launch: ChunkLaunch,
                             out: torch.Tensor, *, tile_rows: int | None = None, block_n: int | None = None,
                             num_warps: int | None = None, num_stages: int | None = None) -> None:
    """One launch of (tiles of every chunk, KV heads) programs writing the chunks' rows of
    `out` (nothing else). q, out, positions: the pass's rows; k_read, v_read [n, K, Hkv, D]:
    chunk b's keys read at row b (K at least its context); seals, reach: every chunk's, end
    to end (int32); last [n]: each chunk's last query position. `launch` must come from
    `chunk_launch` with the same tile_rows. The keys must cover every row's position:
    nothing is read back from the device to check it."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_tail.shape[1]
    assert k_read.dim() == 4 and k_read.shape == v_read.shape and k_read.shape[2:] == k_tail.shape[1:], \
        "k_read, v_read: [n, K, Hkv, D] as the tail's [S, Hkv, D]"
    assert k_tail.shape[2] == head_dim and num_heads % num_kv_heads == 0, "heads or head dim do not match"
    assert positions.shape == (n,) and not positions.is_floating_point(), "positions: [N] ints"
    assert seals.dtype == reach.dtype == torch.int32 and seals.shape == reach.shape, "seals, reach: int32 [sum C]"
    assert last.shape == (k_read.shape[0],) and not last.is_floating_point(), "last: [n] ints"
    assert out.shape == q.shape and out.dtype == q.dtype, "out: q's shape and dtype"
    for x in (q, k_read, v_read, k_tail, v_tail, out):
        assert x.stride(-1) == 1, "the head dim must be contiguous"
    bg = block_g(num_heads, num_kv_heads)
    tile_rows = tile_rows_for(num_heads, num_kv_heads, tile_rows)
    assert tile_rows * bg >= 16, "a tile's M dimension (tile_rows x padded GQA group) must be at least 16"
    if launch.tiles == 0:
        return
    _two_source_kernel[(launch.tiles, num_kv_heads)](
        q, k_read, v_read, k_tail, v_tail, tables, positions, seals, last, reach, out, launch.tile_chunk,
        launch.chunks, q.stride(0), q.stride(1), k_read.stride(0), k_read.stride(1), k_read.stride(2),
        v_read.stride(0), v_read.stride(1), v_read.stride(2), k_tail.stride(0), k_tail.stride(1), v_tail.stride(0),
        v_tail.stride(1), out.stride(0), out.stride(1), head_dim ** -0.5,
        PAGE_SIZE=page_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, TILE_ROWS=tile_rows,
        BLOCK_G=bg, BLOCK_N=block_n or LAUNCH["block_n"], BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_FP32=_INTERPRET or q.dtype == torch.float32,
        **launch_options(num_warps or LAUNCH["num_warps"], num_stages or LAUNCH["num_stages"]),
    )


def two_source_attention_triton(q: torch.Tensor, k_read: torch.Tensor, v_read: torch.Tensor, k_tail: torch.Tensor,
                                v_tail: torch.Tensor, tables: torch.Tensor, table: int, page_size: int,
                                positions: torch.Tensor, seals: torch.Tensor, last: torch.Tensor, *,
                                reach: torch.Tensor | None = None, tile_rows: int | None = None,
                                block_n: int | None = None, num_warps: int | None = None,
                                num_stages: int | None = None) -> torch.Tensor:
    """One chunk (`two_source_chunks_triton` with n = 1). `reach`: the chunk's `seal_reach`
    (computed here when None). Launch options left None: `LAUNCH`."""
    _check(q, k_read, v_read, k_tail, v_tail, positions, seals, last)
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    if reach is None:
        reach = seal_reach(seals, last)
    assert reach.shape == seals.shape and reach.dtype == torch.int32, "reach: int32 [C]"
    tile_rows = tile_rows_for(q.shape[1], k_tail.shape[1], tile_rows)
    launch = chunk_launch([(0, q.shape[0], table, seals.shape[0])], tile_rows, q.device)
    two_source_chunks_triton(q, k_read[None], v_read[None], k_tail, v_tail, tables, page_size, positions, seals,
                             last.reshape(1), reach, launch, out, tile_rows=tile_rows, block_n=block_n,
                             num_warps=num_warps, num_stages=num_stages)
    return out


def two_source_attention_reference(q: torch.Tensor, k_read: torch.Tensor, v_read: torch.Tensor,
                                   k_tail: torch.Tensor, v_tail: torch.Tensor, tables: torch.Tensor, table: int,
                                   page_size: int, positions: torch.Tensor, seals: torch.Tensor,
                                   last: torch.Tensor) -> torch.Tensor:
    """The read rule pair by pair in plain PyTorch (fp32 or wider scores, softmax and sums):
    (q, j) reads the tail iff q < seal[j] <= last, k_read / v_read otherwise; tail slots of
    keys no pair reads exact are never used."""
    _check(q, k_read, v_read, k_tail, v_tail, positions, seals, last)
    n, num_heads, head_dim = q.shape
    c, num_kv_heads = k_read.shape[:2]
    acc = torch.promote_types(q.dtype, torch.float32)
    j = torch.arange(c, device=q.device)
    seal = seals.long()
    visible = j[None] <= positions.long()[:, None]
    from_tail = visible & (positions.long()[:, None] < seal[None]) & (seal[None] <= last.long())  # [N, C]
    needed = from_tail.any(0)
    slots = tables[table + j // page_size].long() * page_size + j % page_size
    slots = torch.where(needed, slots, 0)
    zero = torch.zeros((), dtype=k_tail.dtype, device=q.device)
    k_t = torch.where(needed[:, None, None], k_tail[slots], zero)
    v_t = torch.where(needed[:, None, None], v_tail[slots], zero)
    per_head = lambda x: x.to(acc).repeat_interleave(num_heads // num_kv_heads, dim=1)  # noqa: E731 -- [C, Hq, D]
    qa = q.to(acc)
    scores = torch.where(from_tail[None], torch.einsum("nhd,khd->hnk", qa, per_head(k_t)),
                         torch.einsum("nhd,khd->hnk", qa, per_head(k_read))) * head_dim ** -0.5
    probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
    out = torch.einsum("hnk,khd->nhd", probs * ~from_tail[None], per_head(v_read))
    out = out + torch.einsum("hnk,khd->nhd", probs * from_tail[None], per_head(v_t))
    return out.to(q.dtype)


def two_source_attention(q: torch.Tensor, k_read: torch.Tensor, v_read: torch.Tensor, k_tail: torch.Tensor,
                         v_tail: torch.Tensor, tables: torch.Tensor, table: int, page_size: int,
                         positions: torch.Tensor, seals: torch.Tensor, last: torch.Tensor,
                         use_triton: bool | None = None, reach: torch.Tensor | None = None) -> torch.Tensor:
    """Output [N, Hq, D] in q's dtype: Triton on CUDA tensors or under TRITON_INTERPRET=1 by
    default, the reference otherwise (`reach`: the Triton launch's, `seal_reach`)."""
    if use_triton is None:
        use_triton = q.is_cuda or _INTERPRET
    if use_triton:
        return two_source_attention_triton(q, k_read, v_read, k_tail, v_tail, tables, table, page_size, positions,
                                           seals, last, reach=reach)
    return two_source_attention_reference(q, k_read, v_read, k_tail, v_tail, tables, table, page_size, positions,
                                          seals, last)
