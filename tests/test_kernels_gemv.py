"""The few-row matmul kernel (`specloop.kernels.gemv`) against `F.linear`.

Under Triton's interpreter on CPU and natively on CUDA. The kernel sums in fp32 and
rounds once, as cuBLAS does, in another order; so the check is against the fp32 product
of the same operands: within one rounding of the output dtype (half an ulp of the exact
value, plus the fp32 sum's own error, far below it), both tile kinds, ragged N and K,
strided rows, and the dispatch `linear` makes.
"""

from __future__ import annotations

import pytest
import torch

from specloop.kernels.gemv import MAX_ROWS, Tiles, default_tiles, gemv, linear, linear_reference, use_gemv
from specloop.kernels.norms import silu_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
DTYPES = [torch.bfloat16, torch.float16]


def _within_a_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().T
    size = (x.double().abs() @ w.double().abs().T)  # what the sum's error scales with
    eps = torch.finfo(got.dtype).eps
    # one rounding to the output dtype (eps/2 of |exact|, a full eps for the interpreter's
    # truncating bf16 casts) and the fp32 sum's error (K * 2^-24 of the magnitudes)
    bound = eps * exact.abs() + x.shape[1] * 2.0**-24 * size + torch.finfo(got.dtype).tiny
    err = (got.double() - exact).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{got.dtype}: |got - exact| {err.flatten()[worst]:.3g} > {bound.flatten()[worst]:.3g} at {worst}")


TILES = [
    Tiles(block_n=16, block_k=64, num_warps=4, num_stages=2, dot=False),
    Tiles(block_n=16, block_k=32, num_warps=4, num_stages=2, dot=True),
    Tiles(block_n=32, block_k=64, num_warps=4, num_stages=3, dot=True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"n{t.block_n}k{t.block_k}{'dot' if t.dot else 'sum'}")
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gemv_matches_the_product(dtype, tiles, rows):
    gen = torch.Generator().manual_seed(rows)
    n, k = 72, 200  # neither a multiple of the tiles
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    got = gemv(x, w, tiles)
    assert got.shape == (rows, n) and got.dtype == dtype
    _within_a_rounding(got, x, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_tiles_on_the_models_shapes(dtype):
    """Every default launch, on a small model's real shapes (K a multiple of the tiles or not)."""
    gen = torch.Generator().manual_seed(0)
    for n, k in [(192, 64), (64, 64), (256, 64), (64, 128), (384, 64)]:
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
        for rows in (1, 2, 5, MAX_ROWS):
            x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
            assert default_tiles(rows, n, k).block_n > 0
            _within_a_rounding(gemv(x, w), x, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", [None, *TILES], ids=lambda t: "default" if t is None else f"n{t.block_n}dot{t.dot}")
@pytest.mark.parametrize("rows", [1, 4])
def test_silu_operand_is_silu_mul(dtype, tiles, rows):
    """silu=True reads [gate | up] and multiplies silu_mul's result, bit for bit the product
    of `norms.silu_mul`'s output (the MLP's down projection relies on it)."""
    gen = torch.Generator().manual_seed(7 + rows)
    n, k = 40, 136
    gate_up = (3 * torch.randn(rows, 2 * k, generator=gen)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    act = silu_mul(gate_up)
    got = gemv(gate_up, w, tiles, silu=True)
    assert torch.equal(got, gemv(act, w, tiles))
    _within_a_rounding(got, act, w)


def test_strided_rows_and_output():
    """Rows with a stride (a view into a wider tensor) and a given output buffer."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 300, generator=gen).to(DEVICE, torch.bfloat16)
    x = wide[:, 20:220]
    w = (torch.randn(40, 200, generator=gen) / 15).to(DEVICE, torch.bfloat16)
    out = torch.full((4, 40), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    assert gemv(x, w, out=out) is out
    _within_a_rounding(out, x, w)


def test_linear_dispatch():
    """`linear` takes the kernel only on CUDA, bf16/fp16, few rows, no autograd; elsewhere it
    is F.linear exactly."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(24, 32, generator=gen)
    x = torch.randn(3, 32, generator=gen)
    assert not use_gemv(x, w)  # fp32
    with torch.no_grad():
        assert torch.equal(linear(x, w), linear_reference(x, w))
        xb, wb = x.to(DEVICE, torch.bfloat16), w.to(DEVICE, torch.bfloat16)
        assert use_gemv(xb, wb) == (DEVICE == "cuda")
        assert not use_gemv(torch.randn(MAX_ROWS + 1, 32).to(DEVICE, torch.bfloat16), wb)
        _within_a_rounding(linear(xb, wb), xb, wb)
    if DEVICE == "cuda":
        with torch.enable_grad():
            assert not use_gemv(xb, wb)


@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs")
def test_gemv_replays_under_a_cuda_graph():
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(512, 256, generator=gen) / 16).to(DEVICE, torch.bfloat16)
    x = torch.randn(2, 256, generator=gen).to(DEVICE, torch.bfloat16)
    out = gemv(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv(x, w)
    x.copy_(torch.randn(2, 256, generator=gen).to(DEVICE, torch.bfloat16))
    graph.replay()
    _within_a_rounding(captured, x, w)
    assert not torch.equal(captured, out)
