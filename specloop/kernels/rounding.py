"""The one rounding helper the Triton kernels share.

`round_to(v, DTYPE, BF16_BY_HAND)`: fp32 `v` rounded to nearest even in DTYPE and returned
as fp32, which is what an eager op in DTYPE stores. Under `TRITON_INTERPRET=1` Triton's
fp32 -> bf16 cast truncates (../shared/docs/gpu.md), so callers pass BF16_BY_HAND there and
the rounding is done on the bits; NaN stays NaN.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(v, DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    if BF16_BY_HAND:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    else:
        return v.to(DTYPE).to(tl.float32)
