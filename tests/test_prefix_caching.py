"""Automatic prefix caching in the engine (`enable_prefix_caching`), CPU, tiny random
checkpoint, fp32.

Requests share a prefix of five full blocks. Each run is compared with the same requests
through an engine without the cache: the same tokens per request, logprobs within 1e-4
(cached rows were computed in other batches, so sums may round apart), greedy and seeded
sampled, in every execution mode (plain, adaptive exit, whose tokens exit at loops 1 to 4
on these prompts, block rounds and token pipelines at draft depths 1 and 2) and with sparse
decode attention, arriving one after another, in a burst while the first still runs, and
all at once. Hits must happen (counters, and fewer tokens
entering the loops); recompute and swap preemption under a small pool, aborts while blocks
are shared, eviction under memory pressure and a snapshot of a request holding shared
pages leave every page free or held only by the cache, with the cache's invariants intact.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from server.app import create_app
from specloop.cli import build_parser, engine_options
from specloop.engine.async_engine import AsyncEngine
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.engine.snapshot import RequestSnapshot
from specloop.errors import ConfigError
from specloop.sampling_params import SamplingParams
from specloop.scheduling.prefix_cache import block_hashes
from specloop.scheduling.request import Status
from tests.engine_runs import MODES, Outputs, assert_same, decode_references, step_into

BS = 4
_g = torch.Generator().manual_seed(7)
SHARED = torch.randint(3, 380, (22,), generator=_g).tolist()  # five full blocks and two tokens
# 25, 23, 28 and 21 tokens: each later one hits the five shared blocks; r3 then computes its last
# token alone (every loop in one group, its earlier positions done at every depth by the cache)
PROMPTS = [SHARED + [5, 6, 7], SHARED + [8], SHARED + [9, 10, 11, 12, 13, 14], SHARED[:21]]
HITS = 3 * 5 * BS  # tokens the three later requests find cached when the first ran before them
MAX_TOKENS = 8
SPARSE_DECODE = {"key_retention": 0.3}


def _engine(ckpt, cache: bool, pages: int = 1024, **kw) -> EngineCore:
    options = {"device": "cpu", "dtype": "float32", "block_size": BS, "num_kv_pages": pages, "max_num_seqs": 8,
               "max_num_batched_tokens": 48, **kw}
    return EngineCore(EngineConfig.from_kwargs(str(ckpt), enable_prefix_caching=cache, **options))


def _params(i: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    if i == 1:  # seeded sampling: keyed draws, the same whichever rows were cached
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True,
                              logprobs=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)


def _run(engine: EngineCore, prompts: list[list[int]], arrival: str, max_tokens: int = MAX_TOKENS,
         force: dict[int, str] | None = None, abort: dict[int, list[str]] | None = None) -> Outputs:
    """The prompts as r0, r1, ... arriving `sequential` (each alone to its end), in a `burst`
    (r0 first, the rest together once r0 emitted its first token: its prompt blocks are cached
    then, and it still decodes) or `together`; `force`: step -> request preempted then (if
    running); `abort`: step -> requests aborted then. Every page and token slot returns."""
    out: Outputs = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        arriving = _arriving(arrival, pending, engine.has_unfinished(), "r0" in out)
        for i, prompt in arriving:
            engine.add_request(f"r{i}", prompt, _params(i, max_tokens))
        pending = pending[len(arriving):]
        victim = engine.requests.get((force or {}).get(step, ""))
        if victim is not None and victim.status is Status.RUNNING:
            engine.scheduler.preempt(victim)
        for rid in (abort or {}).get(step, []):
            if engine.abort(rid) is not None:
                out.pop(rid, None)
        step_into(engine, out)
        step += 1
        assert step < 3000, "no progress"
    _clean(engine)
    return out


def _arriving(arrival: str, pending: list, busy: bool, r0_emitted: bool) -> list:
    """The pending prompts that arrive now."""
    if arrival == "together":
        return pending
    if arrival == "sequential":
        return [] if busy else pending[:1]
    if not busy and not r0_emitted:  # a burst: r0 alone first
        return pending[:1]
    return pending if r0_emitted else []


def _clean(engine: EngineCore) -> None:
    """Nothing runs: every page is free or held by the cache alone, and slots and cells are back."""
    kv, sched = engine.kv, engine.scheduler
    assert not kv.requests() and sched._returning == 0
    held = [p for p in range(kv.num_pages) if kv.allocator.refcount(p)]
    cache = sched.prefix_cache
    if cache is None:
        assert not held
    else:
        assert all(kv.allocator.refcount(p) == 1 for p in held)
        assert len(held) == cache.num_cached_blocks * kv.num_planes  # (distinct pages: `check`)
        cache.check()
    assert sched.token_slots.num_free == sched.token_slots.size
    assert sched.cells.num_free == sched.cells.size


@pytest.fixture(scope="module")
def uncached() -> dict:
    return {}


def _want(memo: dict, key: tuple, run) -> Outputs:
    """An uncached run's outputs, computed once per key."""
    if key not in memo:
        memo[key] = run()
    return memo[key]


