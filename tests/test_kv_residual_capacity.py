"""INT4 residuals raise capacity: with the same KV memory they serve every request BF16 pages
serve, on a byte budget split from the workload (`KVResidualFeature.split`), taking a
prompt's BF16 pages a chunk at a time (`KVManager.prompt_ahead`)."""

from __future__ import annotations

import pytest

from specloop.engine.build import CPU_KV_BYTES, CPU_KV_ENV
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.llm import default_model
from specloop.scheduling.kv_manager import span_pages
from specloop.sampling_params import SamplingParams

CASES = {
    "serial": {},
    "execution": {"kv_residual_quantization": {"policy": "execution", "tail": 32}},
    "token-sparse": {"token_sparse_prefill": {"window": 16, "retention": [1.0, 1.0, 0.5, 0.25]}},
    "block": {"speculation": "block"},
    "small rows": {"max_num_batched_tokens": 64},
}


def _engine(ckpt, int4: bool, budget: int, **kw) -> EngineCore:
    kw = dict(kw)
    group = kw.pop("kv_residual_quantization", {})
    return EngineCore(EngineConfig.from_kwargs(
        str(ckpt), device="cpu", dtype="float32", attention_backend="torch", kv_cache_bytes=budget, block_size=8,
        max_model_len=1024, kv_residual_quantization=dict(group, enabled=True) if int4 else None, **kw))


@pytest.mark.parametrize("case, budget", [(c, b) for c in sorted(CASES) for b in (1 << 20, 3 << 20, 16 << 20)
                                          if (c, b) != ("token-sparse", 1 << 20)])
def test_int4_serves_every_request_bf16_pages_serve(tiny_ckpt, case, budget):
    """For every length up to the context, a request that BF16 pages alone would serve in the
    same byte budget fits an INT4 engine's pages at once and its records; and the INT4
    engine serves longer ones than BF16 where the budget limits BF16. (Not with token-sparse
    prefill in 1 MiB, BF16's longest request 512 tokens: its spans, 3 windows and a sparse
    group's 256 positions past the tail, cover most of such a request, so its pages plus
    its records outgrow it; INT4 serves up to 448 tokens there.)"""
    dense = _engine(tiny_ckpt, False, budget, **CASES[case])
    int4 = _engine(tiny_ckpt, True, budget, **CASES[case])
    served = [t for t in range(16, 1025, 8) if dense.kv.fits_ever(t)]
    assert served, "the budget holds some request in BF16"
    for t in served:
        assert int4.kv.fits_ever(t, t - 8), (t, int4.kv.pages_at_once(t), int4.kv.num_pages)
    if served[-1] < 1024:  # BF16 is limited by the budget here: INT4 holds more
        assert int4.kv.fits_ever(served[-1] + 64, served[-1] + 56)


def test_derived_split_leaves_room_for_more_requests_than_bf16(tiny_ckpt):
    """At the context length, the derived split holds at least twice the requests BF16
    pages hold in the same bytes, in both regions: pages for their decode tails beside one
    prompt's working set, records for all their groups."""
    budget, length = 16 << 20, 1024
    dense, int4 = _engine(tiny_ckpt, False, budget), _engine(tiny_ckpt, True, budget)
    bf16 = dense.kv.num_pages // dense.kv.pages_for(length)
    records = int4.kv.records
    by_records = records.num_records // records.records_for(None, length, length)
    tails = span_pages(int4.kv.plane_spans(1), length, int4.kv.block_size)  # a decoding request's pages
    n = min(by_records, int4.config.max_num_seqs)
    assert n >= 2 * max(1, bf16), (n, bf16)
    assert int4.kv.num_pages >= int4.kv.pages_at_once(length) + (n - 1) * tails


def test_shipped_model_with_int4_takes_a_4000_token_prompt_on_the_default_pool(monkeypatch):
    """`specloop serve` with INT4 on, the shipped model and the engine's default CPU pool
    (256 MiB): a 4,000-token prompt is admitted (a fixed 30% page share refused 2,909 tokens:
    "needs 728 KV pages at once but the cache has 409") and its prompt takes its pages a
    chunk at a time, within what admission counted, without preemption. (Running it to the
    end takes minutes on CPU: the torch path dequantizes every sealed group per pass.)"""
    monkeypatch.setenv(CPU_KV_ENV, str(CPU_KV_BYTES))
    engine = EngineCore(EngineConfig.from_kwargs(default_model(), device="cpu", kv_residual_quantization={}))
    dense = EngineCore(EngineConfig.from_kwargs(default_model(), device="cpu"))
    prompt = [(i * 7919) % 4000 + 10 for i in range(4000)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    total = len(prompt) + params.max_tokens
    assert dense.kv.fits_ever(total)  # BF16 pages serve it in this budget
    engine.add_request("long", prompt, params)
    kv, key = engine.kv, engine.requests["long"].kv_key
    assert kv.pages_at_once(total) < kv.pages_for(total) and kv.pages_at_once(total) <= kv.num_pages
    while key not in kv.requests() or kv.frontier(key, kv.num_planes - 1) < 1024:  # (a quarter in)
        for out in engine.step():
            assert out.error is None, out.error
        assert engine.scheduler.num_preemptions == 0
        assert kv.held_pages(key) <= kv.pages_at_once(total)
        assert kv.coverage(key) < len(prompt), "a prompt takes its pages a chunk at a time"
    assert sum(kv.released(key, p) for p in range(kv.num_planes)) > 0
    engine.abort("long")
    engine.drain()
    assert kv.num_free_pages == kv.num_pages
