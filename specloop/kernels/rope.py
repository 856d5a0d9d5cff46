"""Rotate-half RoPE in place in Triton, with its torch reference.

    rope_(x, positions, inv_freq)  # x [N, H, D] rotated in place; returns x

The model rotates q and k with a chain of eager ops (angles, cat, cos, sin, cat, two
multiplies, an add): about ten kernel launches and as many full-size temporaries per layer,
for work that reads and writes x once. This kernel does it in one pass, straight into the
fused qkv buffer: x may be a strided view such as

    qkv[:, :(Hq + Hkv) * D].view(N, Hq + Hkv, D)   # qkv [N, (Hq + 2 Hkv) * D] contiguous

so q and k are rotated together and v is never touched. Only the head dim must be
contiguous (stride(2) == 1); dims 0 and 1 take any strides.

- x [N, H, D], D even, fp32, bf16 or fp16;
- positions [N] int: each row's absolute position;
- inv_freq [D/2] fp32: the rotary frequencies (`Rotary.inv_freq` of the model).

One program per row covers all of its heads, in blocks of heads: the row's cos and sin are
computed once and reused for every head. No host sync, so a CUDA graph can capture it;
N == 0 launches nothing.

The result is bit for bit what the eager model computes (`rope_reference`, which follows
`specloop.model.layers.Rotary.cos_sin` and `apply_rotary`), because the kernel rounds where
eager torch rounds: fp32 angles, cos and sin in fp32 rounded to x's dtype, then each
product x * cos and rotated * sin in fp32 from the rounded operands, rounded to the dtype,
and their sum likewise. For fp32 inputs the launch turns off FMA contraction (eager torch
multiplies and adds separately; with contraction a quarter of fp32 outputs differ in the
last bit). On CUDA the kernel's cos/sin (libdevice) are torch's, and the output is bitwise
equal in all three dtypes (H200, torch 2.11, Triton 3.6). On CPU under the interpreter,
numpy's fp32 cos/sin differ from torch's (Sleef) in the last bit for about a sixth of the
angles: fp32 outputs then differ by an ulp or so, and an fp16 element flips now and then.

Under `TRITON_INTERPRET=1` the fp32 -> bf16 cast truncates instead of rounding to nearest
even (Triton 3.x's interpreter), so there the kernel rounds by hand on the bits.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
from specloop.kernels import DTYPES
from specloop.kernels.rounding import round_to
_MAX_TILE = 4096  # elements of one (heads x half dim) tile: bounds registers for wide rows


@triton.jit
def _rope_kernel(
    x_ptr, positions_ptr, inv_freq_ptr, stride_xn, stride_xh, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    pos = tl.load(positions_ptr + row).to(tl.float32)
    angle = pos * tl.load(inv_freq_ptr + j, mask=j_ok, other=0.0)
    cos = round_to(tl.cos(angle), dtype, BF16_BY_HAND)[None, :]
    sin = round_to(tl.sin(angle), dtype, BF16_BY_HAND)[None, :]
    base = x_ptr + row * stride_xn
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        ok = (h < num_heads)[:, None] & j_ok[None, :]
        lo_ptr = base + h.to(tl.int64)[:, None] * stride_xh + j[None, :]
        hi_ptr = lo_ptr + HALF
        x1 = tl.load(lo_ptr, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(hi_ptr, mask=ok, other=0.0).to(tl.float32)
        # out = x * cos + cat([-x2, x1]) * sin, each op rounded to the dtype as eager torch does
        lo = round_to(round_to(x1 * cos, dtype, BF16_BY_HAND) + round_to(-x2 * sin, dtype, BF16_BY_HAND),
                    dtype, BF16_BY_HAND)
        hi = round_to(round_to(x2 * cos, dtype, BF16_BY_HAND) + round_to(x1 * sin, dtype, BF16_BY_HAND),
                    dtype, BF16_BY_HAND)
        tl.store(lo_ptr, lo.to(dtype), mask=ok)
        tl.store(hi_ptr, hi.to(dtype), mask=ok)


def rope_(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, D] in place at `positions` [N] with `inv_freq` [D/2] fp32; returns x.
    One program per row; no host sync."""
    assert x.dim() == 3, "x must be [N, H, D]"
    n, num_heads, head_dim = x.shape
    assert x.dtype in DTYPES, f"rope_ supports fp32, bf16 and fp16 inputs, not {x.dtype}"
    assert head_dim % 2 == 0, f"the head dim must be even, got {head_dim}"
    assert x.stride(2) == 1, "the head dim of x must be contiguous (stride(2) == 1)"
    half = head_dim // 2
    assert positions.shape == (n,) and not positions.is_floating_point(), "positions must be [N] int"
    assert inv_freq.shape == (half,) and inv_freq.dtype == torch.float32, "inv_freq must be [D/2] fp32"
    assert positions.device == x.device and inv_freq.device == x.device, "all tensors on x's device"
    if n == 0 or num_heads == 0:
        return x
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(num_heads), max(1, _MAX_TILE // block_half))
    _rope_kernel[(n,)](
        x, positions, inv_freq.contiguous(), x.stride(0), x.stride(1), num_heads,
        HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BF16_BY_HAND=_INTERPRET and x.dtype == torch.bfloat16,
        enable_fp_fusion=False,  # x * cos + rot * sin as two products and an add, never an FMA
    )
    return x


def rope_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The same out of place, op for op as the model (`Rotary.cos_sin`, `apply_rotary`):
    angles in fp32 (fp64 for fp64 x), cos and sin rounded to x's dtype, then x * cos +
    rotated * sin in x's dtype, each op rounding."""
    acc = torch.promote_types(x.dtype, torch.float32)
    angles = positions.to(acc)[:, None] * inv_freq.to(x.device, acc)[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
