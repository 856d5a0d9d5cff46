"""Prefix caching with INT4 cross-loop KV residuals (`enable_prefix_caching` with
`kv_residual_quantization`), CPU, tiny random checkpoint, fp64, the torch backend (in fp32
a prompt chunked or batched otherwise rounds its K/V apart in the last bits, which can move
an INT4 code across a step: the uncached engine itself differs by up to 1e-3 in logprobs
between batchings there, found in review).

The cache shares BF16 pages; a request that hits them gets rows for the cached positions
at every plane and encodes their full groups into its own records from the shared pages
(`PackedResiduals.adopt`), so it reads what it would have read had it computed the prefix.
Requests share a prefix of 150 tokens (two full groups of 64 and 22 more positions, with a
tail short enough that prompt queries read sealed groups) and are compared with an engine
without the cache: the same tokens, logprobs within 1e-4, greedy and seeded, in plain, block
and pipeline modes, with token-sparse prefill and adaptive exit (whose deep planes hold rows
for some tokens only), one after another and in a burst, and under recompute and swap
preemption in a small pool. At rest every page is free or held by the cache alone and every
record is free.
"""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.engine.snapshot import RequestSnapshot
from specloop.flashloop.kv_residual.planes import NEVER
from tests.engine_runs import MODES, Outputs, assert_same, residual_planes, step_into
from tests.test_prefix_caching import _params, _run as run_cached, _want

BS = 4
TAIL = 13  # the serial policy's least with these speculation modes; prompt chunks read sealed groups
_g = torch.Generator().manual_seed(17)
SHARED = torch.randint(3, 380, (150,), generator=_g).tolist()
PROMPTS = [SHARED + [5, 6, 7], SHARED + [8], SHARED + [9, 10, 11, 12, 13, 14], SHARED[:141]]
BLOCKS = 37  # full shared blocks: (151 - 1) // 4 for r1, 37 for r2 as well; r3 hits (141 - 1) // 4 = 35
HITS = (37 + 37 + 35) * BS
MAX_TOKENS = 8
SMALL_POOL = 45 * 4  # pages a plane x planes: r0 alone holds most of them (every plane keeps its prompt pages
# until they are cached)


def _engine(ckpt, cache: bool, pages: int | None = 1024, policy: str = "serial", **kw) -> EngineCore:
    options = {"device": "cpu", "dtype": "float64", "block_size": BS, "max_num_seqs": 8,
               "max_num_batched_tokens": 48, "attention_backend": "torch",
               "kv_residual_quantization": {"tail": TAIL, "policy": policy}, **kw}
    if pages is not None:
        options["num_kv_pages"] = pages
    return EngineCore(EngineConfig.from_kwargs(str(ckpt), enable_prefix_caching=cache, **options))


@pytest.fixture(scope="module")
def uncached() -> dict:
    """This module's uncached runs by key (INT4 engines: not test_prefix_caching's)."""
    return {}


def _at_rest(engine: EngineCore) -> None:
    """Every record is free (records are never shared)."""
    records = engine.kv.records
    assert records.num_free == records.num_records


@pytest.mark.parametrize("arrival,mode", [("sequential", "plain"), ("burst", "plain"), ("burst", "block-d2"),
                                          ("burst", "pipeline-d1"), ("sequential", "pipeline-d2")])
def test_outputs_equal_an_uncached_engine(tiny_ckpt, uncached, arrival, mode):
    want = _want(uncached, (mode, arrival), lambda: run_cached(_engine(tiny_ckpt, False, **MODES[mode]), PROMPTS,
                                                               arrival))
    engine = _engine(tiny_ckpt, True, **MODES[mode])
    assert_same(run_cached(engine, PROMPTS, arrival), want, 1e-4)
    assert engine.stats().prefix_cache_hits == HITS
    _at_rest(engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["plain", "block-d2"])
