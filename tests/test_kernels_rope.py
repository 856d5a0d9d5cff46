"""The in-place RoPE kernel against its torch reference, and the reference against the model.

Runs natively on CUDA and under Triton's interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU). Shapes: rows 1, 5, 33; heads 1 and 6; head dims
that are and are not powers of two; positions up to 70000, 0 among them; x contiguous and
as a strided view into a fused qkv buffer, whose other parts must stay untouched.
fp32 must match to 1e-5; bf16/fp16 to a rounding of the dtype (cos/sin of two math
libraries may differ in the last fp32 bit), with at least 99% of elements bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from specloop.kernels.rope import rope_, rope_reference
from specloop.model.layers import Rotary, apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _inv_freq(dim: int, theta: float = 10000.0) -> torch.Tensor:
    return Rotary(dim, theta).inv_freq.to(DEVICE)


def _positions(gen: torch.Generator, n: int) -> torch.Tensor:
    positions = torch.randint(0, 70001, (n,), generator=gen)
    positions[0] = 0
    if n > 1:
        positions[-1] = 70000
    return positions.to(DEVICE)


def _check(out: torch.Tensor, want: torch.Tensor) -> None:
    assert out.dtype == want.dtype and out.shape == want.shape
    tol = TOLERANCE[want.dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    if want.dtype != torch.float32:
        same = (out == want).float().mean().item()
        assert same >= 0.99, f"only {same:.2%} of elements bitwise equal"


@pytest.mark.parametrize("n", [1, 5, 33])
@pytest.mark.parametrize("heads", [1, 6])
@pytest.mark.parametrize("dim", [8, 12, 16, 24])
@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_matches_reference(n, heads, dim, dtype):
    gen = torch.Generator().manual_seed(1000 * n + 100 * heads + dim)
    x = (torch.randn(n, heads, dim, generator=gen) * 3).to(dtype).to(DEVICE)
    positions = _positions(gen, n)
    inv_freq = _inv_freq(dim)
    want = rope_reference(x, positions, inv_freq)
    out = rope_(x, positions, inv_freq)
    assert out is x
    _check(out, want)


@pytest.mark.parametrize("n", [1, 5, 33])
@pytest.mark.parametrize("heads, kv_heads", [(1, 1), (4, 2)])
@pytest.mark.parametrize("dim", [8, 12])
@pytest.mark.parametrize("dtype", DTYPES)
def test_view_into_qkv_matches_reference_and_leaves_v(n, heads, kv_heads, dim, dtype):
    """x = q and k of a fused [N, (Hq + 2 Hkv) D] buffer; v and the padding column after
    each row (a row stride past the buffer's width) are not written."""
    gen = torch.Generator().manual_seed(7 * n + 3 * heads + dim)
    width = (heads + 2 * kv_heads) * dim
    buf = (torch.randn(n, width + 5, generator=gen) * 3).to(dtype).to(DEVICE)
    qkv = buf[:, :width]
    x = qkv[:, :(heads + kv_heads) * dim].view(n, heads + kv_heads, dim)
    assert not x.is_contiguous() or n == 1
    positions = _positions(gen, n)
    inv_freq = _inv_freq(dim)
    before = buf.clone()
    want = rope_reference(x, positions, inv_freq)
    out = rope_(x, positions, inv_freq)
    assert out is x
    _check(out, want)
    changed = buf != before
    assert not changed[:, (heads + kv_heads) * dim:].any(), "rope_ wrote outside its view"


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_heads(dtype):
    """Heads with a stride other than D (every other head of a buffer)."""
    gen = torch.Generator().manual_seed(5)
    buf = torch.randn(5, 8, 12, generator=gen).to(dtype).to(DEVICE)
    before = buf.clone()
    x = buf[:, ::2]
    positions = _positions(gen, 5)
    inv_freq = _inv_freq(12)
    want = rope_reference(x, positions, inv_freq)
    rope_(x, positions, inv_freq)
    _check(x, want)
    assert torch.equal(buf[:, 1::2], before[:, 1::2])


def test_empty_rows_launch_nothing():
    x = torch.empty(0, 3, 8, device=DEVICE)
    out = rope_(x, torch.empty(0, dtype=torch.int64, device=DEVICE), _inv_freq(8))
    assert out is x


def test_rejects_bad_inputs():
    inv_freq = _inv_freq(8)
    positions = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(AssertionError, match="fp32, bf16 and fp16"):
        rope_(torch.zeros(2, 1, 8, dtype=torch.float64, device=DEVICE), positions, inv_freq)
    with pytest.raises(AssertionError, match="even"):
        rope_(torch.zeros(2, 1, 7, device=DEVICE), positions, inv_freq)
    with pytest.raises(AssertionError, match="contiguous"):
        rope_(torch.zeros(2, 1, 16, device=DEVICE)[..., ::2], positions, inv_freq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_reference_is_the_models_rotary(dtype):
    """Bitwise equal to what `specloop.model.layers` computes (on CPU)."""
    gen = torch.Generator().manual_seed(11)
    n, heads, dim = 9, 3, 24
    rotary = Rotary(dim, 500000.0)
    x = (torch.randn(n, heads, dim, generator=gen) * 3).to(dtype)
    positions = torch.randint(0, 70001, (n,), generator=gen)
    positions[0] = 0
    cos, sin = rotary.cos_sin(positions, dtype)
    want = apply_rotary(x, cos, sin)
    got = rope_reference(x, positions, rotary.inv_freq)
    assert got.dtype == dtype
    assert torch.equal(got, want)
