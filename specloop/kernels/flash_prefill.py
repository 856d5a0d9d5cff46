"""A prompt chunk's attention over its keys made contiguous: flash attention on CUDA, with
its torch reference.

    k, v = k_cache[slots], v_cache[slots]         # the chunk's keys 0..context-1: [context, Hkv, D]
    out = flash_chunk_attention(q, k, v, scale)   # q [n, Hq, D], n <= context

A chunk of n consecutive prompt rows ends at key context - 1: query i sits at position
context - n + i and reads keys 0..context - n + i (causal, aligned bottom-right: the chunk
after its prefix). The paged kernel (`paged_attention`) serves such a chunk too, at about
210 TFLOP/s on an 8K prompt on the H100; over contiguous keys torch's flash kernel (FA2)
runs 255 and cuDNN's 459 where the chunk is the whole prompt (a square causal mask), but
cuDNN falls to 196 for a chunk after its prefix, where flash keeps 250
(bench/results/prefill_attention_sweep_8k_h100.json, _2k_). So a chunk that starts the
prompt goes to cuDNN, one after a prefix to flash (`_square`, `_after_prefix`, each
checked once by `supported`). A chunk after a prefix gathers its keys once a layer (an 8K
context: 4 MiB each for K and V in bf16); one that is its whole context reads the K/V it
has just written, as the model computed them (`TritonAttention`).

Flash attention runs in bf16/fp16 only, so the engine takes this path for those dtypes on
CUDA (`supported`); fp32 engines (the exactness tests) keep the paged kernel. A row's output
here differs from the paged kernel's by bf16 rounding (other key blocks and softmax order),
within the tolerances the tests declare.
"""

from __future__ import annotations

import functools

import torch

FLASH_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether flash attention serves these queries: CUDA (sm80+) with torch's flash kernels,
    bf16/fp16, a head size it takes; checked once with a small call, so a build without
    them falls back to the paged kernel instead of failing mid-request."""
    if device.type != "cuda" or dtype not in FLASH_DTYPES or head_dim % 8 or head_dim > 256:
        return False
    if not torch.backends.cuda.is_flash_attention_available():
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    q = torch.randn(3, 2, head_dim, dtype=dtype, device=device)
    k = torch.randn(5, 1, head_dim, dtype=dtype, device=device)
    try:
        _after_prefix(q, k, k, head_dim ** -0.5)
    except RuntimeError:
        return False
    # cuDNN on q, k, v as the model gives them (views of one QKV output, a row stride of
    # 3 x heads x D), else on contiguous copies, else not at all
    qkv = torch.randn(5, 3, 2, head_dim, dtype=dtype, device=device)
    q, k, v = qkv.unbind(1)
    key = square_key(device, dtype, head_dim)
    for mode in ("strided", "contiguous"):
        _SQUARE_MODE[key] = mode
        if _works(_square, q, k, v, head_dim ** -0.5):
            break
    else:
        del _SQUARE_MODE[key]
    return True


_SQUARE_MODE: dict[tuple[int, torch.dtype, int], str] = {}  # `square_key` -> how cuDNN takes a square chunk


def square_key(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[int, torch.dtype, int]:
    return (device.index if device.index is not None else torch.cuda.current_device()), dtype, head_dim


def _works(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> bool:
    """Whether `fn` runs and agrees with the reference here (a backend that is missing or
    rejects the shape raises; one that misbehaves would differ)."""
    try:
        got = fn(q, k, v, scale)
    except RuntimeError:
        return False
    return bool(torch.allclose(got.float(), chunk_attention_reference(q, k, v, scale).float(), atol=2e-2, rtol=2e-2))


def flash_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D], k/v [Lk, Hkv, D] (Hkv divides Hq, n <= Lk) -> [n, Hq, D], query i
    reading keys 0..Lk - n + i."""
    group = q.shape[1] // k.shape[1]
    if group > 1:  # (the ops take equal heads)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if q.shape[0] == k.shape[0] and square_key(q.device, q.dtype, q.shape[-1]) in _SQUARE_MODE:
        return _square(q, k, v, scale)
    return _after_prefix(q, k, v, scale)


def _after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Flash attention (FA2): its causal mask aligns bottom-right when queries are fewer
    than keys (what torch's lower-right CausalBias relies on too)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0,
        is_causal=True, return_debug_mask=False, scale=scale)[0]
    return out[0].transpose(0, 1)


def _square(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """cuDNN's attention for a chunk that is its whole context (queries as many as keys);
    on contiguous copies where it did not take the model's strided views (`supported`)."""
    if _SQUARE_MODE[square_key(q.device, q.dtype, q.shape[-1])] == "contiguous":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, False,
        0.0, True, False, scale=scale)[0]
    return out[0].transpose(0, 1)


def chunk_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """What `flash_chunk_attention` computes, readably: scores and softmax in fp32 (at least)."""
    n, lk = q.shape[0], k.shape[0]
    acc = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.to(acc), kf) * scale
    allowed = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lk - n, lk, device=q.device)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, vf).to(q.dtype)