@pytest.mark.parametrize("arrival,mode", [
    *[("burst", mode) for mode in MODES],
    *[("sequential", mode) for mode in ("plain", "exit", "block-d2", "pipeline-d1")],
    *[("together", mode) for mode in ("plain", "pipeline-d2")],  # no hits, only publish races
])
def test_outputs_equal_an_uncached_engine(tiny_ckpt, uncached, mode, arrival):
    want = _want(uncached, (mode, arrival),
                 lambda: _run(_engine(tiny_ckpt, False, **MODES[mode]), PROMPTS, arrival))
    engine = _engine(tiny_ckpt, True, **MODES[mode])
    got = _run(engine, PROMPTS, arrival)
    assert_same(got, want, 1e-4)
    stats = engine.stats()
    if arrival == "together":  # admitted in one plan: nobody finds a block, each offers its own
        assert stats.prefix_cache_hits == 0 and stats.prefix_cache_queries > 0
    else:
        assert stats.prefix_cache_hits == HITS
    assert engine.scheduler.prefix_cache.num_cached_blocks >= 5


TOKEN_SPARSE = {"window": 2 * BS, "retention": [1, 1, 0.5, 0.25]}
WINDOW_HITS = 3 * 4 * BS  # each later request: the two whole windows (16 tokens) before its last token's


@pytest.mark.parametrize("arrival,mode,keep_last", [
    *[("sequential", mode, False) for mode in ("plain", "exit", "block-d2", "pipeline-d1")],
    ("burst", "plain", False), ("burst", "block-d2", False), ("sequential", "plain", True),
])
def test_token_sparse_prefill_shares_whole_windows(tiny_ckpt, uncached, mode, arrival, keep_last):
    """Token-sparse prefill with windows of two blocks: only whole windows are looked up and
    offered (the shared prefix's third window is cut short by each prompt's own tokens, so a
    later request hits four of its five cached blocks and computes the fifth itself), and
    the outputs are the uncached engine's."""
    options = {**MODES[mode], "token_sparse_prefill": {**TOKEN_SPARSE, "keep_last": keep_last}}
    want = _want(uncached, ("token-sparse", mode, arrival, keep_last),
                 lambda: _run(_engine(tiny_ckpt, False, **options), PROMPTS, arrival))
    engine = _engine(tiny_ckpt, True, **options)
    assert_same(_run(engine, PROMPTS, arrival), want, 1e-4)
    stats = engine.stats()
    assert stats.prefix_cache_hits == WINDOW_HITS and stats.prefill_rows_skipped > 0
    _clean(engine)


def test_windowed_prompts_share_whole_windows_only():
    """`shared_prefix` floors to a window boundary; with keep_last the window ending the
    prompt is not shared (its selection keeps the prompt's last token)."""
    from specloop.flashloop.config import TokenSparsePrefill
    from specloop.flashloop.token_sparse_prefill.host import WindowedPrompts
    from specloop.scheduling.prompts import DensePrompts
    from specloop.scheduling.request import Request

    req = Request("r", list(range(3, 35)), SamplingParams(max_tokens=1), arrival=0)  # 32 prompt tokens
    plain = WindowedPrompts(TokenSparsePrefill(enabled=True, window=8, retention=(1, 1, 0.5, 0.25)))
    last = WindowedPrompts(TokenSparsePrefill(enabled=True, window=8, retention=(1, 1, 0.5, 0.25), keep_last=True))
    assert [plain.shared_prefix(req, n) for n in (0, 7, 8, 15, 28, 32)] == [0, 0, 8, 8, 24, 32]
    assert [last.shared_prefix(req, n) for n in (0, 8, 28, 32)] == [0, 8, 24, 24]
    assert DensePrompts().shared_prefix(req, 28) == 28


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["plain", "block-d2", "pipeline-d1"])
def test_on_cuda_with_graphs(tiny_ckpt, mode):
    """The GPU path: the Triton backend and CUDA graphs of the loop passes, fp32 (bf16's
    batch-dependent roundings would make a cached prefix differ in low bits from a fresh
    one, as in any prefix cache): the same tokens as uncached, and hits happen."""
    cuda = {"device": "cuda", "attention_backend": "triton", **MODES[mode]}
    want = _run(_engine(tiny_ckpt, False, **cuda), PROMPTS, "burst")
    engine = _engine(tiny_ckpt, True, **cuda)
    assert engine.resolved.cuda_graphs, "the loop passes must replay as graphs"
    assert_same(_run(engine, PROMPTS, "burst"), want, 1e-4)
    assert engine.stats().prefix_cache_hits == HITS


