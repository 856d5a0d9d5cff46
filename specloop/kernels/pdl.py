"""Programmatic dependent launch (PDL; Hopper and later, CUDA only), for batch-1 decode,
where a layer-pass is a chain of small kernels and each boundary idles the GPU while the
next kernel launches and fills.

A kernel launched with the PDL attribute (`launch_pdl=True`) may start once every program
of the kernel before it has released its dependents (`gdc_launch_dependents`) or exited;
it must call `gdc_wait`, which returns when that kernel has finished and its writes are
visible, before it reads anything that kernel (or one before it) writes, and before it
writes anything they may still read. Here:

- the one-row products (`gemv`) are launched with the attribute; each reads its first
  weight tile (nothing a kernel writes) before `gdc_wait`, so a matmul's weight stream
  starts while the kernel before it runs;
- with `RELEASE_EARLY`, the kernels that come before them in a decode layer-pass (the norm
  launches, the paged attention and its split-KV combine) release their dependents as
  they start, so the product's programs launch beside them; a release changes nothing a
  kernel computes, and a dependent launched without the attribute ignores it.

Bits are unchanged either way (tests/test_kernels_gemv.py and
tests/test_kernels_paged_attention.py, on the GPU). On by default (`SPECLOOP_PDL=0` turns it
off): on an H100, batch-1 decode after 1K went from 149.9 / 150.2 to 152.7 / 152.9 tok/s
with the early releases, and to 146.4 / 146.7 without them (`bench/gemv_sweep.py`'s `pdl`
and `pdl-early` variants, bench/results/gemv_sweep_engine_pdl_h100.json)."""

from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("SPECLOOP_PDL", "1") != "0"
RELEASE_EARLY = True

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def on(t: torch.Tensor) -> bool:
    """Whether launches on t's device use PDL (`ENABLED`, NVIDIA CUDA, compute capability
    >= 9, not the interpreter)."""
    return ENABLED and t.is_cuda and not _INTERPRET and _hopper(t.device.index)


@functools.lru_cache(maxsize=None)
def _hopper(index: int | None) -> bool:
    """NVIDIA compute capability >= 9 (asked once a device: every eager norm and attention
    launch asks)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def release(t: torch.Tensor) -> bool:
    """Whether a kernel before a PDL launch on t's device releases its dependents as it starts."""
    return RELEASE_EARLY and on(t)
