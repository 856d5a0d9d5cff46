"""The INT4 group codec: its torch reference against the FlashLoop reference's fake
quantization (`quantize`, `dequantize`, `quantize_rows` of `specloop.model.flashloop_reference`),
and its Triton kernels against the torch reference, all bit for bit.

Runs natively on CUDA and under Triton's interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU); shapes stay small for the interpreter. Cases:
random fp32/bf16/fp16 inputs with full and partial groups, head dims 16/64/96/128 and 1-3 KV
heads; constant groups (0.0, fp16-representable values, and the fp16 rounding of
values fp16 cannot hold); round-half-even ties; clipping; padding that must be ignored; the
nibble order; the reconstruction bound.
"""

from __future__ import annotations

import pytest
import torch

from specloop.kernels.int4_groups import (
    KGroups,
    VGroups,
    dequantize_k_groups,
    dequantize_k_groups_reference,
    dequantize_v_groups,
    dequantize_v_groups_reference,
    quantize_k_groups,
    quantize_k_groups_reference,
    quantize_v_groups,
    quantize_v_groups_reference,
    split_k_plane,
    unpack_codes,
)
from specloop.model.flashloop_reference import dequantize, fake_quantize_group, quantize, quantize_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = [False, True]  # use_triton: the torch reference, the kernels (natively or interpreted)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that comparisons see -0.0 / +0.0 and NaN payloads."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    differ = _bits(got) != _bits(want)
    assert not differ.any(), (f"{int(differ.sum())} of {got.numel()} differ, "
                              f"e.g. {got[differ][:4]} vs {want[differ][:4]}")


def _same_groups(got: KGroups | VGroups, want: KGroups | VGroups) -> None:
    _same(got.codes, want.codes)
    _same(got.scale, want.scale)
    _same(got.lo, want.lo)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _k_codec(plane: torch.Tensor, use_triton: bool) -> tuple[KGroups, torch.Tensor]:
    """(K groups, the decoded plane [T, H, D]) of a plane [T, H, D]."""
    groups, valid = split_k_plane(plane)
    kg = quantize_k_groups(groups, valid, use_triton=use_triton)
    return kg, dequantize_k_groups(kg, plane.dtype, use_triton=use_triton).flatten(0, 1)[: plane.shape[0]]


def _v_codec(x: torch.Tensor, use_triton: bool) -> tuple[VGroups, torch.Tensor]:
    vg = quantize_v_groups(x, use_triton=use_triton)
    return vg, dequantize_v_groups(vg, x.dtype, use_triton=use_triton)