def test_on_cuda_with_graphs(tiny_ckpt, mode):
    """The GPU path: the Triton encoder and plan for the adopted groups, the packed reader
    and CUDA graphs, fp32 (the kernels' dtypes): the same tokens as uncached, logprobs within
    5e-3 (a chunking's fp32 roundings may move an INT4 code a step), and hits happen."""
    cuda = {"device": "cuda", "attention_backend": "triton", "dtype": "float32", **MODES[mode]}
    want = run_cached(_engine(tiny_ckpt, False, **cuda), PROMPTS, "burst")
    engine = _engine(tiny_ckpt, True, **cuda)
    assert engine.resolved.cuda_graphs, "the loop passes must replay as graphs"
    assert_same(run_cached(engine, PROMPTS, "burst"), want, 5e-3)
    assert engine.stats().prefix_cache_hits == HITS
    _at_rest(engine)


def test_adopted_groups_are_the_computed_ones(tiny_ckpt):
    """r1 hits r0's prefix: after its first step its planes hold rows at every cached
    position and its full groups sealed where an uncached request's are, with the same codes
    (its own records, encoded from the shared pages)."""
    def first_step(cache: bool) -> tuple[EngineCore, dict]:
        engine = _engine(tiny_ckpt, cache)
        out: Outputs = {}
        engine.add_request("r0", PROMPTS[0], _params(0))
        while engine.has_unfinished():
            step_into(engine, out)
        engine.add_request("r1", PROMPTS[1], _params(1))
        if cache:
            step_into(engine, out)  # the adopting plan
        else:
            while _frontier(engine, "r1") < BLOCKS * BS:
                step_into(engine, out)
        req = engine.requests["r1"]
        planes = residual_planes(engine)
        tables = engine.kv.records.tables(req.kv_key)
        state = {"rows": planes.rows[req.cell].tolist(), "encoded": planes.encoded[req.cell].tolist(),
                 "maps": planes.row_maps[req.cell, :, :BLOCKS * BS].clone(),
                 "seals": [[int(planes.seal[t[g]]) for g in range(2)] for t in tables],
                 "codes": [planes.k_codes[:, [t[g] for g in range(2)]].clone() for t in tables],
                 "v": [planes.v_codes[:, [t[g] * 64 + i for g in range(2) for i in range(64)]].clone()
                       for t in tables]}
        return engine, state

    cached, got = first_step(True)
    assert cached.stats().prefix_cache_hits == BLOCKS * BS
    _, want = first_step(False)
    assert all(r >= BLOCKS * BS for r in got["rows"]) and all(e >= 2 for e in got["encoded"])
    assert torch.equal(got["maps"], want["maps"])
    assert got["seals"] == want["seals"] and all(s < NEVER for plane in got["seals"] for s in plane)
    for a, b in zip(got["codes"] + got["v"], want["codes"] + want["v"]):
        assert torch.equal(a, b)


def _frontier(engine: EngineCore, rid: str) -> int:
    """Positions the request has done at the last depth (0 before it is admitted)."""
    req = engine.requests[rid]
    if req.kv_key not in engine.kv.requests():
        return 0
    return engine.kv.frontier(req.kv_key, engine.kv.num_planes - 1)


@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_preemption_with_shared_prefixes(tiny_ckpt, uncached, policy):
    """A small pool, and a preemption forced while r2 holds shared pages and reads its
    adopted groups (recompute: it adopts them again; swap: restored into fresh pages)."""
    want = _want(uncached, ("plain", "burst"), lambda: run_cached(_engine(tiny_ckpt, False), PROMPTS, "burst"))
    engine = _engine(tiny_ckpt, True, pages=SMALL_POOL, preemption_mode=policy)
    got = run_cached(engine, PROMPTS, "burst", force={20: "r2"})
    assert_same(got, want, 1e-4)
    assert engine.stats().num_preemptions >= 1
    # hits happen (how many depends on what the small pool evicted meanwhile)
    assert engine.stats().prefix_cache_hits >= 2 * BLOCKS * BS
    _at_rest(engine)


