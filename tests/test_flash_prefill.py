"""Prompt chunks through flash attention over contiguous keys (`specloop.kernels.flash_prefill`).

On CPU flash attention is not available, so the engine cases force the path with the
paged kernel over the gathered keys in flash's place (under the interpreter): what they
check is the forward batch leaving the chunks out of the tiles, the key slots and the
assembled output, against the same backend without the path, bit for bit (fp32). On CUDA the kernel is checked against the reference in bf16, and a bf16
engine with the path against one without it.
"""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.kernels import flash_prefill
from specloop.kernels.flash_prefill import chunk_attention_reference
from specloop.kernels.paged_attention import paged_attention, query_tiles
from specloop.runtime import attention
from specloop.runtime.forward_batch import kv_slots
from specloop.runtime.kv_format import sdpa
from tests.engine_runs import assert_same, run_staggered

CUDA = torch.cuda.is_available()
PROMPTS = [list(range(3, 60)), [5, 9, 2], [7] * 23 + list(range(40, 70))]


def test_key_slots_follow_the_page_table():
    tables = torch.tensor([9, 9, 4, 0, 7, 2, 5])
    slots = kv_slots(tables, 2, torch.arange(13), 4)  # what the backend gathers a chunk's keys at
    want = [tables[2 + j // 4].item() * 4 + j % 4 for j in range(13)]
    assert slots.tolist() == want


@pytest.mark.parametrize("n,keys,heads,kv_heads", [(1, 1, 2, 2), (5, 5, 4, 2), (7, 30, 4, 1), (30, 31, 2, 2)])
def test_reference_is_causal_attention_aligned_bottom_right(n, keys, heads, kv_heads):
    gen = torch.Generator().manual_seed(n * 31 + keys)
    q = torch.randn(n, heads, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(keys, kv_heads, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(keys, kv_heads, 16, generator=gen, dtype=torch.float64)
    mask = torch.arange(keys)[None, :] <= torch.arange(keys - n, keys)[:, None]
    torch.testing.assert_close(chunk_attention_reference(q, k, v, 0.25), sdpa(q, k, v, mask, 0.25),
                               atol=1e-12, rtol=1e-12)


def test_not_supported_on_cpu_or_fp32():
    assert not flash_prefill.supported(torch.device("cpu"), torch.bfloat16, 128)
    if CUDA:
        assert not flash_prefill.supported(torch.device("cuda"), torch.float32, 128)


@pytest.mark.skipif(not CUDA, reason="flash attention runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,keys,heads,kv_heads", [(64, 64, 16, 16), (100, 700, 8, 2), (513, 2048, 4, 4)])
def test_flash_matches_the_reference(dtype, n, keys, heads, kv_heads):
    assert flash_prefill.supported(torch.device("cuda"), dtype, 128)
    gen = torch.Generator(device="cuda").manual_seed(n + keys)
    q = torch.randn(n, heads, 128, generator=gen, device="cuda").to(dtype)
    k = torch.randn(keys, kv_heads, 128, generator=gen, device="cuda").to(dtype)
    v = torch.randn(keys, kv_heads, 128, generator=gen, device="cuda").to(dtype)
    got = flash_prefill.flash_chunk_attention(q, k, v, 128 ** -0.5)
    want = chunk_attention_reference(q, k, v, 128 ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    strided = torch.cat([q, q], dim=1)[:, :heads]  # q as the model gives it: a view with a row stride
    torch.testing.assert_close(flash_prefill.flash_chunk_attention(strided, k, v, 128 ** -0.5), got)


@pytest.mark.skipif(not CUDA, reason="flash attention runs on CUDA")
@pytest.mark.parametrize("fn", ["_square", "_after_prefix"])
def test_each_backend_on_a_square_chunk(fn):
    """Both the cuDNN path (taken where queries are as many as keys, when it works here) and
    flash on the same square chunk, against the reference."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(300, 8, 128, generator=gen, device="cuda").bfloat16() for _ in range(3))
    assert flash_prefill.supported(torch.device("cuda"), torch.bfloat16, 128)
    if fn == "_square" and flash_prefill.square_key(q.device, torch.bfloat16, 128) not in flash_prefill._SQUARE_MODE:
        pytest.skip("cuDNN attention is not available here")
    got = getattr(flash_prefill, fn)(q, k, v, 128 ** -0.5)
    torch.testing.assert_close(got.float(), chunk_attention_reference(q, k, v, 128 ** -0.5).float(),
                               atol=1e-2, rtol=1e-2)


def _engine(ckpt, backend: str, dtype: str = "float32", **kw) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(
        str(ckpt), device="cuda" if CUDA else "cpu", dtype=dtype, attention_backend=backend, block_size=4,
        max_num_batched_tokens=32, max_num_seqs=4, **kw))


def paged_over_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """What the paged kernel computes for the chunk, over its keys made contiguous (pages in
    order): a row's output does not depend on its tiles (`paged_attention.BLOCK_N`), so
    this is bit for bit the paged launch's, and any difference is the path's bookkeeping."""
    n, lk, page = q.shape[0], k.shape[0], 4
    pad = -lk % page
    k, v = (torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in (k, v))
    tables = torch.arange((lk + pad) // page)
    positions = torch.arange(lk - n, lk)
    tiles = torch.tensor(query_tiles([(0, n, 0)], 64)).view(-1, 3)
    return paged_attention(q, k, v, tables, positions, tiles, page, tile_rows=64)[0]


@pytest.fixture
def forced(monkeypatch):
    """The path on with the paged kernel over the gathered keys in flash's place, chunks
    from 8 rows; counts calls."""
    calls = []

    def reference(q, k, v, scale):
        calls.append((q.shape[0], k.shape[0]))
        assert scale == q.shape[-1] ** -0.5
        return paged_over_contiguous(q, k, v, scale)

    monkeypatch.setattr(flash_prefill, "supported", lambda *a: True)
    monkeypatch.setattr(flash_prefill, "flash_chunk_attention", reference)
    monkeypatch.setattr(attention.TritonAttention, "CONTIGUOUS_MIN_ROWS", 8)
    return calls


def _check_tiles(engine: EngineCore, exact: bool) -> list[int]:
    """Wrap the engine's forward batch: in every pass the tiles cover the rows of the groups
    not listed contiguous (`exact`: all of them; else some may be left out, as sparse
    decode's corrections are) and none of theirs, small tiles where those are all small;
    returns a list that grows by one per pass with a contiguous chunk beside tiled rows."""
    builder, mixed = engine.executor.runner.batches, []
    small, _ = builder.tile_rows
    build = builder.build

    def checked(plan):
        batch = build(plan)
        for lp in batch.passes:
            covered = set()
            for first, rows, _ in lp.tiles.tolist():
                covered.update(range(first, first + rows))
            chunks = {s.first for s in lp.contiguous}
            tiled = [s for s in lp.groups if s.first not in chunks]
            assert all(s.rows >= 8 and s.context >= s.rows for s in lp.contiguous)
            want = {r for s in tiled for r in range(s.first, s.first + s.rows)}
            assert covered == want or (exact is False and covered <= want)
            if lp.contiguous and tiled:
                mixed.append(1)
                assert lp.tile_rows == (small if max(s.rows for s in tiled) <= small else lp.tile_rows)
        return batch

    builder.build = checked
    return mixed


@pytest.mark.skipif(CUDA, reason="forces the path with the CPU reference (CUDA: the cases below)")
@pytest.mark.parametrize("mode", [
    {},
    {"speculation": "block", "num_speculative_tokens": 3, "draft_loops": 1},
    {"exit_threshold": 0.5},
    {"token_sparse_prefill": {"enabled": True, "window": 8}, "sparse_decode_attention": {"enabled": True}},
], ids=["plain", "block", "exit", "sparse"])
def test_engine_with_the_path_equals_the_paged_kernel(tiny_ckpt, forced, monkeypatch, mode):
    engine = _engine(tiny_ckpt, "triton", **mode)
    assert engine.backend.contiguous_min_rows == 8
    mixed = _check_tiles(engine, exact="sparse_decode_attention" not in mode)
    got = run_staggered(engine, PROMPTS, max_tokens=5, sampled=1)
    assert mixed, "no pass had a chunk beside tiled rows"
    assert forced and all(n >= 8 and keys >= n for n, keys in forced)
    assert any(keys > n for n, keys in forced), "a chunk after its prefix"
    assert any(keys == n for n, keys in forced), "a chunk that is its whole context"
    monkeypatch.setattr(flash_prefill, "supported", lambda *a: False)
    paged = _engine(tiny_ckpt, "triton", **mode)
    assert paged.backend.contiguous_min_rows is None
    assert_same(got, run_staggered(paged, PROMPTS, max_tokens=5, sampled=1), 0.0)


@pytest.mark.skipif(CUDA, reason="INT4 residuals on CPU")
def test_int4_residuals_keep_the_two_source_kernel(tiny_ckpt, forced):
    engine = _engine(tiny_ckpt, "triton", kv_residual_quantization={"enabled": True})
    assert engine.backend.contiguous_min_rows is None


@pytest.mark.skipif(not CUDA, reason="bf16 flash attention on CUDA")
def test_bf16_engine_with_flash_prefill_near_the_paged_kernel(tiny_ckpt, monkeypatch):
    """Long prompts in 256-row chunks beside decodes (CUDA graphs on), bf16: each token's
    logprob with the flash path within bf16 noise of the paged kernel's, as long as the
    tokens before it agree."""
    prompts = [[3 + (7 * i) % 370 for i in range(700)], [11] * 300, [3 + (5 * i) % 370 for i in range(400)]]

    def run(contiguous: bool):
        if not contiguous:
            monkeypatch.setattr(flash_prefill, "supported", lambda *a: False)
        engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cuda", dtype="bfloat16",
                                                     max_num_batched_tokens=256, max_num_seqs=4))
        assert (engine.backend.contiguous_min_rows is not None) == contiguous
        return run_staggered(engine, prompts, max_tokens=4, sampled=-1)

    got, want = run(True), run(False)
    for rid in want:
        for i in range(4):
            assert abs(got[rid][1][i] - want[rid][1][i]) < 5e-2, (rid, got[rid], want[rid])
            if got[rid][0][i] != want[rid][0][i]:
                break
