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
intermediate; `norms.silu_mul`'s expression, so the same bits). `gemv_rope` is the qkv
product with RoPE in its epilogue (`rope_` on the product, bit for bit): 146 -> 150 tok/s
in the same engine A/B (bench/results/gemv_sweep_rope_h100.json).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.nn import functional as F

from specloop.kernels import pdl
from specloop.kernels.rounding import round_to

_DTYPES = (torch.bfloat16, torch.float16)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, positions_ptr, inv_freq_ptr, ROTATED,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU: tl.constexpr, HALF: tl.constexpr,
                 BF16_BY_HAND: tl.constexpr, GDC: tl.constexpr):
    """BLOCK_N columns of the row: fp32 sums over the whole K. HALF > 0 (RoPE of head dim
    2 HALF in the epilogue): the program's columns are pairs (c, c + HALF) of one head side
    by side, so each pair's sums are in one program; the tile and its sums are as without.
    GDC (a programmatic dependent launch, `pdl.ENABLED`): the first weight tile is read before
    waiting for the previous kernel (nothing of it comes from there), the row and every
    store after; the next launch may start once the sums are done (`specloop.kernels.pdl`).
    The same sums."""
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if HALF > 0:
        pair = i // 2
        cols = (pair // HALF) * (2 * HALF) + pair % HALF + (i % 2) * HALF  # a permutation of 0..N-1
    else:
        cols = i
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros([BLOCK_N], tl.float32)
    start = 0
    if GDC:
        k_ok = ks < K
        w = tl.load(w_tile, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes (the row) are visible from here
        x = _operand(x_ptr + ks, k_ok, K, SILU)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        w = tl.load(w_tile + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = _operand(x_ptr + k0 + ks, k_ok, K, SILU)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    if HALF > 0:
        _rope_store(acc, cols, out_ptr, positions_ptr, inv_freq_ptr, N, ROTATED, BLOCK_N, HALF, BF16_BY_HAND)
    else:
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _rope_store(acc, cols, out_ptr, positions_ptr, inv_freq_ptr, N, ROTATED, BLOCK_N: tl.constexpr,
                HALF: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """The sums rounded to the dtype, then the pairs of columns below ROTATED rotated by
    `rope._rope_kernel`'s expression (so the same bits as `rope_` on the stored product)."""
    dtype = out_ptr.dtype.element_ty
    x1, x2 = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), [BLOCK_N // 2, 2]))
    lo, hi = tl.split(tl.reshape(cols, [BLOCK_N // 2, 2]))
    ok = lo < N
    angle = tl.load(positions_ptr).to(tl.float32) * tl.load(inv_freq_ptr + lo % HALF, mask=ok, other=0.0)
    cos = round_to(tl.cos(angle), dtype, BF16_BY_HAND)
    sin = round_to(tl.sin(angle), dtype, BF16_BY_HAND)
    rot_lo = round_to(round_to(x1 * cos, dtype, BF16_BY_HAND) + round_to(-x2 * sin, dtype, BF16_BY_HAND),
                      dtype, BF16_BY_HAND)
    rot_hi = round_to(round_to(x2 * cos, dtype, BF16_BY_HAND) + round_to(x1 * sin, dtype, BF16_BY_HAND),
                      dtype, BF16_BY_HAND)
    rotate = lo < ROTATED  # q and k; v is stored as summed
    tl.store(out_ptr + lo, tl.where(rotate, rot_lo, x1).to(dtype), mask=ok)
    tl.store(out_ptr + hi, tl.where(rotate, rot_hi, x2).to(dtype), mask=ok)


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
    _launch(x, weight, out, tiles, silu=silu)
    return out


def gemv_rope(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              rotated: int, tiles: Tiles = DEFAULT_TILES) -> torch.Tensor:
    """`gemv` with RoPE in the same launch: the first `rotated` output columns (q and k of
    a fused qkv product, whole heads of D = 2 len(inv_freq) columns) rotated at
    positions[0] with `inv_freq` [D/2] fp32, bit for bit `rope_` on `gemv`'s product with
    the same tiles (one launch and one pass over q and k fewer a layer)."""
    n, k = weight.shape
    half = inv_freq.numel()
    assert x.dim() == 2 and x.shape == (1, k) and x.stride(1) == 1 and weight.stride(1) == 1, (x.shape, weight.shape)
    assert x.dtype == weight.dtype and x.dtype in _DTYPES, (x.dtype, weight.dtype)  # fp32 could contract an FMA
    assert n % (2 * half) == 0 and rotated % (2 * half) == 0 and 0 <= rotated <= n, (n, half, rotated)
    assert positions.numel() == 1 and not positions.is_floating_point() and inv_freq.dtype == torch.float32
    assert tiles.block_n % 2 == 0, tiles
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _launch(x, weight, out, tiles, rope=(positions, inv_freq.contiguous(), rotated))
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, tiles: Tiles, silu: bool = False,
            rope: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """One launch of `_gemv_kernel` into `out` (`rope`: positions, inv_freq, rotated columns)."""
    n, k = weight.shape
    positions, inv_freq, rotated = rope if rope is not None else (out, out, 0)
    use_pdl = pdl.on(x)
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, out, n, k, weight.stride(0), positions, inv_freq, rotated, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, SILU=silu, HALF=0 if rope is None else inv_freq.numel(),
        BF16_BY_HAND=_INTERPRET and x.dtype == torch.bfloat16 and rope is not None, GDC=use_pdl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **({"launch_pdl": True} if use_pdl else {}),
        # RoPE as `rope_` launches it: its cos / sin (libdevice) differ in the last bit with
        # FMA contraction on. The sums do not change: bf16 / fp16 products are exact in fp32.
        enable_fp_fusion=rope is None)


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
