"""INT4 affine groups of K and V (FlashLoop's cross-loop KV residuals) in Triton, with their torch references.

    kg = quantize_k_groups(x, valid)      # x [G, 64, Hkv, D], valid [G] int -> KGroups
    k = dequantize_k_groups(kg, dtype)    # -> [G, 64, Hkv, D]
    vg = quantize_v_groups(x)             # x [N, Hkv, D] -> VGroups
    v = dequantize_v_groups(vg, dtype)    # -> [N, Hkv, D]
    groups, valid = split_k_plane(plane)  # a plane [T, Hkv, D] as K groups (the last one short)

The arithmetic is the FlashLoop reference's fake quantization
(`specloop.model.flashloop_reference.quantize` and `dequantize`, 4 bits, group 64),
reproduced bit for bit:

- lo, hi = min and max over the group's valid elements (fp32);
- scale16 = fp16((hi - lo) / 15), at least 2^-24 (the smallest fp16 subnormal, so a spread
  that underflows fp16 never divides by 0); lo16 = fp16(lo); both rounded FIRST;
- code = clamp(round_half_even((x - lo16) / scale16), 0, 15), in fp32 from the rounded
  metadata, every division correctly rounded (`div_rn`, not Triton's approximate `/`);
- decode = lo16 + scale16 * code in fp32 (a product and an add, never a fused multiply-add),
  rounded once to the output dtype;
- a constant group (hi == lo, an all-padding group included) stores scale 1, codes 0 and
  lo16 = fp16(its value), so it decodes to fp16(value).

Groups. K: per channel over 64 consecutive token rows (after RoPE): group g of a plane
holds rows 64g..64g+63, `valid[g]` of them real; the rest are padding, ignored by the
statistics (never read by the kernels), stored as code 0 and decoded to lo16 (callers drop
them). V: per token over 64 consecutive channels of one head; head dim D (even) gives
ceil(D / 64) groups, the last one short when 64 does not divide D (D < 64: one group of D
channels).

Layout (every tensor contiguous, uint8 codes two to a byte, the EVEN index in the LOW
nibble: byte = code[2i] | code[2i + 1] << 4):

- KGroups.codes [G, 32, Hkv, D]: byte (g, p, h, d) holds rows 2p and 2p + 1 of channel d;
  scale, lo fp16 [G, Hkv, D]. The channel dim is contiguous, as in the KV pool [S, Hkv, D]
  (the plane's [T, Hkv, D] with token pairs folded into bytes): a (group, head) K tile is
  32 rows of D contiguous bytes at stride Hkv * D, and its metadata one D-vector each, so
  an attention kernel can take q . k = sum_d q_d lo_d + sum_d (q_d scale_d) code_td.
- VGroups.codes [N, Hkv, D / 2]: byte (n, h, i) holds channels 2i and 2i + 1; scale, lo
  fp16 [N, Hkv, ceil(D / 64)]. A (token, head) V row is D / 2 contiguous bytes followed by
  its group metadata, one (scale, lo) per 32 bytes.

Constant groups decode to fp16(value) in the reference too (decided for the INT4 issue:
FP16 parameters and nothing wider). That is the value itself for 0.0 (the common case:
residuals of values a loop left unchanged) and every bf16 value with 2^-14 <= |x| <= 65504;
otherwise rounded to nearest even (fp32 0.1 -> 0.0999755859375, bf16 1e-6 -> the nearest
fp16 subnormal, |x| >= 65520 -> +-inf); -0.0 decodes as +0.0 (lo16 + 1 * 0).

Only 4 bits (two codes per byte). Inputs fp32, bf16 or fp16 (the torch references also fp64: statistics
and codes in fp32 from the input rounded to fp32, as the FlashLoop reference does) and finite; the last dim must be
contiguous. The dispatchers run Triton on CUDA tensors (or on CPU under `TRITON_INTERPRET=1`
with use_triton=True) and the torch reference otherwise. No host sync: `valid` stays on
the device. Under the interpreter the fp32 -> bf16 cast truncates (Triton 3.x), so there
the decode rounds to bf16 by hand on the bits. So far checked under the interpreter only:
correctly rounded divisions, no FMA contraction and rounding on floor and remainder are
what should keep CUDA bit for bit too; the tests run there unchanged when CUDA is present.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from specloop.kernels import DTYPES

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BITS = 4
LEVELS = 2**BITS - 1
GROUP = 64  # elements of one group: token rows for K, channels for V
PAIRS = GROUP // 2  # bytes of one group's codes
SCALE_MIN = 2.0**-24  # smallest fp16 subnormal


@dataclasses.dataclass(frozen=True)
class KGroups:
    """K groups: codes uint8 [G, 32, Hkv, D] (rows 2p | 2p + 1 << 4), scale and lo fp16 [G, Hkv, D]."""

    codes: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor


@dataclasses.dataclass(frozen=True)
class VGroups:
    """V groups: codes uint8 [N, Hkv, D / 2] (channels 2i | 2i + 1 << 4), scale and lo fp16 [N, Hkv, ceil(D / 64)]."""

    codes: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor


# --- Triton ---------------------------------------------------------------------------

@triton.jit
def _stats(a, b, ok_a, ok_b, AXIS: tl.constexpr):
    """A group's (lo16, scale16, varies) from its even (a) and odd (b) elements along AXIS,
    kept as size-1 dims; lo16 and scale16 as fp32 holding fp16 values."""
    lo = tl.minimum(tl.min(tl.where(ok_a, a, float("inf")), axis=AXIS, keep_dims=True),
                    tl.min(tl.where(ok_b, b, float("inf")), axis=AXIS, keep_dims=True))
    hi = tl.maximum(tl.max(tl.where(ok_a, a, float("-inf")), axis=AXIS, keep_dims=True),
                    tl.max(tl.where(ok_b, b, float("-inf")), axis=AXIS, keep_dims=True))
    empty = lo > hi  # no valid element: a constant group of 0
    lo = tl.where(empty, 0.0, lo)
    hi = tl.where(empty, 0.0, hi)
    varies = hi != lo  # not a constant group
    lo16 = lo.to(tl.float16).to(tl.float32)
    # at least 2^-24, the smallest fp16 subnormal (a literal: jit code reads no plain globals)
    scale16 = tl.maximum(tl.math.div_rn(hi - lo, 15.0).to(tl.float16).to(tl.float32), 5.960464477539063e-08)
    return lo16, tl.where(varies, scale16, 1.0), varies


@triton.jit
def _code(x, ok, lo16, scale16, varies):
    """clamp(round_half_even((x - lo16) / scale16), 0, 15) as int32; 0 for padding and constant groups.
    Clamped before rounding (the same for every value), then rounded on floor and remainder
    (exact in fp32 below 16), which no compiler rewrite can change."""
    v = tl.minimum(tl.maximum(tl.math.div_rn(x - lo16, scale16), 0.0), 15.0)
    f = tl.floor(v)
    rest = v - f
    down = f.to(tl.int32)
    up = (rest > 0.5) | ((rest == 0.5) & ((down & 1) == 1))
    return tl.where(ok & varies, down + up.to(tl.int32), 0)


@triton.jit
def _decoded(code, lo16, scale16, DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """lo16 + scale16 * code in fp32 (the launch turns off FMA contraction), rounded to DTYPE
    to nearest even (by hand on the bits for bf16 under the interpreter)."""
    v = lo16 + scale16 * code.to(tl.float32)
    if BF16_BY_HAND:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(DTYPE)
    else:
        return v.to(DTYPE)


@triton.jit
def _quantize_k_kernel(x_ptr, valid_ptr, codes_ptr, scale_ptr, lo_ptr, stride_xg, stride_xr, stride_xh,
                       num_heads, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    p = tl.arange(0, 32)[:, None]  # row pair
    rows = tl.load(valid_ptr + g)
    d_ok = d < HEAD_DIM
    ok_a = (2 * p < rows) & d_ok
    ok_b = (2 * p + 1 < rows) & d_ok
    x = x_ptr + g * stride_xg + h * stride_xh + d
    a = tl.load(x + 2 * p * stride_xr, mask=ok_a, other=0.0).to(tl.float32)
    b = tl.load(x + (2 * p + 1) * stride_xr, mask=ok_b, other=0.0).to(tl.float32)
    lo16, scale16, varies = _stats(a, b, ok_a, ok_b, 0)  # [1, BLOCK_D]
    byte = _code(a, ok_a, lo16, scale16, varies) | (_code(b, ok_b, lo16, scale16, varies) << 4)
    tl.store(codes_ptr + ((g * 32 + p) * num_heads + h) * HEAD_DIM + d, byte.to(tl.uint8), mask=d_ok)
    meta = (g * num_heads + h) * HEAD_DIM + d
    tl.store(scale_ptr + meta, scale16.to(tl.float16), mask=d_ok)
    tl.store(lo_ptr + meta, lo16.to(tl.float16), mask=d_ok)


@triton.jit
def _dequantize_k_kernel(codes_ptr, scale_ptr, lo_ptr, out_ptr, num_heads, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    p = tl.arange(0, 32)[:, None]
    d_ok = d < HEAD_DIM
    meta = (g * num_heads + h) * HEAD_DIM + d
    scale16 = tl.load(scale_ptr + meta, mask=d_ok, other=1.0).to(tl.float32)
    lo16 = tl.load(lo_ptr + meta, mask=d_ok, other=0.0).to(tl.float32)
    byte = tl.load(codes_ptr + ((g * 32 + p) * num_heads + h) * HEAD_DIM + d, mask=d_ok, other=0).to(tl.int32)
    dtype = out_ptr.dtype.element_ty
    out = out_ptr + ((g * 64 + 2 * p) * num_heads + h) * HEAD_DIM + d  # row 2p; row 2p + 1 is num_heads * D on
    tl.store(out, _decoded(byte & 0xF, lo16, scale16, dtype, BF16_BY_HAND), mask=d_ok)
    tl.store(out + num_heads * HEAD_DIM, _decoded(byte >> 4, lo16, scale16, dtype, BF16_BY_HAND), mask=d_ok)


@triton.jit
def _v_tile(h0, num_heads, HEAD_DIM: tl.constexpr, NUM_GROUPS: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_G: tl.constexpr):
    """Indices of a (heads, groups, pairs) tile of one token: head [BH, 1, 1], group [1, BG, 1],
    even channel [1, BG, 32] and their masks."""
    h = h0 + tl.arange(0, BLOCK_H)[:, None, None]
    j = tl.arange(0, BLOCK_G)[None, :, None]
    c = 64 * j + 2 * tl.arange(0, 32)[None, None, :]
    h_ok = h < num_heads
    return h, j, c, h_ok & (c < HEAD_DIM), h_ok & (c + 1 < HEAD_DIM), h_ok & (j < NUM_GROUPS)


@triton.jit
def _quantize_v_kernel(x_ptr, codes_ptr, scale_ptr, lo_ptr, stride_xn, stride_xh, num_heads,
                       HEAD_DIM: tl.constexpr, NUM_GROUPS: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_G: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h, j, c, ok_a, ok_b, meta_ok = _v_tile(tl.program_id(1) * BLOCK_H, num_heads, HEAD_DIM, NUM_GROUPS,
                                           BLOCK_H, BLOCK_G)
    x = x_ptr + n * stride_xn + h * stride_xh + c
    a = tl.load(x, mask=ok_a, other=0.0).to(tl.float32)
    b = tl.load(x + 1, mask=ok_b, other=0.0).to(tl.float32)
    lo16, scale16, varies = _stats(a, b, ok_a, ok_b, 2)  # [BH, BG, 1]
    byte = _code(a, ok_a, lo16, scale16, varies) | (_code(b, ok_b, lo16, scale16, varies) << 4)
    tl.store(codes_ptr + (n * num_heads + h) * (HEAD_DIM // 2) + c // 2, byte.to(tl.uint8), mask=ok_a)
    meta = (n * num_heads + h) * NUM_GROUPS + j
    tl.store(scale_ptr + meta, scale16.to(tl.float16), mask=meta_ok)
    tl.store(lo_ptr + meta, lo16.to(tl.float16), mask=meta_ok)


@triton.jit
def _dequantize_v_kernel(codes_ptr, scale_ptr, lo_ptr, out_ptr, num_heads, HEAD_DIM: tl.constexpr,
                         NUM_GROUPS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr,
                         BF16_BY_HAND: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h, j, c, ok_a, ok_b, meta_ok = _v_tile(tl.program_id(1) * BLOCK_H, num_heads, HEAD_DIM, NUM_GROUPS,
                                           BLOCK_H, BLOCK_G)
    meta = (n * num_heads + h) * NUM_GROUPS + j
    scale16 = tl.load(scale_ptr + meta, mask=meta_ok, other=1.0).to(tl.float32)
    lo16 = tl.load(lo_ptr + meta, mask=meta_ok, other=0.0).to(tl.float32)
    byte = tl.load(codes_ptr + (n * num_heads + h) * (HEAD_DIM // 2) + c // 2, mask=ok_a, other=0).to(tl.int32)
    dtype = out_ptr.dtype.element_ty
    out = out_ptr + (n * num_heads + h) * HEAD_DIM + c
    tl.store(out, _decoded(byte & 0xF, lo16, scale16, dtype, BF16_BY_HAND), mask=ok_a)
    tl.store(out + 1, _decoded(byte >> 4, lo16, scale16, dtype, BF16_BY_HAND), mask=ok_b)


def _block_d(dim: int) -> int:
    return min(triton.next_power_of_2(dim), 128)


def _v_blocks(heads: int, groups: int) -> tuple[int, int]:
    block_g = triton.next_power_of_2(groups)
    return min(triton.next_power_of_2(heads), max(1, 16 // block_g)), block_g  # tiles of <= 16 * 64 channels


REFERENCE_DTYPES = (*DTYPES, torch.float64)  # the torch references also take fp64 (exact CPU tests)


def _check_k(x: torch.Tensor, valid: torch.Tensor, dtypes: tuple[torch.dtype, ...] = DTYPES) -> None:
    assert x.dtype in dtypes, f"INT4 groups take {', '.join(map(str, dtypes))}, not {x.dtype}"
    assert x.dim() == 4 and x.shape[1] == GROUP, f"K groups must be [G, {GROUP}, Hkv, D], got {tuple(x.shape)}"
    assert x.stride(3) == 1, "the head dim must be contiguous"
    assert valid.shape == (x.shape[0],) and not valid.is_floating_point(), "valid must be [G] int"
    assert valid.device == x.device, "valid on x's device"


def _check_v(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = DTYPES) -> None:
    assert x.dtype in dtypes, f"INT4 groups take {', '.join(map(str, dtypes))}, not {x.dtype}"
    assert x.dim() == 3 and x.shape[2] % 2 == 0, f"V rows must be [N, Hkv, D] with D even, got {tuple(x.shape)}"
    assert x.stride(2) == 1, "the head dim must be contiguous"


def _k_out(g: int, heads: int, dim: int, device: torch.device) -> KGroups:
    return KGroups(torch.empty(g, PAIRS, heads, dim, dtype=torch.uint8, device=device),
                   torch.empty(g, heads, dim, dtype=torch.float16, device=device),
                   torch.empty(g, heads, dim, dtype=torch.float16, device=device))


def _v_out(n: int, heads: int, dim: int, device: torch.device) -> VGroups:
    groups = triton.cdiv(dim, GROUP)
    return VGroups(torch.empty(n, heads, dim // 2, dtype=torch.uint8, device=device),
                   torch.empty(n, heads, groups, dtype=torch.float16, device=device),
                   torch.empty(n, heads, groups, dtype=torch.float16, device=device))


def quantize_k_groups_triton(x: torch.Tensor, valid: torch.Tensor) -> KGroups:
    """K groups in one launch: a program per (group, head, block of channels)."""
    _check_k(x, valid)
    g, _, heads, dim = x.shape
    out = _k_out(g, heads, dim, x.device)
    if x.numel():
        block = _block_d(dim)
        _quantize_k_kernel[(g, heads, triton.cdiv(dim, block))](
            x, valid, out.codes, out.scale, out.lo, x.stride(0), x.stride(1), x.stride(2), heads,
            HEAD_DIM=dim, BLOCK_D=block, enable_fp_fusion=False)
    return out


def dequantize_k_groups_triton(groups: KGroups, dtype: torch.dtype) -> torch.Tensor:
    assert dtype in DTYPES, f"INT4 groups decode to fp32, bf16 or fp16, not {dtype}"
    g, _, heads, dim = groups.codes.shape
    out = torch.empty(g, GROUP, heads, dim, dtype=dtype, device=groups.codes.device)
    if out.numel():
        block = _block_d(dim)
        _dequantize_k_kernel[(g, heads, triton.cdiv(dim, block))](
            groups.codes, groups.scale, groups.lo, out, heads, HEAD_DIM=dim, BLOCK_D=block,
            BF16_BY_HAND=_INTERPRET and dtype == torch.bfloat16, enable_fp_fusion=False)
    return out


def quantize_v_groups_triton(x: torch.Tensor) -> VGroups:
    """V groups in one launch: a program per (token, block of heads), every group of its heads."""
    _check_v(x)
    n, heads, dim = x.shape
    out = _v_out(n, heads, dim, x.device)
    if x.numel():
        num_groups = triton.cdiv(dim, GROUP)
        block_h, block_g = _v_blocks(heads, num_groups)
        _quantize_v_kernel[(n, triton.cdiv(heads, block_h))](
            x, out.codes, out.scale, out.lo, x.stride(0), x.stride(1), heads, HEAD_DIM=dim,
            NUM_GROUPS=num_groups, BLOCK_H=block_h, BLOCK_G=block_g, enable_fp_fusion=False)
    return out


def dequantize_v_groups_triton(groups: VGroups, dtype: torch.dtype) -> torch.Tensor:
    assert dtype in DTYPES, f"INT4 groups decode to fp32, bf16 or fp16, not {dtype}"
    n, heads, half = groups.codes.shape
    dim = 2 * half
    out = torch.empty(n, heads, dim, dtype=dtype, device=groups.codes.device)
    if out.numel():
        num_groups = triton.cdiv(dim, GROUP)
        block_h, block_g = _v_blocks(heads, num_groups)
        _dequantize_v_kernel[(n, triton.cdiv(heads, block_h))](
            groups.codes, groups.scale, groups.lo, out, heads, HEAD_DIM=dim, NUM_GROUPS=num_groups,
            BLOCK_H=block_h, BLOCK_G=block_g, BF16_BY_HAND=_INTERPRET and dtype == torch.bfloat16,
            enable_fp_fusion=False)
    return out


# --- torch references -----------------------------------------------------------------

def _encode(x32: torch.Tensor, ok: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 like x32, scale16, lo16 with `dim` kept as size 1) of groups along `dim`
    whose valid elements are `ok` (broadcast to x32)."""
    inf = torch.tensor(float("inf"), device=x32.device)
    lo = torch.where(ok, x32, inf).amin(dim, keepdim=True)
    hi = torch.where(ok, x32, -inf).amax(dim, keepdim=True)
    empty = lo > hi  # no valid element
    lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    constant = hi == lo
    lo16 = lo.half()
    # a tensor divisor: CUDA torch divides by a Python number as a product with its fp32
    # reciprocal, which rounds differently from the kernels' IEEE division now and then
    levels = torch.tensor(float(LEVELS), device=x32.device)
    scale16 = ((hi - lo) / levels).half().clamp_min(SCALE_MIN).masked_fill(constant, 1.0)
    codes = ((x32 - lo16.float()) / scale16.float()).round().clamp(0, LEVELS)  # round half to even
    codes = codes.masked_fill(constant | ~ok, 0).to(torch.uint8)
    return codes, scale16, lo16


