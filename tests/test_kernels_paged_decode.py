"""The paged decode kernel against its torch reference on random inputs.

Runs natively on CUDA and under Triton's interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU). Pages are shuffled so a
row's keys are scattered over the pool; context lengths from 1 to a few pages, GQA and MHA,
head dims that are and are not powers of two. Tolerances: fp32 1e-5, bf16/fp16 2e-2.
"""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _case(seed: int, rows: int, heads: int, kv_heads: int, dim: int, page_size: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    pages = 24
    k = torch.randn(pages * page_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(pages * page_size, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    lens = torch.randint(1, 5 * page_size, (rows,), generator=gen)
    tables, offsets = [], []
    for length in lens.tolist():  # each row its own shuffled pages
        need = -(-length // page_size)
        offsets.append(len(tables))
        tables.extend(torch.randperm(pages, generator=gen)[:need].tolist())
    to = dict(device=DEVICE)
    return (q.to(**to), k.to(**to), v.to(**to), torch.tensor(tables, dtype=torch.int32, **to),
            torch.tensor(offsets, **to), lens.to(**to))


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (4, 4, 8), (6, 2, 12), (8, 1, 32)])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_decode_matches_reference(heads, kv_heads, dim, page_size, dtype):
    from specloop.kernels.paged_decode import paged_decode, paged_decode_reference

    args = _case(heads * 100 + dim + page_size, 5, heads, kv_heads, dim, page_size, dtype)
    out, lse = paged_decode(*args, page_size, block_n=8)
    want, want_lse = paged_decode_reference(*args, page_size)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-4 if dtype == torch.float32 else tol, rtol=1e-5)


def test_reference_equals_dense_softmax_attention():
    """The reference itself, on one row whose pages are in order: plain softmax attention."""
    from specloop.kernels.paged_decode import paged_decode_reference

    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, 8, generator=gen), torch.randn(12, 2, 8, generator=gen), torch.randn(12, 2, 8, generator=gen)
    out, lse = paged_decode_reference(q, k, v, torch.tensor([0, 1, 2]), torch.tensor([0]), torch.tensor([10]), 4)
    scores = torch.einsum("hd,lhd->hl", q[0], k[:10]) / 8 ** 0.5
    torch.testing.assert_close(out[0], torch.einsum("hl,lhd->hd", scores.softmax(-1), v[:10]))
    torch.testing.assert_close(lse[0], torch.logsumexp(scores, -1))
