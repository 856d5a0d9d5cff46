"""Fused norm, residual-norm and SiLU-mul kernels against their torch references.

Under Triton's interpreter on CPU and natively on CUDA. The references are the model's own
ops (checked below to be what `specloop.model.layers` computes), so the kernels must
reproduce their rounding: fp32 to 1e-6; bf16 and fp16 within two units in the last place
and bitwise equal on at least 99% of elements. Triton's interpreter (3.9) rounds fp32 to
bf16 by truncation, not to nearest (about half of a tensor's casts differ by one ulp, and
they compound through the kernel's three roundings), so on CPU bf16 is held to 2e-2; on
the GPU the ulp and bitwise checks apply.
"""

from __future__ import annotations

import pytest
import torch

from specloop.kernels.norms import (
    add_rms_norm, add_rms_norm_pair, add_rms_norm_pair_reference, add_rms_norm_reference, rms_norm,
    rms_norm_reference, silu_mul, silu_mul_reference,
)
from specloop.model.layers import RMSNorm

INTERPRETED = not torch.cuda.is_available()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """`scale`: the magnitude the last rounding is relative to (a sum's operands), default |want|."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        return
    if INTERPRETED and got.dtype == torch.bfloat16:  # truncating casts compound: a few ulps of unit values
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
        return
    size = want.float().abs() if scale is None else scale.float().abs()
    ulp = torch.finfo(got.dtype).eps * size.clamp(min=torch.finfo(got.dtype).tiny)
    err = (got.float() - want.float()).abs()
    same = (got == want).float().mean().item()
    worst = int(err.argmax())
    detail = (f"worst {err.max().item():.3g} = {(err / ulp).max().item():.2f} ulp at {worst} "
              f"(got {got.flatten()[worst].item()}, want {want.flatten()[worst].item()}), bitwise equal {same:.4f}")
    assert (err <= 2 * ulp + 1e-30).all(), detail
    assert same >= 0.99, detail


def _rows(n: int, size: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, size, generator=gen) * scale).to(DEVICE, dtype)


def _norm_case(n: int, size: int, dtype: torch.dtype):
    x, h = _rows(n, size, dtype, size, 3.0), _rows(n, size, dtype, size + 1)
    return x, h, 1 + 0.1 * _rows(1, size, dtype, 5)[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, size", [(1, 64), (7, 48), (3, 200)])
def test_rms_norm(dtype, n, size):
    x, _, w = _norm_case(n, size, dtype)
    _close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, size", [(1, 64), (7, 48), (3, 200)])
def test_residual_rms_norm(dtype, n, size):
    x, h, w = _norm_case(n, size, dtype)
    y = rms_norm_reference(x, w, 1e-6)
    _close(add_rms_norm(h, x, w, 1e-6), add_rms_norm_reference(h, x, w, 1e-6), h.float().abs() + y.float().abs())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, size", [(1, 64), (7, 48), (3, 200)])
def test_residual_rms_norm_pair(dtype, n, size):
    """The residual add and the next norm in one launch: bit for bit the two launches apart
    (the layer relies on it), and near the references."""
    x, h, w = _norm_case(n, size, dtype)
    w2 = 1 - 0.05 * _rows(1, size, dtype, 6)[0]
    got_h, got_y = add_rms_norm_pair(h, x[:, :size], w, 1e-6, w2, 1e-5)
    apart = add_rms_norm(h, x, w, 1e-6)
    assert torch.equal(got_h, apart)
    assert torch.equal(got_y, rms_norm(apart, w2, 1e-5))
    want_h, want_y = add_rms_norm_pair_reference(h, x, w, 1e-6, w2, 1e-5)
    _close(got_h, want_h, h.float().abs() + rms_norm_reference(x, w, 1e-6).float().abs())
    _close(got_y, rms_norm_reference(got_h, w2, 1e-5))
    assert want_y.shape == got_y.shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(dtype):
    """Rows of a wider buffer (a view with row stride > width) read and write correctly."""
    wide = _rows(5, 96, dtype, 9)
    x = wide[:, 16:80]
    w = torch.ones(64, dtype=dtype, device=DEVICE)
    _close(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, size, block", [(1, 40, 16), (6, 100, 32), (2, 8, 1024)])
def test_silu_mul(dtype, n, size, block):
    x = _rows(n, 2 * size, dtype, size, 4.0)
    _close(silu_mul(x, block=block), silu_mul_reference(x))


def test_empty_rows():
    x = torch.zeros(0, 16, device=DEVICE)
    assert rms_norm(x, torch.ones(16, device=DEVICE), 1e-6).shape == (0, 16)
    assert silu_mul(torch.zeros(0, 32, device=DEVICE)).shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_are_the_model_ops(dtype):
    norm = RMSNorm(32, 1e-6).to(dtype)
    norm.weight.data = 1 + 0.1 * torch.randn(32).to(dtype)
    x = torch.randn(4, 32).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm_reference(x, norm.weight, 1e-6), norm.torch_forward(x))
