"""The paged attention kernel against its torch reference on random inputs.

Runs natively on CUDA and under Triton's interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU). Each case mixes row groups the way a forward
call does: single decode rows, verification-sized groups, a prompt chunk longer than a
tile, at nonconsecutive positions and different planes (page tables), pages shuffled over
the pool. Split-KV on and off, GQA and MHA, head dims that are and are not powers of two,
padding tiles. Tolerances: fp32 1e-5, bf16/fp16 2e-2 (output) and lse 1e-4 / 2e-2.
"""

from __future__ import annotations

import pytest
import torch

from specloop.kernels.paged_attention import (
    block_g, choose_splits, paged_attention, paged_attention_reference, query_tiles,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _case(seed: int, group_rows: list[int], heads: int, kv_heads: int, dim: int, page_size: int,
          dtype: torch.dtype, tile_rows: int, pad_tiles: int = 0, min_start: int = 0):
    """Groups of the given row counts, each at a random start position (at least
    `min_start`) with its own pages."""
    gen = torch.Generator().manual_seed(seed)
    pages = 40 + -(-min_start // page_size)
    k = torch.randn(pages * page_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(pages * page_size, kv_heads, dim, generator=gen).to(dtype)
    n = sum(group_rows)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    tables, positions, groups = [], [], []
    first = 0
    for rows in group_rows:
        start = min_start + int(torch.randint(0, 3 * page_size, (1,), generator=gen))
        end = start + rows
        need = -(-end // page_size)
        groups.append((first, rows, len(tables)))
        tables.extend(torch.randperm(pages, generator=gen)[:need].tolist())
        positions.extend(range(start, end))
        first += rows
    tiles = query_tiles(groups, tile_rows) + [0, 0, 0] * pad_tiles
    to = dict(device=DEVICE)
    return (q.to(**to), k.to(**to), v.to(**to), torch.tensor(tables, dtype=torch.int32, **to),
            torch.tensor(positions, **to), torch.tensor(tiles, **to).view(-1, 3))


def _check(args, page_size, dtype, **kw):
    out, lse = paged_attention(*args, page_size, return_lse=True, **kw)
    want, want_lse = paged_attention_reference(*args, page_size)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-4 if dtype == torch.float32 else tol, rtol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (4, 4, 8), (6, 2, 12), (8, 1, 32)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_groups_match_reference(heads, kv_heads, dim, splits, dtype):
    """Decode rows, a 5-row verification and a 19-row chunk in one launch."""
    page_size = 4
    tile_rows = max(1, 16 // block_g(heads, kv_heads))
    args = _case(heads * 100 + dim + splits, [1, 5, 1, 19, 1], heads, kv_heads, dim, page_size, dtype, tile_rows,
                 pad_tiles=2)
    _check(args, page_size, dtype, tile_rows=tile_rows, num_splits=splits, block_n=16)


@pytest.mark.parametrize("page_size, block_n", [(16, 16), (16, 32), (1, 16), (8, 64)])
def test_page_sizes_and_key_blocks(page_size, block_n):
    args = _case(page_size + block_n, [1, 3, 9], 4, 2, 16, page_size, torch.float32, 8)
    _check(args, page_size, torch.float32, tile_rows=8, num_splits=2, block_n=block_n)


@pytest.mark.parametrize("splits, block_n", [(1, 16), (1, 32), (3, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_deep_in_their_context(splits, block_n, dtype):
    """Prompt chunks and decode rows past 150 keys: most key blocks lie below every row of
    a tile (read unmasked), then the diagonal's blocks (masked per pair)."""
    args = _case(splits * 10 + block_n, [37, 1, 16, 1], 4, 2, 32, 8, dtype, 16, min_start=150)
    _check(args, 8, dtype, tile_rows=16, num_splits=splits, block_n=block_n)


def test_nonconsecutive_positions_in_a_tile():
    """Causal by position, not by row index: a tile whose rows' positions are out of order."""
    args = list(_case(7, [6], 4, 4, 16, 4, torch.float32, 16))
    args[4] = torch.tensor([9, 2, 5, 0, 11, 3], device=DEVICE)
    _check(tuple(args), 4, torch.float32, tile_rows=16, num_splits=2, block_n=16)


def test_rows_without_a_tile_are_not_written():
    q, k, v, tables, positions, tiles = _case(3, [1, 1, 1], 4, 4, 16, 4, torch.float32, 16)
    sentinel = torch.full_like(q, 7.0)
    out, _ = paged_attention(q, k, v, tables, positions, tiles[[0, 2]].contiguous(), 4, tile_rows=16, out=sentinel)
    assert torch.equal(out[1], torch.full_like(q[1], 7.0))
    want, _ = paged_attention_reference(q, k, v, tables, positions, tiles, 4)
    torch.testing.assert_close(out[[0, 2]], want[[0, 2]], atol=1e-5, rtol=1e-5)


def test_reference_equals_dense_causal_attention():
    """The reference itself, on one group whose pages are in order: causal softmax attention."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 8, generator=gen), torch.randn(12, 2, 8, generator=gen), torch.randn(12, 2, 8, generator=gen)
    positions = torch.tensor([7, 8, 9])
    out, lse = paged_attention_reference(q, k, v, torch.tensor([0, 1, 2]), positions, torch.tensor([[0, 3, 0]]), 4)
    scores = torch.einsum("qhd,lhd->hql", q, k[:10]) / 8 ** 0.5
    scores = scores.masked_fill(torch.arange(10)[None, None, :] > positions[None, :, None], float("-inf"))
    torch.testing.assert_close(out, torch.einsum("hql,lhd->qhd", scores.softmax(-1), v[:10]))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).t())


def test_query_tiles_cut_groups():
    assert query_tiles([(0, 1, 0), (1, 5, 3), (6, 2, 9)], 2) == [0, 1, 0, 1, 2, 3, 3, 2, 3, 5, 1, 3, 6, 2, 9]


def test_choose_splits_fills_the_gpu_without_tiny_splits():
    assert choose_splits(1, 16, 8192, 132) == 17
    assert choose_splits(1, 16, 1024, 132) == 4  # no split under 256 keys
    assert choose_splits(32, 16, 1024, 132) == 1
    assert choose_splits(1, 1, 100_000, 132) == 32


@pytest.mark.skipif(DEVICE == "cpu" or torch.cuda.get_device_capability()[0] < 9, reason="PDL: CUDA, Hopper and later")
@pytest.mark.parametrize("splits", [1, 3])
def test_release_before_a_dependent_launch_changes_no_bits(monkeypatch, splits):
    """With `pdl` on, the attention (unsplit) or its combine lets the one-row product after
    it (the o projection of a decode row) start as it starts: the same bits as without,
    eager and from a CUDA graph."""
    from specloop.kernels import pdl
    from specloop.kernels.gemv import gemv

    q, k, v, tables, positions, tiles = _case(9, [1], 8, 8, 64, 16, torch.bfloat16, tile_rows=16, min_start=700)
    w = (torch.randn(512, 512, generator=torch.Generator().manual_seed(2)) / 16).to(DEVICE, torch.bfloat16)

    def step():
        out, _ = paged_attention(q, k, v, tables, positions, tiles, 16, tile_rows=16, num_splits=splits)
        return gemv(out.view(1, -1), w)

    def run(on: bool) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(pdl, "ENABLED", on)
        eager = step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        graph.replay()
        return eager, captured.clone()

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))
