"""Matrix products of a few rows (decode steps), in Triton, with their torch reference.

    y = linear(x, weight)        # x [M, K] @ weight[N, K].T -> [M, N], as F.linear

At batch 1 a decode step's matmuls read every weight once per loop, so they are a
bandwidth problem: cuBLAS at M = 1 read Ouro's weights at about 2.7 TB/s on the H200
(63% of 4.3 TB/s, bench/results/profile_decode_h200.json), 3.8 of a 6.2 ms step. Here
each program owns BLOCK_N output columns and walks the whole K: it streams a
[BLOCK_N, BLOCK_K] weight tile per step (contiguous along K, num_stages deep) and
multiplies it by the rows' [BLOCK_M, BLOCK_K] slice, on tensor cores (`tl.dot`, the rows
padded to 16 by masked loads, which cost no bandwidth) or, at one row, as a product and
a row sum on CUDA cores (`DOT=False`). No split-K: every output is one program's fp32
sum, rounded once, so the result does not depend on timing (CUDA graphs replay the same
bits) and only on the reduction order of the chosen tiles.

The torch reference is `F.linear` (`linear_reference`); results differ from it by the
summation order only (tests: within a rounding of the output dtype). Used where
`use_gemv` says: CUDA, bf16 or fp16, no autograd, at most `MAX_ROWS` rows; fp32 (the
exactness tests) and larger M stay on cuBLAS.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # its bf16 dot is wrong (gpu.md): fp32 there
MAX_ROWS = 8  # rows up to which `linear` runs the kernel (the decode graph buckets 1, 2, 4, 8)
_DTYPES = (torch.bfloat16, torch.float16)


class Tiles(NamedTuple):
    """One launch configuration: output columns a program, K a step, warps, pipeline
    stages, and whether the product runs on tensor cores."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    dot: bool


def default_tiles(rows: int, n: int, k: int) -> Tiles:
    """The launch for an [rows, k] x [n, k] product (see bench/gemv_sweep.py for the sweep
    these were read from)."""
    if rows == 1:
        return Tiles(block_n=16, block_k=512, num_warps=4, num_stages=3, dot=False)
    return Tiles(block_n=32, block_k=256, num_warps=4, num_stages=4, dot=True)


@triton.jit
def _operand(ptrs, ok, K, SILU: tl.constexpr):
    """The rows' slice of the left operand: x, or silu(gate) * up with up K further on."""
    if SILU:
        gate = tl.load(ptrs, mask=ok, other=0.0)
        up = tl.load(ptrs + K, mask=ok, other=0.0)
        act = (gate.to(tl.float32) / (1.0 + tl.exp(-gate.to(tl.float32)))).to(gate.dtype)
        return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    return tl.load(ptrs, mask=ok, other=0.0)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                 DOT_FP32: tl.constexpr, SILU: tl.constexpr):
    """Columns [pid * BLOCK_N, +BLOCK_N) of every row: fp32 sums over the whole K. SILU: x is
    [gate | up] (2K wide) and the product's left operand is silu(gate) * up, rounded as
    `norms.silu_mul` rounds it (the same expression, element by element)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    if DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        w = tl.load(w_tile + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT:
            x = _operand(x_tile + k0, row_ok[:, None] & k_ok[None, :], K, SILU)
            if DOT_FP32:
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        else:  # one row (BLOCK_M == 1)
            x = _operand(x_ptr + k0 + ks, k_ok, K, SILU)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    if DOT:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The oracle: `F.linear` without a bias."""
    return F.linear(x, weight)


def gemv(x: torch.Tensor, weight: torch.Tensor, tiles: Tiles | None = None,
         out: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T with the Triton kernel, any M (the tests and the sweep call
    it directly; the model goes through `linear`). `tiles` defaults to `default_tiles`.
    `silu`: x is [gate | up], [M, 2K], and the product is silu_mul(x) @ weight.T without
    the intermediate (the MLP's down projection; `norms.silu_mul`'s bits)."""
    k = weight.shape[1]
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == (2 * k if silu else k), (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.stride(1) == 1, "K must be contiguous in x and weight"
    assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    m = x.shape[0]
    n = weight.shape[0]
    tiles = tiles or default_tiles(m, n, k)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    dot = tiles.dot or m > 1
    block_m = max(16, triton.next_power_of_2(m)) if dot else 1
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT=dot, DOT_FP32=_INTERPRET, SILU=silu,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes the kernel: CUDA, bf16/fp16, no autograd, 1..MAX_ROWS rows of
    2-D contiguous-K operands."""
    return (x.is_cuda and x.dtype in _DTYPES and weight.dtype == x.dtype and x.dim() == 2
            and 0 < x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1
            and not torch.is_grad_enabled())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A bias-free linear layer: the few-row kernel where `use_gemv`, cuBLAS otherwise."""
    if use_gemv(x, weight):
        return gemv(x, weight)
    return F.linear(x, weight)