def test_hits_skip_exactly_their_rows(tiny_ckpt):
    """One after another, plain: the cached engine enters exactly the hit tokens fewer into
    the loops, and the counters say what was looked up and found."""
    plain = _engine(tiny_ckpt, False)
    cached = _engine(tiny_ckpt, True)
    assert_same(_run(cached, PROMPTS, "sequential"), _run(plain, PROMPTS, "sequential"), 1e-4)
    stats = cached.stats()
    queries = sum(len(p) for p in PROMPTS)  # every prompt position, as vLLM counts
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (queries, HITS)
    assert plain.stats().iteration_tokens_sum - stats.iteration_tokens_sum == HITS
    assert plain.stats().prefix_cache_queries == plain.stats().prefix_cache_hits == 0
    # the cache's idle blocks count as free pages, as in vLLM (the pool is not full of them)
    assert cached.scheduler.prefix_cache.num_cached_blocks > 0 and stats.kv_usage == 0.0


@pytest.mark.parametrize("mode", ["plain", "block-d2", "pipeline-d1"])
def test_sparse_decode_attention_with_the_cache(tiny_ckpt, uncached, mode):
    want = _want(uncached, ("sparse", mode),
                 lambda: _run(_engine(tiny_ckpt, False, sparse_decode_attention=SPARSE_DECODE, **MODES[mode]),
                              PROMPTS, "burst"))
    engine = _engine(tiny_ckpt, True, sparse_decode_attention=SPARSE_DECODE, **MODES[mode])
    assert_same(_run(engine, PROMPTS, "burst"), want, 1e-4)
    assert engine.stats().prefix_cache_hits == HITS
    assert int(decode_references(engine).fallbacks) == 0, "a correction found no reference state"


# 14 pages a plane (56 positions) against four requests of 35 to 40 positions that share 20:
# the burst outgrows the pool and the latest-arrived running request is preempted.
SMALL_POOL = 14 * 4
PREEMPT_TOKENS = 12


@pytest.mark.parametrize("policy", ["recompute", "swap"])
@pytest.mark.parametrize("mode", ["plain", "exit", "block-d2", "pipeline-d1"])
def test_preemption_with_shared_prefixes(tiny_ckpt, uncached, mode, policy):
    """A pool too small for the burst, and a preemption forced while r2 holds shared pages
    (it was admitted with the five cached blocks two steps before): requests are preempted
    (recompute: they look the prefix up again when they re-enter; swap: the restored request
    holds fresh pages), and emit what a large uncached pool gives."""
    want = _want(uncached, ("preempt", mode),
                 lambda: _run(_engine(tiny_ckpt, False, **MODES[mode]), PROMPTS, "burst", PREEMPT_TOKENS))
    engine = _engine(tiny_ckpt, True, pages=SMALL_POOL, preemption_mode=policy, **MODES[mode])
    got = _run(engine, PROMPTS, "burst", PREEMPT_TOKENS, force={9: "r2"})
    assert_same(got, want, 1e-4)
    stats = engine.stats()
    assert stats.num_preemptions >= 2  # the forced one and at least one for want of pages
    assert stats.prefix_cache_hits >= HITS + (5 * BS if policy == "recompute" else 0)  # a re-entry hits too


