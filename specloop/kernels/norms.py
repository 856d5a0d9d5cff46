"""Fused element-wise kernels of the Ouro layer in Triton, with their torch references.

    y = rms_norm(x, weight, eps)          # weight * RMSNorm(x)
    h = add_rms_norm(h, x, weight, eps)   # h + weight * RMSNorm(x)  (the sandwich norm's residual add)
    h, y = add_rms_norm_pair(h, x, weight, eps, weight2, eps2)   # that h, and y = weight2 * RMSNorm(h)
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

from specloop.kernels import DTYPES, pdl


@triton.jit
def _normed(x, w_ptr, c, ok, size, eps, dtype):
    """weight * RMSNorm(x) of an fp32 row, rounded as the model rounds (module docstring)."""
    mean = tl.sum(x * x, axis=0) / size
    normed = (x * tl.rsqrt(mean + eps)).to(dtype)
    w = tl.load(w_ptr + c, mask=ok, other=0.0)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, h_ptr, out_ptr, w2_ptr, out2_ptr, stride_x, stride_h, stride_o, stride_o2,
                     size, eps, eps2, ADD: tl.constexpr, NEXT: tl.constexpr, BLOCK: tl.constexpr,
                     RELEASE: tl.constexpr):
    """One row a program: y = weight * RMSNorm(x) (+ h with ADD); with NEXT also
    weight2 * RMSNorm(y) into out2, the same arithmetic as a second launch on y (its
    input is y as stored, one program a row, the same reduction layout). RELEASE: a
    programmatic dependent launch after it (a one-row product) may start now
    (`specloop.kernels.pdl`)."""
    if RELEASE:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < size
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    y = _normed(x, w_ptr, c, ok, size, eps, dtype)
    if ADD:
        h = tl.load(h_ptr + row * stride_h + c, mask=ok, other=0.0)
        y = (h.to(tl.float32) + y.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_o + c, y, mask=ok)
    if NEXT:
        tl.store(out2_ptr + row * stride_o2 + c, _normed(y.to(tl.float32), w2_ptr, c, ok, size, eps2, dtype), mask=ok)


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


def _launch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, h: torch.Tensor | None = None,
                 weight2: torch.Tensor | None = None, eps2: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check(x)
    if h is not None:
        _check(h)
    out = torch.empty_like(x if h is None else h, memory_format=torch.contiguous_format)
    out2 = None if weight2 is None else torch.empty_like(out)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, weight, x if h is None else h, out, weight if weight2 is None else weight2,
            out if out2 is None else out2, x.stride(0), 0 if h is None else h.stride(0), out.stride(0),
            out.stride(0) if out2 is None else out2.stride(0), x.shape[1], eps, eps2, ADD=h is not None,
            NEXT=weight2 is not None, BLOCK=triton.next_power_of_2(x.shape[1]), RELEASE=pdl.release(x),
            enable_fp_fusion=False)
    return out, out2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_norm(x, weight, eps)[0]


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_norm(x, weight, eps, h)[0]


def add_rms_norm_pair(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, weight2: torch.Tensor,
                      eps2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + weight * RMSNorm(x), weight2 * RMSNorm(that)) in one launch: a sandwich norm's
    residual add and the next norm that reads its result (the layer's two halves, and a
    layer's end with the next layer's input norm), bit for bit the two kernels apart."""
    out, out2 = _launch_norm(x, weight, eps, h, weight2, eps2)
    return out, out2


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


def add_rms_norm_pair_reference(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                                weight2: torch.Tensor, eps2: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = add_rms_norm_reference(h, x, weight, eps)
    return out, rms_norm_reference(out, weight2, eps2)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