def test_snapshot_before_the_adopting_plan(tiny_ckpt, uncached):
    """r1 is admitted with the cached prefix and snapshotted before any plan brought its
    rows (the snapshot applies the adoption first), aborted and restored: it emits what an
    uncached run gives."""
    want = _want(uncached, ("plain", "sequential"),
                 lambda: run_cached(_engine(tiny_ckpt, False), PROMPTS, "sequential"))
    engine = _engine(tiny_ckpt, True)
    out: Outputs = {}
    engine.add_request("r0", PROMPTS[0], _params(0))
    while engine.has_unfinished():
        step_into(engine, out)
    engine.add_request("r1", PROMPTS[1], _params(1))
    engine.scheduler._admit()  # admitted: it holds the cached pages, no plan has run
    assert engine.requests["r1"].status.name == "RUNNING"
    snap = RequestSnapshot.from_bytes(engine.snapshot("r1").to_bytes())
    engine.abort("r1")
    engine.restore(snap)
    while engine.has_unfinished():
        step_into(engine, out)
    assert out["r0"][0] == want["r0"][0] and out["r1"][0] == want["r1"][0]
    _at_rest(engine)


TOKEN_SPARSE = {"window": 8 * BS, "retention": [1, 1, 0.5, 0.25]}
WINDOW_HITS = (4 + 4 + 4) * 8 * BS  # the whole windows before each later request's last token: 4 of 32 tokens


@pytest.mark.parametrize("arrival,mode,keep_last", [("sequential", "plain", False), ("burst", "plain", True),
                                                    ("burst", "block-d2", False), ("burst", "pipeline-d1", False)])
def test_token_sparse_prefill(tiny_ckpt, uncached, arrival, mode, keep_last):
    """Sparse planes hold rows for the kept tokens only, and their groups of 64 rows span
    windows: a hit adopts the rows its publisher's planes held (noted by the plan that
    finished each block), so its groups are the uncached request's."""
    sparse = {"token_sparse_prefill": {**TOKEN_SPARSE, "keep_last": keep_last}, **MODES[mode]}
    want = _want(uncached, ("sparse", mode, arrival, keep_last),
                 lambda: run_cached(_engine(tiny_ckpt, False, **sparse), PROMPTS, arrival))
    engine = _engine(tiny_ckpt, True, **sparse)
    assert_same(run_cached(engine, PROMPTS, arrival), want, 1e-4)
    assert engine.stats().prefix_cache_hits == WINDOW_HITS  # (every prompt ends in a partial window)
    _at_rest(engine)


@pytest.mark.parametrize("arrival", ["sequential", "burst"])
def test_adaptive_exit(tiny_ckpt, uncached, arrival):
    """Tokens that exit early have no rows at deeper planes: a hit adopts only the rows its
    publisher's planes held."""
    want = _want(uncached, ("exit", arrival),
                 lambda: run_cached(_engine(tiny_ckpt, False, **MODES["exit"]), PROMPTS, arrival))
    engine = _engine(tiny_ckpt, True, **MODES["exit"])
    assert_same(run_cached(engine, PROMPTS, arrival), want, 1e-4)
    assert engine.stats().prefix_cache_hits == HITS
    rows = residual_planes(engine).page_rows
    assert not bool(rows.all()), "some tokens exited before the last loop (else this tests nothing)"
    _at_rest(engine)


@pytest.mark.parametrize("sizing", [{"pages": 180}, {"pages": 300},
                                    {"pages": None, "block_size": 16, "kv_cache_bytes": 4 << 20}])
def test_a_prompt_longer_than_the_pool_at_every_plane(tiny_ckpt, sizing):
    """INT4 admits a prompt whose pages at every plane outgrow the pool (its planes give
    their leading pages back as groups seal). The cache keeps those pages while the
    request's later blocks are in its tables: eviction must take the idle ones below, or the
    request preempted itself and then, its own cached blocks pinned as hits, never fit again
    ("scheduler stalled", found in review)."""
    length = 1500 if sizing["pages"] is None else 400
    prompt = torch.randint(3, 380, (length,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [prompt + [5, 6, 7], prompt + [8]]
    want = run_cached(_engine(tiny_ckpt, False, **sizing), prompts, "sequential")
    engine = _engine(tiny_ckpt, True, **sizing)
    assert_same(run_cached(engine, prompts, "sequential"), want, 1e-4)
    assert engine.stats().num_preemptions == 0
    _at_rest(engine)
