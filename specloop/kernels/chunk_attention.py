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
plus a group, per plane) are ever read from the tail, and a key block none of whose keys
does for the tile's rows is one contiguous read, as in a dense prefill. A key block with
such keys also loads their tail slots (masked to them: the tail pages of keys nobody reads
exact may be gone) and picks per pair. Replaces a masked scaled-dot-product attention over
both versions of the context (2C keys and a [rows, 2C] mask, built per pass).

Tiles of TILE_ROWS rows x the padded GQA group form the M dimension, a program per (tile,
KV head); QK and PV run on tensor cores in the input dtype with fp32 accumulation and fp32
softmax statistics (fp32 inputs: IEEE products; under TRITON_INTERPRET=1 tiles go to fp32
before `tl.dot`), as `paged_attention` does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specloop.kernels.paged_attention import block_g

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
NEVER = 2**31 - 1


@triton.jit
def _two_source_kernel(
    q_ptr, kr_ptr, vr_ptr, kt_ptr, vt_ptr, tables_ptr, positions_ptr, seals_ptr, last_ptr, out_ptr,
    stride_qn, stride_qh, stride_krn, stride_krh, stride_vrn, stride_vrh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_on, stride_oh, num_rows, table, scale,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    BLOCK_M: tl.constexpr = TILE_ROWS * BLOCK_G
    i = tl.arange(0, BLOCK_M)
    r = tile * TILE_ROWS + i // BLOCK_G
    g = i % BLOCK_G
    r_ok = r < num_rows
    ok = r_ok & (g < GROUP)
    row = r.to(tl.int64)
    head = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pos = tl.load(positions_ptr + row, mask=r_ok, other=-1)
    context = tl.max(pos, axis=0) + 1
    lowest = tl.min(tl.where(r_ok, pos, 2147483647), axis=0)
    last = tl.load(last_ptr)
    q = tl.load(q_ptr + row[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, context, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < context
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(kr_ptr + j[:, None] * stride_krn + kv_head * stride_krh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vr_ptr + j[:, None] * stride_vrn + kv_head * stride_vrh + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        seal = tl.load(seals_ptr + j, mask=j_ok, other=2147483647)
        visible = j_ok[None, :] & (j[None, :] <= pos[:, None])
        # keys that may seal between the tile's first row and the chunk's last query
        maybe = j_ok & (seal > lowest) & (seal <= last)
        any_tail = tl.max(maybe.to(tl.int32), axis=0) > 0
        use_tail = visible & maybe[None, :] & (pos[:, None] < seal[None, :])  # pairs read from the tail
        v_t = tl.zeros_like(v)
        if any_tail:  # (the other blocks load no table entry or tail slot)
            band = tl.max(use_tail.to(tl.int32), axis=0) > 0  # keys some row of the tile reads from the tail
            page = tl.load(tables_ptr + table + j // PAGE_SIZE, mask=band, other=0).to(tl.int64)
            slot = page * PAGE_SIZE + j % PAGE_SIZE
            tail_mask = band[:, None] & d_ok[None, :]
            k_t = tl.load(kt_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=tail_mask,
                          other=0.0)
            v_t = tl.load(vt_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=tail_mask,
                          other=0.0)
            if DOT_FP32:
                s_t = tl.dot(q, tl.trans(k_t.to(tl.float32)), input_precision="ieee")
            else:
                s_t = tl.dot(q, tl.trans(k_t))
            s = tl.where(use_tail, s_t, s)
        s = tl.where(visible, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if any_tail:
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


def two_source_attention_triton(q: torch.Tensor, k_read: torch.Tensor, v_read: torch.Tensor, k_tail: torch.Tensor,
                                v_tail: torch.Tensor, tables: torch.Tensor, table: int, page_size: int,
                                positions: torch.Tensor, seals: torch.Tensor, last: torch.Tensor, *,
                                tile_rows: int | None = None, block_n: int = 64) -> torch.Tensor:
    """One launch of (tiles, KV heads) programs. The keys must cover every row's position
    (C > max position): nothing is read back from the device to check it."""
    _check(q, k_read, v_read, k_tail, v_tail, positions, seals, last)
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_tail.shape[1]
    bg = block_g(num_heads, num_kv_heads)
    tile_rows = tile_rows or max(1, 64 // bg)
    assert tile_rows * bg >= 16, "a tile's M dimension (tile_rows x padded GQA group) must be at least 16"
    out = torch.empty_like(q)
    if n == 0:
        return out
    _two_source_kernel[(triton.cdiv(n, tile_rows), num_kv_heads)](
        q, k_read, v_read, k_tail, v_tail, tables, positions, seals, last, out,
        q.stride(0), q.stride(1), k_read.stride(0), k_read.stride(1), v_read.stride(0), v_read.stride(1),
        k_tail.stride(0), k_tail.stride(1), v_tail.stride(0), v_tail.stride(1), out.stride(0), out.stride(1),
        n, table, head_dim ** -0.5,
        PAGE_SIZE=page_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, TILE_ROWS=tile_rows,
        BLOCK_G=bg, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_FP32=_INTERPRET or q.dtype == torch.float32,
    )
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
                         use_triton: bool | None = None) -> torch.Tensor:
    """Output [N, Hq, D] in q's dtype: Triton on CUDA tensors or under TRITON_INTERPRET=1 by
    default, the reference otherwise."""
    if use_triton is None:
        use_triton = q.is_cuda or _INTERPRET
    fn = two_source_attention_triton if use_triton else two_source_attention_reference
    return fn(q, k_read, v_read, k_tail, v_tail, tables, table, page_size, positions, seals, last)