def test_aborts_while_blocks_are_shared(tiny_ckpt):
    """r3 and r2 are aborted while they hold the shared blocks (r3 mid-prompt, r2 decoding);
    r0 and r1 go on as without the cache, and a later request finds the blocks intact."""
    def run(cache: bool) -> tuple[Outputs, EngineCore]:
        engine = _engine(tiny_ckpt, cache)
        out = _run(engine, PROMPTS, "burst", abort={7: ["r3"], 11: ["r2"]})
        assert set(out) == {"r0", "r1"}
        later: Outputs = {}
        engine.add_request("r9", SHARED + [77, 78], _params(0))
        while engine.has_unfinished():
            step_into(engine, later)
        _clean(engine)
        return {**out, **later}, engine

    want, _ = run(False)
    got, engine = run(True)
    assert_same(got, want, 1e-4)
    assert engine.stats().prefix_cache_hits >= HITS + 5 * BS  # r9 found them


def test_eviction_under_memory_pressure(tiny_ckpt):
    """A pool of 16 pages a plane against prompts of 28 tokens (seven blocks each): each new
    prefix evicts the oldest idle blocks, nobody is preempted, the most recent prefix is
    still found and the first is not."""
    gen = torch.Generator().manual_seed(11)
    distinct = [torch.randint(3, 380, (28,), generator=gen).tolist() for _ in range(5)]
    prompts = distinct + [distinct[0], distinct[-1]]
    want = _run(_engine(tiny_ckpt, False), prompts, "sequential")
    engine = _engine(tiny_ckpt, True, pages=16 * 4)
    assert_same(_run(engine, prompts, "sequential"), want, 1e-4)
    stats = engine.stats()
    assert stats.num_preemptions == 0
    assert stats.prefix_cache_hits == 6 * BS  # the last prompt again: (28 - 1) // 4 blocks; the first: none


def test_snapshot_of_a_request_holding_shared_pages(tiny_ckpt, uncached):
    """r1 is snapshotted while the head of its tables is r0's cached blocks, aborted (its
    references drop, the cache keeps the blocks) and restored into fresh pages: it emits the
    rest of what an uncached run gives."""
    want = _want(uncached, ("plain", "burst"),
                 lambda: _run(_engine(tiny_ckpt, False), PROMPTS, "burst"))
    engine = _engine(tiny_ckpt, True)
    out: Outputs = {}
    engine.add_request("r0", PROMPTS[0], _params(0))
    while "r0" not in out:
        step_into(engine, out)
    engine.add_request("r1", PROMPTS[1], _params(1))
    for _ in range(4):
        step_into(engine, out)
    req, refcount = engine.requests["r1"], engine.kv.allocator.refcount
    head = [engine.kv.page_table(req.kv_key, p)[0] for p in range(engine.kv.num_planes)]
    shared = [refcount(page) for page in head]
    assert min(shared) >= 2  # r1's and the cache's (and r0's while it runs)
    snap = RequestSnapshot.from_bytes(engine.snapshot("r1").to_bytes())
    final = engine.abort("r1")
    emitted = out.get("r1", ([], []))[0] + final.token_ids
    assert emitted == snap.data["request"]["output_ids"]
    assert [refcount(page) for page in head] == [n - 1 for n in shared]
    engine.restore(snap)
    assert engine.kv.page_table(engine.requests["r1"].kv_key, 0)[0] != head[0]  # fresh pages, nothing shared
    rest: Outputs = {}
    while engine.has_unfinished():
        step_into(engine, rest)
    _clean(engine)
    assert emitted + rest["r1"][0] == want["r1"][0]
    assert out["r0"][0] + rest.get("r0", ([], []))[0] == want["r0"][0]


def test_the_cache_refuses_windows_across_blocks():
    with pytest.raises(ConfigError, match="multiple of block_size"):
        EngineConfig(model="m", enable_prefix_caching=True, block_size=16, token_sparse_prefill={"window": 40})
    EngineConfig(model="m", enable_prefix_caching=True, block_size=16, token_sparse_prefill={"window": 64})
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        EngineConfig(model="m", enable_prefix_caching="yes")
    config = EngineConfig(model="m", enable_prefix_caching=True, sparse_decode_attention={})
    assert config.summary()["enable_prefix_caching"] is True



def test_unset_means_on_where_it_costs_nothing():
    """Unset, caching is on; off with INT4 residuals (an INT4 prompt would keep its BF16
    pages at every plane until offered) and with a token-sparse window that no whole number
    of blocks makes (an unset option never turns into an error); set, it is what was set."""
    assert EngineConfig(model="m").enable_prefix_caching is None
    assert EngineConfig(model="m").prefix_caching is True
    assert EngineConfig(model="m", sparse_decode_attention={}, token_sparse_prefill={"window": 64}).prefix_caching
    assert not EngineConfig(model="m", kv_residual_quantization={}).prefix_caching
    assert EngineConfig(model="m", kv_residual_quantization={}, enable_prefix_caching=True).prefix_caching
    assert not EngineConfig(model="m", block_size=16, token_sparse_prefill={"window": 40}).prefix_caching
    assert not EngineConfig(model="m", enable_prefix_caching=False).prefix_caching


