"""The KV write kernel against its torch reference: strided K/V views (as in the fused qkv
output), random distinct slots, with and without exited rows kept; exact (a copy)."""

from __future__ import annotations

import pytest
import torch

from specloop.kernels.kv_write import kv_write, kv_write_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, dim", [(2, 16), (3, 12)])
@pytest.mark.parametrize("with_keep", [False, True])
def test_kv_write_matches_reference(dtype, heads, dim, with_keep):
    gen = torch.Generator().manual_seed(heads * dim)
    n, pool = 7, 40
    qkv = torch.randn(n, (4 + 2 * heads) * dim + 3, generator=gen).to(DEVICE, dtype)
    k = qkv[:, 4 * dim: (4 + heads) * dim].view(n, heads, dim)
    v = qkv[:, (4 + heads) * dim: (4 + 2 * heads) * dim].view(n, heads, dim)
    slots = torch.randperm(pool, generator=gen)[:n].to(DEVICE)
    keep = (torch.rand(n, generator=gen) < 0.4).to(DEVICE) if with_keep else None
    caches = [torch.randn(pool, heads, dim, generator=gen).to(DEVICE, dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    kv_write(caches[0], caches[1], slots, k, v, keep)
    kv_write_reference(want[0], want[1], slots, k, v, keep)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    if with_keep:
        assert keep.any() and not keep.all()  # both kinds of rows ran


def test_no_rows_is_a_no_op():
    cache = torch.zeros(4, 2, 8, device=DEVICE)
    kv_write(cache, cache, torch.zeros(0, dtype=torch.long, device=DEVICE), torch.zeros(0, 2, 8, device=DEVICE),
             torch.zeros(0, 2, 8, device=DEVICE), None)
    assert not cache.any()
