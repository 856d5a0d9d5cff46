"""The one-row matmul kernel (`specloop.kernels.gemv`) against `F.linear`.

Under Triton's interpreter on CPU and natively on CUDA. The kernel sums in fp32 and
rounds once, as cuBLAS does, in another order; so the check is against the exact product
of the same operands: within one rounding of the output dtype (plus the fp32 sum's own
error, far below it), several launches, ragged N and K, a strided row, the SiLU operand,
and the dispatch `linear` makes.
"""

from __future__ import annotations

import pytest
import torch

from specloop.kernels.gemv import DEFAULT_TILES, Tiles, gemv, linear, linear_reference, use_gemv
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
    DEFAULT_TILES,
    Tiles(block_n=16, block_k=64, num_warps=4, num_stages=2),
    Tiles(block_n=8, block_k=32, num_warps=2, num_stages=1),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"n{t.block_n}k{t.block_k}w{t.num_warps}")
@pytest.mark.parametrize("n, k", [(72, 200), (64, 64), (384, 1100)])  # ragged and whole tiles
def test_gemv_matches_the_product(dtype, tiles, n, k):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    got = gemv(x, w, tiles)
    assert got.shape == (1, n) and got.dtype == dtype
    _within_a_rounding(got, x, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"n{t.block_n}k{t.block_k}w{t.num_warps}")
def test_silu_operand_is_silu_mul(dtype, tiles):
    """silu=True reads [gate | up] and multiplies silu_mul's result, bit for bit the product
    of `norms.silu_mul`'s output (the MLP's down projection relies on it)."""
    gen = torch.Generator().manual_seed(7)
    n, k = 40, 1136
    gate_up = (3 * torch.randn(1, 2 * k, generator=gen)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    act = silu_mul(gate_up)
    got = gemv(gate_up, w, tiles, silu=True)
    assert torch.equal(got, gemv(act, w, tiles))
    _within_a_rounding(got, act, w)


def test_strided_row_and_output():
    """A row that is a view into a wider tensor, and a given output buffer."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(1, 300, generator=gen).to(DEVICE, torch.bfloat16)
    x = wide[:, 20:220]
    w = (torch.randn(40, 200, generator=gen) / 15).to(DEVICE, torch.bfloat16)
    out = torch.full((1, 40), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    assert gemv(x, w, out=out) is out
    _within_a_rounding(out, x, w)


def test_linear_dispatch():
    """`linear` takes the kernel only on CUDA, bf16/fp16, one row, no autograd; elsewhere it
    is F.linear exactly."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(24, 32, generator=gen)
    x = torch.randn(1, 32, generator=gen)
    assert not use_gemv(x, w)  # fp32
    with torch.no_grad():
        assert torch.equal(linear(x, w), linear_reference(x, w))
        xb, wb = x.to(DEVICE, torch.bfloat16), w.to(DEVICE, torch.bfloat16)
        assert use_gemv(xb, wb) == (DEVICE == "cuda")
        assert not use_gemv(torch.randn(2, 32).to(DEVICE, torch.bfloat16), wb)
        _within_a_rounding(linear(xb, wb), xb, wb)
    if DEVICE == "cuda":
        with torch.enable_grad():
            assert not use_gemv(xb, wb)


@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs")
def test_gemv_replays_under_a_cuda_graph():
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(512, 256, generator=gen) / 16).to(DEVICE, torch.bfloat16)
    x = torch.randn(1, 256, generator=gen).to(DEVICE, torch.bfloat16)
    out = gemv(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv(x, w)
    x.copy_(torch.randn(1, 256, generator=gen).to(DEVICE, torch.bfloat16))
    graph.replay()
    _within_a_rounding(captured, x, w)
    assert not torch.equal(captured, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", TILES + [Tiles(block_n=2, block_k=128, num_warps=4, num_stages=1)],
                         ids=lambda t: f"n{t.block_n}k{t.block_k}w{t.num_warps}")
@pytest.mark.parametrize("heads, rotated_heads, head_dim, position", [
    (6, 4, 16, 37), (5, 3, 8, 4095), (3, 3, 32, 0), (6, 0, 16, 9)])
def test_gemv_rope_is_rope_of_the_product(dtype, tiles, heads, rotated_heads, head_dim, position):
    """RoPE in the product's epilogue: bit for bit `rope_` on `gemv`'s output with the same
    tiles, over the first rotated heads only (q and k; v untouched), at any position."""
    from specloop.kernels.gemv import gemv_rope
    from specloop.kernels.rope import rope_
    from specloop.model.layers import Rotary

    gen = torch.Generator().manual_seed(heads * 31 + head_dim + position)
    n, k = heads * head_dim, 200
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    inv_freq = Rotary(head_dim, 10000.0).inv_freq.to(DEVICE)
    positions = torch.tensor([position], device=DEVICE)
    rotated = rotated_heads * head_dim
    want = gemv(x, w, tiles)
    rope_(want[:, :rotated].view(1, rotated_heads, head_dim), positions, inv_freq)
    got = gemv_rope(x, w, positions, inv_freq, rotated, tiles)
    assert torch.equal(got, want)


@pytest.mark.skipif(INTERPRETED or torch.cuda.get_device_capability()[0] < 9, reason="PDL: CUDA, Hopper and later")
@pytest.mark.parametrize("release_early", [False, True])
def test_programmatic_dependent_launch_changes_no_bits(monkeypatch, release_early):
    """With `pdl.ENABLED` each product may start while the kernel before it finishes (and,
    with `RELEASE_EARLY`, while the norms before it run): a chain of norms and products,
    each reading the last one's output (and the SiLU and RoPE forms), gives the same bits
    as without, eager and replayed from a CUDA graph after new inputs."""
    from specloop.kernels import norms, pdl
    from specloop.kernels.gemv import gemv_rope
    from specloop.model.layers import Rotary

    gen = torch.Generator().manual_seed(5)
    ws = [(torch.randn(1024, 1024, generator=gen) / 32).to(DEVICE, torch.bfloat16) for _ in range(3)]
    down = (torch.randn(1024, 512, generator=gen) / 32).to(DEVICE, torch.bfloat16)
    norm_w = (1 + torch.randn(1024, generator=gen) / 8).to(DEVICE, torch.bfloat16)
    inv_freq = Rotary(64, 10000.0).inv_freq.to(DEVICE)
    positions = torch.tensor([321], device=DEVICE)
    x = torch.randn(1, 1024, generator=gen).to(DEVICE, torch.bfloat16)

    def chain():
        y = gemv_rope(norms.rms_norm(x, norm_w, 1e-6), ws[0], positions, inv_freq, 512)
        h = x
        for w in ws[1:]:
            h, normed = norms.add_rms_norm_pair(h, y, norm_w, 1e-6, norm_w, 1e-6)
            y = gemv(normed, w)
        return h, gemv(y, down, silu=True)

    def run(on: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(pdl, "ENABLED", on)
        monkeypatch.setattr(pdl, "RELEASE_EARLY", release_early)
        eager = chain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain()
        x.copy_(x.flip(1))
        graph.replay()
        replayed = [t.clone() for t in captured]
        x.copy_(x.flip(1))
        return [*eager, *replayed]

    base = run(False)
    got = run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, base))
    assert not torch.equal(base[1], base[3])  # the replay read the new input