# --- the torch reference is the FlashLoop reference's fake quantization ----------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, heads, dim", [(64, 2, 16), (101, 3, 64), (20, 1, 128), (128, 2, 128)])
def test_k_reference_is_flashloop_fake_quantization(dtype, rows, heads, dim):
    x = _randn(rows, heads, dim, dtype=dtype, seed=rows * dim + heads, scale=2.0)
    kg, decoded = _k_codec(x, use_triton=False)
    _same(decoded, quantize_rows(x, "k", bits=4, group_size=64))
    codes = unpack_codes(kg.codes, 1)  # [G, 64, H, D]
    for g, s in enumerate(range(0, rows, 64)):
        fq = quantize(x[s:s + 64], 0, bits=4)  # one group per channel, over the group's valid rows
        assert not fq.constant.any()
        _same(codes[g, : fq.codes.shape[0]], fq.codes)
        _same(kg.scale[g], fq.scale[0])
        _same(kg.lo[g], fq.lo[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, heads, dim", [(5, 2, 16), (3, 3, 64), (4, 1, 96), (6, 2, 128)])
def test_v_reference_is_flashloop_fake_quantization(dtype, rows, heads, dim):
    x = _randn(rows, heads, dim, dtype=dtype, seed=rows * dim + heads + 7, scale=2.0)
    vg, decoded = _v_codec(x, use_triton=False)
    _same(decoded, quantize_rows(x, "v", bits=4, group_size=64))
    codes = unpack_codes(vg.codes, 2)  # [N, H, D]
    for j, c in enumerate(range(0, dim, 64)):
        fq = quantize(x[..., c:c + 64], -1, bits=4)
        _same(codes[..., c:c + 64], fq.codes)
        _same(vg.scale[..., j], fq.scale[..., 0])
        _same(vg.lo[..., j], fq.lo[..., 0])


# --- the kernels are the torch reference -----------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, dim, valid", [(2, 16, [64, 64]), (3, 64, [64, 37]), (1, 128, [1, 64, 50])])
def test_k_kernels_match_reference(dtype, heads, dim, valid):
    x = _randn(len(valid), 64, heads, dim, dtype=dtype, seed=dim + heads, scale=3.0)
    valid = torch.tensor(valid, device=DEVICE)
    got = quantize_k_groups(x, valid, use_triton=True)
    want = quantize_k_groups_reference(x, valid)
    _same_groups(got, want)
    for out_dtype in DTYPES:
        _same(dequantize_k_groups(want, out_dtype, use_triton=True), dequantize_k_groups_reference(want, out_dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, heads, dim", [(3, 2, 16), (2, 3, 64), (2, 1, 96), (3, 2, 128)])
def test_v_kernels_match_reference(dtype, rows, heads, dim):
    x = _randn(rows, heads, dim, dtype=dtype, seed=rows + dim + heads, scale=3.0)
    got = quantize_v_groups(x, use_triton=True)
    want = quantize_v_groups_reference(x)
    _same_groups(got, want)
    for out_dtype in DTYPES:
        _same(dequantize_v_groups(want, out_dtype, use_triton=True), dequantize_v_groups_reference(want, out_dtype))


def test_strided_inputs():
    """K groups as a view of a wider buffer (the head dim contiguous, the rest strided)."""
    wide = _randn(2, 64, 3, 40, dtype=torch.bfloat16, seed=3)
    x, valid = wide[:, :, 1:, 4:36], torch.tensor([64, 9], device=DEVICE)
    _same_groups(quantize_k_groups(x, valid, use_triton=True), quantize_k_groups_reference(x.contiguous(), valid))
    v = _randn(4, 3, 80, dtype=torch.float32, seed=4)[:, :2, 8:72]
    _same_groups(quantize_v_groups(v, use_triton=True), quantize_v_groups_reference(v.contiguous()))


# --- constant groups -------------------------------------------------------------------

def _k_with_constant_channel(value: float, dtype: torch.dtype) -> torch.Tensor:
    x = _randn(64, 2, 16, dtype=dtype, seed=11)
    x[:, 1, 5] = value  # one constant group: head 1, channel 5
    return x


def _v_with_constant_group(value: float, dtype: torch.dtype) -> torch.Tensor:
    x = _randn(3, 2, 128, dtype=dtype, seed=12)
    x[1, 0, 64:] = value  # one constant group: token 1, head 0, channels 64..127
    return x


@pytest.mark.parametrize("use_triton", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [0.0, -1.5, 2.0**-20, 1024.0, 61440.0])
def test_constant_group_of_an_fp16_value_is_exact(use_triton, dtype, value):
    """Scale 1, codes 0, lo the value: decoded exactly, as the reference does (0.0 is the
    common case: residuals of values a loop left unchanged; 2^-20 is an fp16 subnormal; 61440
    is near the top of fp16 and exact in bf16)."""
    x = _k_with_constant_channel(value, dtype)
    kg, decoded = _k_codec(x, use_triton)
    assert kg.scale[0, 1, 5].item() == 1.0 and kg.lo[0, 1, 5].item() == value
    assert not kg.codes[0, :, 1, 5].any()
    _same(decoded[:, 1, 5], x[:, 1, 5])
    _same(decoded, quantize_rows(x, "k", bits=4, group_size=64))

    x = _v_with_constant_group(value, dtype)
    vg, decoded = _v_codec(x, use_triton)
    assert vg.scale[1, 0, 1].item() == 1.0 and vg.lo[1, 0, 1].item() == value
    assert not vg.codes[1, 0, 32:].any()
    _same(decoded[1, 0, 64:], x[1, 0, 64:])
    _same(decoded, quantize_rows(x, "v", bits=4, group_size=64))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's 1e5 -> fp16
@pytest.mark.parametrize("use_triton", BACKENDS)
@pytest.mark.parametrize("dtype, value", [(torch.float32, 0.1), (torch.bfloat16, 1e-6), (torch.float32, 1e5)])
def test_constant_group_of_a_value_fp16_cannot_hold_rounds_to_fp16(use_triton, dtype, value):
    """A constant group stores its value as its fp16 minimum, as the reference does: it
    decodes fp16(value), rounded to nearest even (0.1 -> 0.0999755859375, bf16 1e-6 -> an
    fp16 subnormal, 1e5 -> inf), bit for bit the reference's."""
    x = _k_with_constant_channel(value, dtype)
    want = quantize_rows(x, "k", bits=4, group_size=64)
    _, decoded = _k_codec(x, use_triton)
    as_fp16 = x[:, 1, 5].half().to(dtype)
    assert not torch.equal(as_fp16, x[:, 1, 5])
    _same(decoded[:, 1, 5], as_fp16)
    _same(decoded, want)

    x = _v_with_constant_group(value, dtype)
    want = quantize_rows(x, "v", bits=4, group_size=64)
    _, decoded = _v_codec(x, use_triton)
    _same(decoded[1, 0, 64:], x[1, 0, 64:].half().to(dtype))
    _same(decoded, want)


@pytest.mark.parametrize("use_triton", BACKENDS)
def test_constant_negative_zero_decodes_as_positive_zero(use_triton):
    """The one fp16 value a constant group loses: the sign of -0.0 (lo16 + 1 * 0 = +0.0),
    in the reference as here."""
    x = _k_with_constant_channel(-0.0, torch.float32)
    want = quantize_rows(x, "k", bits=4, group_size=64)
    kg, decoded = _k_codec(x, use_triton)
    _same(decoded, want)
    assert str(kg.lo[0, 1, 5].item()) == "-0.0" and str(decoded[0, 1, 5].item()) == "0.0"


# --- rounding, clipping, padding, nibble order, error bound -----------------------------

@pytest.mark.parametrize("use_triton", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_round_half_to_even(use_triton, dtype):
    """lo = -2, hi = -2 + 15 / 4: scale 1/4 and lo are exact in fp16, and lo + (k + 1/2) / 4
    sits exactly on a code boundary: k + 1/2 rounds to the even neighbour."""
    k = torch.arange(62) % 15
    ties = -2.0 + (k + 0.5) / 4
    column = torch.cat([torch.tensor([-2.0, -2.0 + 15 / 4]), ties])  # 64 values
    want_codes = torch.cat([torch.tensor([0, 15]), k + k % 2]).to(torch.uint8)
    assert (want_codes % 2 == 0)[2:].all()

    x = column.view(64, 1, 1).expand(64, 2, 8).to(DEVICE, dtype).contiguous()
    kg, decoded = _k_codec(x, use_triton)
    assert (kg.scale == 0.25).all() and (kg.lo == -2.0).all()
    _same(unpack_codes(kg.codes, 1)[0], want_codes.to(DEVICE).view(64, 1, 1).expand(64, 2, 8))
    _same(decoded, quantize_rows(x, "k", bits=4, group_size=64))

    v = column.view(1, 1, 64).expand(3, 2, 64).to(DEVICE, dtype).contiguous()
    vg, decoded = _v_codec(v, use_triton)
    _same(unpack_codes(vg.codes, 2), want_codes.to(DEVICE).expand(3, 2, 64))
    _same(decoded, quantize_rows(v, "v", bits=4, group_size=64))


@pytest.mark.parametrize("use_triton", BACKENDS)
def test_codes_clip_when_the_fp16_minimum_is_off(use_triton):
    """A large offset with a small spread: fp16(lo) is 0.5 away from lo at 1000, so codes
    leave 0..15 before clipping, as in the reference. lo = 1000.2 rounds down to 1000 (the top
    clips to 15); lo = 1000.4 rounds up to 1000.5 (the bottom clips to 0)."""
    for lo, clipped in ((1000.2, 15), (1000.4, 0)):
        values = lo + 0.15 * torch.arange(64) / 63
        v = values.view(1, 1, 64).to(DEVICE)
        vg, decoded = _v_codec(v, use_triton)
        raw = (values - vg.lo.float().item()) / vg.scale.float().item()
        assert (raw > 15.5).any() if clipped else (raw < -0.5).any()
        codes = unpack_codes(vg.codes, 2).flatten().cpu()
        assert (codes[(raw > 15.5) | (raw < -0.5)] == clipped).all()
        _same(decoded, quantize_rows(v, "v", bits=4, group_size=64))
        fq = quantize(v.flatten(), 0, bits=4)
        _same(codes.to(DEVICE), fq.codes)
        _same(decoded.flatten(), dequantize(fq))


@pytest.mark.parametrize("use_triton", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_groups_ignore_the_padding(use_triton, dtype):
    """Rows past valid[g] (NaN here) never reach the statistics: each group is the reference's
    group of its valid rows alone; padding stores code 0 and decodes to lo; valid 0 is a
    constant group of 0. (One valid row makes every channel a constant group: see
    test_single_row_groups_are_constant.)"""
    rows = [37, 2, 0, 64]
    clean = _randn(4, 64, 2, 16, dtype=dtype, seed=21)
    x = clean.clone()
    for g, n in enumerate(rows):
        x[g, n:] = float("nan")
    valid = torch.tensor(rows, device=DEVICE, dtype=torch.int32)
    kg = quantize_k_groups(x, valid, use_triton=use_triton)
    decoded = dequantize_k_groups(kg, dtype, use_triton=use_triton)
    assert not decoded.isnan().any()
    codes = unpack_codes(kg.codes, 1)
    for g, n in enumerate(rows):
        assert not codes[g, n:].any()
        _same(decoded[g, n:], kg.lo[g].to(dtype).expand(64 - n, 2, 16))
        if n:
            _same(decoded[g, :n], dequantize(quantize(clean[g, :n], 0, bits=4)))
    assert (kg.scale[2] == 1).all() and (kg.lo[2] == 0).all()
    # one short group of a plane, by split_k_plane
    plane = clean[0, :37]
    _, decoded = _k_codec(plane, use_triton)
    _same(decoded, quantize_rows(plane, "k", bits=4, group_size=64))


@pytest.mark.parametrize("use_triton", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_row_groups_are_constant(use_triton, dtype):
    """A K group with one valid row (a plane's short last group) is constant in every channel:
    it decodes fp16(x), as the reference does (x itself for bf16 in fp16's range)."""
    x = _randn(1, 2, 16, dtype=dtype, seed=22)
    kg, decoded = _k_codec(x, use_triton)
    assert (kg.scale == 1).all() and not kg.codes.any()
    _same(decoded, x.half().to(dtype))
    _same(decoded, quantize_rows(x, "k", bits=4, group_size=64))


@pytest.mark.parametrize("use_triton", BACKENDS)
def test_nibble_order_even_index_low(use_triton):
    """byte = code[2i] | code[2i + 1] << 4: along rows for K, along channels for V."""
    r = torch.arange(64)[:, None, None]
    h = torch.arange(2)[None, :, None]
    d = torch.arange(8)[None, None, :]
    codes = (r + 3 * h + d) % 16  # every group spans 0..15: lo 0, scale 1, code = value
    kg = quantize_k_groups(codes.float().to(DEVICE)[None], torch.tensor([64], device=DEVICE), use_triton=use_triton)
    assert (kg.scale == 1).all() and (kg.lo == 0).all()
    p = torch.arange(32)[:, None, None]
    want = ((2 * p + 3 * h + d) % 16) | (((2 * p + 1 + 3 * h + d) % 16) << 4)
    _same(kg.codes[0].cpu(), want.to(torch.uint8))

    c = torch.arange(64)[None, None, :]
    n = torch.arange(3)[:, None, None]
    vg = quantize_v_groups(((c + n + 5 * h) % 16).float().to(DEVICE), use_triton=use_triton)
    i = torch.arange(32)[None, None, :]
    want = ((2 * i + n + 5 * h) % 16) | (((2 * i + 1 + n + 5 * h) % 16) << 4)
    _same(vg.codes.cpu(), want.to(torch.uint8))


@pytest.mark.parametrize("use_triton", BACKENDS)
def test_reconstruction_error_within_half_a_step(use_triton):
    """Without clipping (random data: lo16 is within 2^-11 |lo| of lo), every element decodes
    within scale16 / 2 of its value, plus fp32 rounding of the code and of the decode."""
    x = _randn(100, 2, 64, dtype=torch.float32, seed=31, scale=4.0)
    kg, decoded = _k_codec(x, use_triton)  # a full group and a short one
    groups = torch.arange(100, device=DEVICE) // 64
    step = kg.scale.float()[groups]
    raw = (x - kg.lo.float()[groups]) / step
    assert raw.min() >= -0.5 and raw.max() <= 15.5  # no clipping here
    assert ((decoded - x).abs() <= step / 2 * (1 + 2**-20) + 2**-22 * x.abs()).all()

    x = x[:8].reshape(8, 1, 128)  # two groups per head
    _, decoded = _v_codec(x, use_triton)
    step = quantize_v_groups_reference(x).scale.float().repeat_interleave(64, dim=2)
    assert ((decoded - x).abs() <= step / 2 * (1 + 2**-20) + 2**-22 * x.abs()).all()


# --- dispatch and shapes -------------------------------------------------------------

def test_default_backend_and_shapes():
    """Triton by default on CUDA, the torch reference on CPU (the two agree, above); empty
    inputs; fake_quantize_group of a full 64-row group is the codec's K and V alike."""
    x = _randn(64, 1, 64, dtype=torch.bfloat16, seed=41)
    groups, valid = split_k_plane(x)
    assert groups.data_ptr() == x.data_ptr() and valid.tolist() == [64]  # a view
    kg = quantize_k_groups(groups, valid)
    assert kg.codes.shape == (1, 32, 1, 64) and kg.scale.shape == kg.lo.shape == (1, 1, 64)
    assert kg.codes.dtype == torch.uint8 and kg.scale.dtype == kg.lo.dtype == torch.float16
    column = x[:, 0, 3].contiguous()
    _same(dequantize_k_groups(kg, torch.bfloat16)[0, :, 0, 3], fake_quantize_group(column))
    vg = quantize_v_groups(column.view(1, 1, 64))
    assert vg.codes.shape == (1, 1, 32) and vg.scale.shape == (1, 1, 1)
    _same(dequantize_v_groups(vg, torch.bfloat16).flatten(), fake_quantize_group(column))

    groups, valid = split_k_plane(_randn(130, 1, 64, dtype=torch.bfloat16, seed=42))
    assert groups.shape == (3, 64, 1, 64) and valid.tolist() == [64, 64, 2]
    for use_triton in BACKENDS:
        empty = quantize_k_groups(torch.zeros(0, 64, 2, 16, device=DEVICE), torch.zeros(0, dtype=torch.int32,
                                  device=DEVICE), use_triton=use_triton)
        assert empty.codes.shape == (0, 32, 2, 16)
        assert dequantize_k_groups(empty, torch.float32, use_triton=use_triton).shape == (0, 64, 2, 16)
        empty = quantize_v_groups(torch.zeros(0, 2, 16, device=DEVICE), use_triton=use_triton)
        assert dequantize_v_groups(empty, torch.float32, use_triton=use_triton).shape == (0, 2, 16)
    with pytest.raises(AssertionError):
        quantize_k_groups(torch.zeros(1, 32, 2, 16, device=DEVICE), torch.ones(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(AssertionError):  # fp64 only through the torch references
        quantize_v_groups(torch.zeros(1, 2, 16, dtype=torch.float64, device=DEVICE), use_triton=True)
    x64 = _randn(3, 2, 128, dtype=torch.float64, seed=31)
    _same(dequantize_v_groups(quantize_v_groups(x64, use_triton=False), torch.float64, use_triton=False),
          quantize_rows(x64, "v", bits=4, group_size=64))
    k64 = _randn(70, 2, 16, dtype=torch.float64, seed=32)
    _, decoded = _k_codec(k64, use_triton=False)
    _same(decoded, quantize_rows(k64, "k", bits=4, group_size=64))
    with pytest.raises(AssertionError):
        quantize_v_groups(torch.zeros(1, 2, 15, device=DEVICE))
    with pytest.raises(AssertionError):
        quantize_v_groups(torch.zeros(1, 2, 16, device=DEVICE), bits=8)
