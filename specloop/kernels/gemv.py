"""One-row matrix products (batch-1 decode steps), in Triton, with their torch reference.

    y = linear(x, weight)        # x [M, K] @ weight[N, K].T -> [M, N], as F.linear

At batch 1 a decode step's matmuls read every weight once per loop, so they are a
bandwidth problem, and cuBLAS's one-row kernels read Ouro's weights at 1.3-2.8 TB/s on
an H100 (bench/results/gemv_sweep_kernels_h100.json: the o projection, 8 MB, at 1.33).
Here each program owns BLOCK_N output columns and walks the whole K: it streams a
[BLOCK_N, BLOCK_K] weight tile a step (contiguous along K) and sums its product with the
row on CUDA cores in fp32, rounded once at the end. No split-K, so every output is one
program's sum and a CUDA graph replays the same bits; results differ from cuBLAS's by
the summation order only (tests: within one rounding of the output dtype).

Measured on an H100 (bench/gemv_sweep.py, each matmul from HBM as in a decode step): 5-14%
faster than cuBLAS per matmul at one row with 8 columns, 1024 K and 8 warps a program;
with the paired norms, batch-1 decode after 1K went 130 -> 145 tok/s in the engine
(bench/results/gemv_sweep_engine_onerow_h100.json). At 2-32 rows a tensor-core form (rows padded to 16)
was at best level with cuBLAS and the engine at batch 4 ran at half speed with it, so more
rows stay on cuBLAS (`use_gemv`). With `silu=True` the operand is silu(gate) * up computed
in the loads from [gate | up] (the MLP's down product without the SiLU-mul launch or its
intermediate; `norms.silu_mul`'s expression, so the same bits).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

_DTYPES = (torch.bfloat16, torch.float16)


class Tiles(NamedTuple):
    """One launch configuration: output columns a program, K a step, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# The best launch at one row for o, gate_up, down and lm_head on the H100 sweep (qkv's best,
# 512 K a step, was 2% faster than this one).
DEFAULT_TILES = Tiles(block_n=8, block_k=1024, num_warps=8, num_stages=3)


@triton.jit
def _operand(ptrs, ok, K, SILU: tl.constexpr):
    """The row's slice of the left operand: x, or silu(gate) * up with up K further on,
    rounded as `norms.silu_mul` rounds it (the same expression, element by element)."""
    if SILU:
        gate = tl.load(ptrs, mask=ok, other=0.0)
        up = tl.load(ptrs + K, mask=ok, other=0.0)
        act = (gate.to(tl.float32) / (1.0 + tl.exp(-gate.to(tl.float32)))).to(gate.dtype)
        return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    return tl.load(ptrs, mask=ok, other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU: tl.constexpr):
    """Columns [pid * BLOCK_N, +BLOCK_N) of the row: fp32 sums over the whole K."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        w = tl.load(w_tile + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = _operand(x_ptr + k0 + ks, k_ok, K, SILU)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The oracle: `F.linear` without a bias."""
    return F.linear(x, weight)


def gemv(x: torch.Tensor, weight: torch.Tensor, tiles: Tiles = DEFAULT_TILES,
         out: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T with the Triton kernel (the tests and the sweep call it
    directly; the model goes through `linear`). `silu`: x is [gate | up], [1, 2K], and the
    product is silu_mul(x) @ weight.T without the intermediate (the MLP's down product)."""
    k = weight.shape[1]
    assert x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2, (x.shape, weight.shape)
    assert x.shape[1] == (2 * k if silu else k), (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.stride(1) == 1, "K must be contiguous in x and weight"
    assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    n = weight.shape[0]
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, out, n, k, weight.stride(0), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SILU=silu,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes the kernel: CUDA, bf16/fp16, no autograd, one row of 2-D
    contiguous-K operands."""
    return (x.is_cuda and x.dtype in _DTYPES and weight.dtype == x.dtype and x.dim() == 2 and x.shape[0] == 1
            and x.stride(1) == 1 and weight.stride(1) == 1 and not torch.is_grad_enabled())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A bias-free linear layer: the one-row kernel where `use_gemv`, cuBLAS otherwise."""
    if use_gemv(x, weight):
        return gemv(x, weight)
    return F.linear(x, weight)
