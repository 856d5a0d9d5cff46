"""Store rows' K and V into their KV slots in one Triton launch, with its torch reference.

    kv_write(k_cache, v_cache, slots, k, v, keep)

Each layer stores its rows' K/V into the paged pool; in torch that is an index_put for K
and one for V, plus two gathers and two selects when adaptive exit keeps exited tokens'
stored values (`keep`): two to six kernels per layer, a few microseconds each at batch 1
(bench/results/profile_decode_h200_graphs.json). One program per row copies the row's K and V
(reading them straight from the strided views into the fused qkv output) unless `keep`
says the token exited, whose slot then keeps what it holds.

- k_cache, v_cache [S, Hkv, D]: one layer of the pool; slots [N] int: each row's KV slot;
- k, v [N, Hkv, D]: any strides on dims 0 and 1, the head dim contiguous;
- keep [N] bool or None.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, keep_ptr, stride_kn, stride_kh, stride_vn, stride_vh,
                     stride_ks, stride_kch, stride_vs, stride_vch, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_KEEP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    write = True
    if HAS_KEEP:
        write = tl.load(keep_ptr + row) == 0
    if write:
        slot = tl.load(slots_ptr + row).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        ok = (h < HEADS) & (d < HEAD_DIM)
        k = tl.load(k_ptr + row * stride_kn + h * stride_kh + d, mask=ok)
        tl.store(kc_ptr + slot * stride_ks + h * stride_kch + d, k, mask=ok)
        v = tl.load(v_ptr + row * stride_vn + h * stride_vh + d, mask=ok)
        tl.store(vc_ptr + slot * stride_vs + h * stride_vch + d, v, mask=ok)


def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             keep: torch.Tensor | None) -> None:
    n, heads, dim = k.shape
    assert k.shape == v.shape and k_cache.shape[1:] == (heads, dim) and v_cache.shape == k_cache.shape
    assert k.stride(2) == v.stride(2) == k_cache.stride(2) == v_cache.stride(2) == 1, "the head dim must be contiguous"
    assert k.dtype == k_cache.dtype and v.dtype == v_cache.dtype
    if n == 0:
        return
    keep_arg = keep.view(torch.uint8) if keep is not None else slots
    _kv_write_kernel[(n,)](k, v, k_cache, v_cache, slots, keep_arg, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                           HEADS=heads, HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(heads),
                           BLOCK_D=triton.next_power_of_2(dim), HAS_KEEP=keep is not None)


def kv_write_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, keep: torch.Tensor | None) -> None:
    """The same in torch: rows where `keep` is true leave the stored value."""
    if keep is not None:
        k = torch.where(keep[:, None, None], k_cache[slots], k)
        v = torch.where(keep[:, None, None], v_cache[slots], v)
    k_cache[slots] = k
    v_cache[slots] = v