def test_cli_flag():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--enable-prefix-caching"])
    assert engine_options(args)["enable_prefix_caching"] is True
    args = build_parser().parse_args(["generate", "--prompt", "x", "--no-enable-prefix-caching"])
    assert engine_options(args)["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in engine_options(build_parser().parse_args(["generate", "--prompt", "x"]))


def test_identity_separates_configurations(tiny_ckpt):
    """Differently configured engines salt their block hashes differently; equal ones alike;
    an engine's cached blocks are named by its own salt."""
    def salt(**kw) -> str:
        return _engine(tiny_ckpt, True, pages=64, **kw).scheduler.prefix_salt

    base = salt(exit_threshold=0.5)
    assert salt(exit_threshold=0.5) == base
    others = [salt(exit_threshold=0.7), salt(exit_threshold=0.5, block_size=8),
              salt(exit_threshold=0.5, sparse_decode_attention=SPARSE_DECODE),
              salt(exit_threshold=0.5, dtype="float64")]
    assert len({base, *others}) == 5
    engine = _engine(tiny_ckpt, True)
    engine.add_request("r", PROMPTS[0], _params(0, 1))
    engine.drain()
    hashes = block_hashes(PROMPTS[0], BS, engine.scheduler.prefix_salt)
    assert all(h in engine.scheduler.prefix_cache for h in hashes)


async def test_metrics_export_the_counters(tiny_ckpt):
    engine = AsyncEngine.from_options(str(tiny_ckpt), device="cpu", block_size=BS, enable_prefix_caching=True)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine, "tiny")),
                                     base_url="http://test") as client:
            for prompt in PROMPTS[:2]:  # one after the other: the second finds the first's blocks
                reply = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2,
                                                                   "temperature": 0, "ignore_eos": True})
                assert reply.status_code == 200
            text = (await client.get("/metrics")).text
    finally:
        await engine.shutdown()
    stats = engine.stats()
    queries = len(PROMPTS[0]) + len(PROMPTS[1])  # every prompt position, as vLLM counts
    assert stats.prefix_cache_hits == 5 * BS and stats.prefix_cache_queries == queries

    def value(name: str) -> float:
        [line] = [ln for ln in text.splitlines() if ln.startswith(name + " ") or ln.startswith(name + "{")]
        return float(line.split()[-1])

    assert value("vllm:prefix_cache_queries_total") == value("specloop_prefix_cache_queries_total") == queries
    assert value("vllm:prefix_cache_hits_total") == value("specloop_prefix_cache_hits_total") == 20
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text


@pytest.mark.parametrize("steps,elsewhere", [(1, False), (3, False), (6, True)])
def test_a_restored_request_publishes_its_blocks(tiny_ckpt, steps, elsewhere):
    """r0 (seven full prompt blocks) is snapshotted after `steps` steps and restored, into
    the same engine after an abort or into a fresh one (`elsewhere`). After 1 or 3 steps its
    prompt has reached loop 1 or 3, and the plans after the restore publish its blocks;
    after 6 it has finished every loop, and the fresh engine's cache gets the blocks at the
    restore. Either way a later request with the same prompt finds them all."""
    engine = _engine(tiny_ckpt, True)
    out: Outputs = {}
    engine.add_request("r0", PROMPTS[2], _params(0))
    for _ in range(steps):
        step_into(engine, out)
    snap = engine.snapshot("r0")
    engine.abort("r0")
    if elsewhere:
        _clean(engine)
        engine = _engine(tiny_ckpt, True)
    engine.restore(snap)
    cache = engine.scheduler.prefix_cache
    assert cache.num_cached_blocks == (len(PROMPTS[2]) // BS if elsewhere else 0)
    while engine.has_unfinished():
        step_into(engine, out)
    assert cache.num_cached_blocks == len(PROMPTS[2]) // BS
    engine.add_request("r9", PROMPTS[2] + [77], _params(0))
    while engine.has_unfinished():
        step_into(engine, out)
    assert engine.stats().prefix_cache_hits == len(PROMPTS[2]) // BS * BS
    _clean(engine)
