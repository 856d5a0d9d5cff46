"""Fused element-wise kernels of the Ouro layer in Triton, with their torch references.

    y = rms_norm(x, weight, eps)          # weight * RMSNorm(x)
    h = add_rms_norm(h, x, weight, eps)   # h + weight * RMSNorm(x)  (the sandwich norm's residual add)
    a = silu_mul(gate_up)                 # silu(gate) * up, gate_up = [gate | up]

At batch 1 a decode step is thousands of tiny kernels, each a few microseconds of GPU
time however little it does (bench/results/profile_decode_h200_graphs.json): the layer's four
norms were 16 kernels (cast up, normalise, cast down, scale; the residual adds two more)
and the MLP's activation two. Each kernel here is one launch and reproduces the model's
rounding exactly: the variance and normalisation in fp32, the result rounded to the input
dtype, then the weight product and the residual add each rounded to that dtype (what the
torch ops of `specloop.model.layers` do one kernel at a time). The norm kernel compiles
without FMA contraction (`enable_fp_fusion=False`): with it, the compiler fuses the weight
product and the residual add into one fused multiply-add with a single rounding, and 29% of
bf16 and fp16 results came out one ulp away from the model's ops on the H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from specloop.kernels import DTYPES


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, h_ptr, out_ptr, stride_x, stride_h, stride_o, size, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < size
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x * x, axis=0) / size
    normed = (x * tl.rsqrt(mean + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + c, mask=ok, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    if ADD:
        h = tl.load(h_ptr + row * stride_h + c, mask=ok, other=0.0)
        y = (h.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + c, y, mask=ok)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < size
    gate = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + c, mask=ok, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + c, (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=ok)


def _check(x: torch.Tensor) -> None:
    assert x.dtype in DTYPES, f"fused norm kernels take fp32, bf16 or fp16, not {x.dtype}"
    assert x.dim() == 2 and x.stride(1) == 1, "rows [N, H] with a contiguous last dim"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, weight, x, out, x.stride(0), 0, out.stride(0), x.shape[1], eps,
                                        ADD=False, BLOCK=triton.next_power_of_2(x.shape[1]), enable_fp_fusion=False)
    return out


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x)
    _check(h)
    out = torch.empty_like(h, memory_format=torch.contiguous_format)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, weight, h, out, x.stride(0), h.stride(0), out.stride(0), x.shape[1], eps,
                                        ADD=True, BLOCK=triton.next_power_of_2(x.shape[1]), enable_fp_fusion=False)
    return out


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    _check(gate_up)
    n, width = gate_up.shape
    size = width // 2
    out = torch.empty(n, size, dtype=gate_up.dtype, device=gate_up.device)
    if n:
        _silu_mul_kernel[(n, triton.cdiv(size, block))](gate_up, out, gate_up.stride(0), out.stride(0), size,
                                                        BLOCK=block)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm: fp32 normalisation, rounded to x's dtype, then the weight."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return weight * F.rms_norm(x32, x32.shape[-1:], None, eps).to(x.dtype)


def add_rms_norm_reference(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return h + rms_norm_reference(x, weight, eps)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
