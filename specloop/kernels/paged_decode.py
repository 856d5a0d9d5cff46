"""Paged decode attention in Triton: one query row per program and KV head, keys read through
the row's page table, online softmax in fp32; with its torch reference.

    out, lse = paged_decode(q, k_cache, v_cache, tables, table_offsets, context_lens, page_size)

- q [N, Hq, D]: one query row each (a decode or verification row at any depth);
- k_cache, v_cache [S, Hkv, D]: one layer of the KV pool, S = pages * page_size;
- tables [T] int: page tables, flat; row i's keys 0..context_lens[i]-1 sit at
  tables[table_offsets[i] + j // page_size] * page_size + j % page_size;
- returns out [N, Hq, D] (q's dtype) and lse [N, Hq] (fp32, natural log of the softmax
  denominator of the scaled scores; sparse decode attention will need it).

GQA: a program loads each key tile once for the Hq / Hkv query heads that share it. This is
the first kernel of the fast path (issue 12): no split-KV yet, and it is not wired into an
attention backend; `paged_decode_reference` is the oracle it is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, offsets_ptr, lens_ptr, out_ptr, lse_ptr,
    stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_on, stride_oh, stride_ln,
    scale, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    # the query heads of this KV head: [BLOCK_G, BLOCK_D] in fp32
    q = tl.load(q_ptr + row * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    length = tl.load(lens_ptr + row)
    table = tl.load(offsets_ptr + row)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, length, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < length
        page = tl.load(tables_ptr + table + j // PAGE_SIZE, mask=j_ok, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + j % PAGE_SIZE
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        # scores [BLOCK_G, BLOCK_N]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        s = tl.where(j_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + row * stride_on + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + row * stride_ln + heads, m + tl.log(denom), mask=g_ok)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 table_offsets: torch.Tensor, context_lens: torch.Tensor, page_size: int,
                 block_n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch one program per (row, KV head); every row needs context_lens >= 1."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim, "K and V caches must be [S, Hkv, D]"
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, "the head dim must be contiguous"
    assert tables.dim() == table_offsets.dim() == context_lens.dim() == 1
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    lse = torch.empty(n, num_heads, dtype=torch.float32, device=q.device)
    if n == 0:
        return out, lse
    _paged_decode_kernel[(n, num_kv_heads)](
        q, k_cache, v_cache, tables, table_offsets, context_lens, out, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        head_dim ** -0.5, PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out, lse


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           table_offsets: torch.Tensor, context_lens: torch.Tensor,
                           page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, row by row in plain PyTorch (fp32 scores, softmax and weighted sum)."""
    n, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(n, num_heads, dtype=torch.float32, device=q.device)
    for i in range(n):
        length, offset = int(context_lens[i]), int(table_offsets[i])
        j = torch.arange(length, device=q.device)
        slots = tables[offset + j // page_size].long() * page_size + j % page_size
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * head_dim ** -0.5
        lse[i] = torch.logsumexp(scores, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out, lse