def _pack(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Two codes per byte along `dim` (>= 0, even length): the even index in the low nibble."""
    pairs = codes.unflatten(dim, (-1, 2))
    return pairs.select(dim + 1, 0) | (pairs.select(dim + 1, 1) << 4)


def unpack_codes(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The codes of bytes packed along `dim` (>= 0), twice as long: byte i gives codes 2i (its
    low nibble) and 2i + 1 (its high nibble)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=dim + 1).flatten(dim, dim + 1)


def quantize_k_groups_reference(x: torch.Tensor, valid: torch.Tensor) -> KGroups:
    _check_k(x, valid, REFERENCE_DTYPES)
    rows_ok = torch.arange(GROUP, device=x.device)[None, :] < valid[:, None]  # [G, 64]
    codes, scale16, lo16 = _encode(x.float(), rows_ok[:, :, None, None], 1)
    return KGroups(_pack(codes, 1).contiguous(), scale16.squeeze(1), lo16.squeeze(1))


def dequantize_k_groups_reference(groups: KGroups, dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_codes(groups.codes, 1).float()  # [G, 64, H, D]
    return (groups.lo.float()[:, None] + groups.scale.float()[:, None] * codes).to(dtype)


def quantize_v_groups_reference(x: torch.Tensor) -> VGroups:
    _check_v(x, REFERENCE_DTYPES)
    n, heads, dim = x.shape
    num_groups = triton.cdiv(dim, GROUP)
    padded = torch.zeros(n, heads, num_groups * GROUP, dtype=torch.float32, device=x.device)
    padded[..., :dim] = x.float()
    ok = (torch.arange(num_groups * GROUP, device=x.device) < dim).view(num_groups, GROUP)
    codes, scale16, lo16 = _encode(padded.view(n, heads, num_groups, GROUP), ok, 3)
    packed = _pack(codes.flatten(2), 2)[..., : dim // 2]
    return VGroups(packed.contiguous(), scale16.squeeze(3), lo16.squeeze(3))


def dequantize_v_groups_reference(groups: VGroups, dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_codes(groups.codes, 2).float()  # [N, H, D]
    channel_group = torch.arange(codes.shape[2], device=codes.device) // GROUP
    scale, lo = groups.scale.float()[..., channel_group], groups.lo.float()[..., channel_group]
    return (lo + scale * codes).to(dtype)


# --- dispatch -------------------------------------------------------------------------

def _triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    """Triton on CUDA by default; use_triton=True also runs it on CPU under TRITON_INTERPRET=1."""
    if use_triton is None:
        return x.is_cuda
    assert not use_triton or x.is_cuda or _INTERPRET, "Triton runs on CUDA tensors or under TRITON_INTERPRET=1"
    return use_triton


def quantize_k_groups(x: torch.Tensor, valid: torch.Tensor, bits: int = BITS,
                      use_triton: bool | None = None) -> KGroups:
    """K groups of x [G, 64, Hkv, D] whose first valid[g] rows are real: per channel over the rows."""
    assert bits == BITS, f"INT4 groups only: bits must be {BITS}, got {bits}"
    fn = quantize_k_groups_triton if _triton(x, use_triton) else quantize_k_groups_reference
    return fn(x, valid)


def dequantize_k_groups(groups: KGroups, dtype: torch.dtype, use_triton: bool | None = None) -> torch.Tensor:
    """[G, 64, Hkv, D] in `dtype`; padding rows decode to lo16."""
    fn = dequantize_k_groups_triton if _triton(groups.codes, use_triton) else dequantize_k_groups_reference
    return fn(groups, dtype)


def quantize_v_groups(x: torch.Tensor, bits: int = BITS, use_triton: bool | None = None) -> VGroups:
    """V groups of x [N, Hkv, D]: per token and head over 64 channels (the last group may be short)."""
    assert bits == BITS, f"INT4 groups only: bits must be {BITS}, got {bits}"
    fn = quantize_v_groups_triton if _triton(x, use_triton) else quantize_v_groups_reference
    return fn(x)


def dequantize_v_groups(groups: VGroups, dtype: torch.dtype, use_triton: bool | None = None) -> torch.Tensor:
    """[N, Hkv, D] in `dtype`."""
    fn = dequantize_v_groups_triton if _triton(groups.codes, use_triton) else dequantize_v_groups_reference
    return fn(groups, dtype)


def split_k_plane(plane: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A plane [T, Hkv, D] of rows in position order as K groups [ceil(T / 64), 64, Hkv, D]
    (a view when 64 divides T; else a copy with zero padding) and valid [G] int32 (64 but
    the last). Decoded groups flatten back: out.flatten(0, 1)[:T]."""
    t, heads, dim = plane.shape
    g = triton.cdiv(t, GROUP)
    valid = (t - GROUP * torch.arange(g, device=plane.device, dtype=torch.int32)).clamp(max=GROUP)
    if t == g * GROUP:
        return plane.view(g, GROUP, heads, dim), valid
    padded = plane.new_zeros(g * GROUP, heads, dim)
    padded[:t] = plane
    return padded.view(g, GROUP, heads, dim), valid
