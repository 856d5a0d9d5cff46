"""Sparse decode attention in the engine against the FlashLoop reference (fp32, CPU).

The reference (`flashloop_reference`, `SparseDecode`) recomputes every loop over the whole
sequence, so one forward over prompt + emitted tokens gives the logits every emitted token
was sampled from: the engine's tokens must equal the reference's greedy tokens, and every
logprob it reports must equal the reference's for that token within 1e-5, in every
execution mode (plain, adaptive exit, block rounds at draft depths 1 and 2, token
pipelines), through the torch backend and (interpreter) the Triton kernels, with token-
sparse prefill on as well, and across recompute preemption. Key retention 0.3 on prompts
of 5 to 41 tokens keeps 2 to 15 keys, so the outputs differ from dense decoding (checked).
"""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.engine.snapshot import SnapshotError
from specloop.errors import ConfigError
from specloop.flashloop.config import SparseDecodeAttention
from specloop.kernels.sparse_decode_common import key_budget
from specloop.model.flashloop_reference import FlashLoopFeatures, KVResidual, SparseDecode, SparsePrefill
from specloop.plan import Plan, RowGroup
from specloop.runtime.forward_batch import ForwardBatchBuilder
from specloop.runtime.kv_format import paged_reader
from specloop.flashloop.sparse_decode.references import DecodeReferences
from specloop.flashloop.sparse_decode.batch import SparseDecodeBatch, SparseRows, sparse_rows
from specloop.sampling_params import SamplingParams
from specloop.scheduling.token_slots import TokenSlotPool
from tests.engine_runs import MODES, decode_references, reference_logprobs, run_all, step_into

RETENTION = 0.3
MAX_TOKENS = 8
_g = torch.Generator().manual_seed(3)
PROMPTS = [torch.randint(3, 200, (n,), generator=_g).tolist() for n in (33, 5, 17, 41)]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
# The interpreter runs the Triton kernels one program at a time (about 1.5 s a source pass):
# its tests decode 6 tokens, still two rounds of block-d2 past the prompt's token.
INTERPRETED = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
SPARSE_PREFILL = {"window": 8, "retention": [1.0, 1.0, 0.5, 0.25]}


def _engine(ckpt, **kw) -> EngineCore:
    kw.setdefault("sparse_decode_attention", {"key_retention": RETENTION})
    return EngineCore(EngineConfig.from_kwargs(
        str(ckpt), device=kw.pop("device", "cpu"), dtype=kw.pop("dtype", "float32"),
        num_kv_pages=kw.pop("num_kv_pages", 512), block_size=4, **kw))


def _run(engine: EngineCore, prompts, params=GREEDY) -> dict[str, tuple[list[int], list[float]]]:
    out = run_all(engine, prompts, params)
    assert int(decode_references(engine).fallbacks) == 0, "a correction found no reference state"
    return out


def _features(sparse_decode: bool = True, sparse_prefill: bool = False, kv_tail: int | None = None
              ) -> FlashLoopFeatures:
    return FlashLoopFeatures(
        token_sparse_prefill=SparsePrefill(**SPARSE_PREFILL) if sparse_prefill else None,
        sparse_decode=SparseDecode(key_retention=RETENTION) if sparse_decode else None,
        kv_residual=KVResidual(bits=4, group_size=64, tail=kv_tail) if kv_tail is not None else None)


def _check(ckpt, got, prompts=PROMPTS, greedy: bool = True, sparse_prefill: bool = False,
           exit_threshold: float | None = None, kv_tail: int | None = None, max_tokens: int = MAX_TOKENS,
           dtype: torch.dtype = torch.float32, tol: float = 1e-5) -> None:
    """Every emitted token's logprob equals the reference's; greedy tokens are its argmax;
    somewhere the outputs differ from dense decoding's (with the same other features)."""
    differs = False
    for i, prompt in enumerate(prompts):
        tokens, logprobs = got[f"r{i}"]
        assert len(tokens) == max_tokens
        want = reference_logprobs(ckpt, prompt, tokens, _features(True, sparse_prefill, kv_tail), exit_threshold,
                                  dtype)
        picked = want[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), picked, atol=tol, rtol=tol)
        if greedy:
            assert tokens == want.argmax(-1).tolist(), f"prompt {i}"
        dense = reference_logprobs(ckpt, prompt, tokens, _features(False, sparse_prefill, kv_tail), exit_threshold,
                                   dtype)
        differs |= bool((dense - want).abs().max() > 1e-3)
    assert differs, "sparse decode attention changed nothing: the test cannot tell it from dense"


@pytest.mark.parametrize("mode", list(MODES))
def test_matches_the_reference_in_every_mode(any_ckpt, mode):
    """Plain decoding, adaptive exit, block rounds (draft depth 1: the verifier's loop 2 is
    the source; 2: the draft's), token pipelines: the reference's tokens and logprobs."""
    options = MODES[mode]
    got = _run(_engine(any_ckpt, **options), PROMPTS)
    _check(any_ckpt, got, exit_threshold=options.get("exit_threshold"))


@pytest.mark.parametrize("mode", ["plain", "block-d2", "pipeline-d1"])
def test_seeded_sampling_reads_the_reference_distribution(tiny_ckpt, mode):
    """Sampled tokens (seeded, temperature 0.8): each reported logprob is the reference's
    for that token (the distribution sampled from is sparse decoding's, scaled)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, ignore_eos=True, logprobs=True)
    got = _run(_engine(tiny_ckpt, **MODES[mode]), PROMPTS[:2], params)
    _check(tiny_ckpt, got, PROMPTS[:2], greedy=False)


@pytest.mark.parametrize("mode", ["plain", "block-d1", "pipeline-d2"])
def test_with_token_sparse_prefill(tiny_ckpt, mode):
    """Both lazy updates: sparse prompt loops, then sparse decode queries."""
    got = _run(_engine(tiny_ckpt, token_sparse_prefill=SPARSE_PREFILL, **MODES[mode]), PROMPTS)
    _check(tiny_ckpt, got, sparse_prefill=True)


KV_PROMPTS = [torch.randint(3, 200, (n,), generator=_g).tolist() for n in (100, 75, 130)]
KV_CASES = {  # mode, INT4 residual tail (speculation needs a tail past the rows in flight)
    "plain": ("plain", 5), "exit": ("exit", 5), "block-d1": ("block-d1", 16), "block-d2": ("block-d2", 16),
    "pipeline-d1": ("pipeline-d1", 16),
}


@pytest.mark.parametrize("case", list(KV_CASES))
def test_with_int4_residuals(tiny_ckpt, case):
    """All three lazy updates: prompts past the first group's seal (63 + tail), so generated
    queries read reconstructed K/V at loop 2 (selection) and at loops 3-4 (the kept keys),
    exact tails elsewhere; token-sparse prefill on too in the plain case. In fp64 against an
    fp64 reference: in fp32 batched matmuls round apart from the reference's in the last bits,
    which on some CPUs (AVX-512 ones) moves an INT4 code a step (up to 6e-3 in a logprob)."""
    mode, tail = KV_CASES[case]
    options = MODES[mode]
    prefill = {"token_sparse_prefill": SPARSE_PREFILL} if case == "plain" else {}
    engine = _engine(tiny_ckpt, kv_residual_quantization={"tail": tail}, dtype="float64", **prefill, **options)
    got = _run(engine, KV_PROMPTS)
    _check(tiny_ckpt, got, KV_PROMPTS, sparse_prefill=bool(prefill), exit_threshold=options.get("exit_threshold"),
           kv_tail=tail, dtype=torch.float64, tol=1e-9)


def test_with_int4_residuals_execution_policy(tiny_ckpt):
    """The execution policy (groups seal at the passes' safe points): one request alone, its
    prompt in passes of 64 positions, against the reference with the same safe points."""
    engine = _engine(tiny_ckpt, kv_residual_quantization={"tail": 5, "policy": "execution"},
                     max_num_batched_tokens=64)
    tokens, logprobs = _run(engine, KV_PROMPTS[:1])["r0"]
    prompt = KV_PROMPTS[0]
    feats = FlashLoopFeatures(sparse_decode=SparseDecode(key_retention=RETENTION),
                              kv_residual=KVResidual(bits=4, group_size=64, tail=5, policy="execution", chunk=64))
    want = reference_logprobs(tiny_ckpt, prompt, tokens, feats)
    assert tokens == want.argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64),
                               want[torch.arange(len(tokens)), torch.tensor(tokens)], atol=1e-5, rtol=1e-5)
    serial = reference_logprobs(tiny_ckpt, prompt, tokens, _features(True, False, 5))
    assert not torch.allclose(want, serial, atol=1e-6), "the policies read differently"


@pytest.mark.parametrize("policy, mode", [("recompute", "plain"), ("recompute", "pipeline-d1"),
                                          ("swap", "plain"), ("swap", "pipeline-d1"), ("swap", "block-d2")])
def test_preemption_resumes_exactly(tiny_ckpt, policy, mode):
    """Recompute: a preempted request re-enters its generated tokens as a replay, and they
    stay generated-token queries (sources and corrections). Swap: the snapshot carries the
    live generated tokens' reference state (a pipeline's tokens between loops 2 and 3 need
    it). Either way the request resumes on the reference's tokens, with no fallback."""
    engine = _engine(tiny_ckpt, max_num_batched_tokens=6, preemption_mode=policy, **MODES[mode])
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    out: dict[str, tuple[list[int], list[float]]] = {}
    step = preempted = 0
    while engine.has_unfinished():
        running = [r for r in engine.scheduler.running if r.output_ids and r.num_preemptions < 2]
        if running and step % 5 == 2:
            engine.scheduler.preempt(running[0])
            preempted += 1
        step_into(engine, out)
        step += 1
        assert step < 2000
    assert preempted >= 3
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size
    assert int(decode_references(engine).fallbacks) == 0
    _check(tiny_ckpt, out)


@pytest.mark.parametrize("mode", ["pipeline-d1", "block-d2"])
def test_snapshot_restores_live_reference_state(tiny_ckpt, mode):
    """A snapshot taken while generated tokens sit between loops (their reference state
    written, not yet read) restores into another engine, which finishes on the reference's
    tokens without a fallback; a restoring engine with another key retention refuses it."""
    engine = _engine(tiny_ckpt, **MODES[mode])
    engine.add_request("r0", PROMPTS[0], GREEDY)
    for _ in range(40):
        engine.step()
        snap = engine.snapshot("r0")  # the request runs on
        if snap.data["references"]["present"].any() and snap.data["request"]["output_ids"]:
            break
    assert snap.data["references"]["present"].any(), "no live generated token past loop 2 to carry"
    emitted = list(snap.data["request"]["output_ids"])
    engine.abort("r0")
    with pytest.raises(SnapshotError, match="sparse_decode_attention"):
        _engine(tiny_ckpt, sparse_decode_attention={"key_retention": 0.5}, **MODES[mode]).restore(snap)
    other = _engine(tiny_ckpt, **MODES[mode])
    other.restore(type(snap).from_bytes(snap.to_bytes()))
    tokens = emitted[:]
    for o in other.drain():
        tokens.extend(o.token_ids)
    assert int(decode_references(other).fallbacks) == 0
    want = reference_logprobs(tiny_ckpt, PROMPTS[0], tokens, _features())
    assert tokens == want.argmax(-1).tolist()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter needs TRITON_INTERPRET before triton "
                    "loads; the GPU suite runs the compiled kernels")
@pytest.mark.parametrize("mode", ["plain", "block-d2", "plain-int4"])
def test_triton_kernels_under_the_interpreter(tiny_ckpt, mode, monkeypatch):
    """The Triton backend runs the source and correction kernels (device top-b selection),
    and with INT4 residuals those kernels' own reads of the packed planes (`PackedRows`)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tail = 5 if mode.endswith("int4") else None
    extra = {"kv_residual_quantization": {"tail": tail}} if tail else {}
    prompts = KV_PROMPTS[1:2] if tail else PROMPTS[:2]
    got = _run(_engine(tiny_ckpt, attention_backend="triton", **extra, **MODES[mode.removesuffix("-int4")]), prompts,
               INTERPRETED)
    _check(tiny_ckpt, got, prompts, kv_tail=tail, max_tokens=INTERPRETED.max_tokens)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter needs TRITON_INTERPRET before triton "
                    "loads; the GPU suite runs the compiled kernels")
def test_triton_fallback_runs_missing_rows_dense(tiny_ckpt, monkeypatch):
    """With every reference state dropped right after its source wrote it, each correction
    row of the Triton backend (left out of the dense launch) runs its tile dense through
    the fallback: the tokens and logprobs are dense decoding's, and every one is counted."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    write = DecodeReferences._source

    def forget(self, layer, *args, **kwargs):
        write(self, layer, *args, **kwargs)
        self.present[:] = False  # (a source marks every layer present at its last one)
    monkeypatch.setattr(DecodeReferences, "_source", forget)
    engine = _engine(tiny_ckpt, attention_backend="triton")
    got = run_all(engine, PROMPTS[:2], INTERPRETED)
    assert int(decode_references(engine).fallbacks) > 0
    for i, prompt in enumerate(PROMPTS[:2]):
        tokens, logprobs = got[f"r{i}"]
        want = reference_logprobs(tiny_ckpt, prompt, tokens, _features(sparse_decode=False))
        assert tokens == want.argmax(-1).tolist(), f"prompt {i}"
        picked = want[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), picked, atol=1e-5, rtol=1e-5)


def test_stats_report_the_group_and_its_state(tiny_ckpt, monkeypatch):
    """The reference state's bytes (as `DecodeReferences.nbytes` budgets them), the group and
    the fallback count reach `stats()`; `/metrics` exports them (test_server)."""
    engine = _engine(tiny_ckpt)
    _run(engine, PROMPTS[:1])
    stats, refs = engine.stats(), decode_references(engine)
    cfg = engine.model.config
    assert stats.sparse_decode_attention == {"enabled": True, "key_retention": RETENTION}
    assert stats.sparse_decode_fallbacks == 0
    assert stats.sparse_decode_reference_bytes == refs.nbytes_held == DecodeReferences.nbytes(
        refs.num_slots, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim, engine.max_model_len,
        RETENTION, torch.float32) > 0  # the torch backend: no scratch
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (constructed only, for the scratch's bytes)
    triton = _engine(tiny_ckpt, attention_backend="triton")
    tr = decode_references(triton)
    assert tr.nbytes_held == triton.stats().sparse_decode_reference_bytes == DecodeReferences.nbytes(
        tr.num_slots, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim, triton.max_model_len,
        RETENTION, torch.float32, triton.config.max_num_batched_tokens) > refs.nbytes_held
    assert refs.num_slots == engine.scheduler.token_slots.decode_size == engine.config.max_num_seqs * 3
    assert _engine(tiny_ckpt, sparse_decode_attention=None).stats().sparse_decode_reference_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("mode", ["plain", "exit", "block-d1", "block-d2", "pipeline-d1"])
def test_cuda_kernels_in_the_engine(any_ckpt, mode, graphs):
    """On the GPU (fp32, the Triton backend), eager and under CUDA graphs: the compiled
    source and correction kernels give the reference's tokens and logprobs (within 1e-4:
    GPU against CPU fp32); with graphs, passes with sparse rows replay their own graphs."""
    options = MODES[mode]
    engine = _engine(any_ckpt, device="cuda", enforce_eager=not graphs, **options)
    assert engine.backend.name == "triton"
    got = _run(engine, PROMPTS)
    runner = engine.executor.runner
    assert (runner.graphs is not None and runner.graphs.sparse_replays > 0) == graphs
    if graphs and mode == "plain":  # split: loop 2 replays the sources' graph, loops 3-4 the corrections'
        from specloop.flashloop.sparse_decode.batch import SPLIT_GRAPHS
        replays = runner.graphs.variant_replays
        if SPLIT_GRAPHS:
            assert replays["sources"] and replays["corrections"]
        else:
            assert replays["both"] == runner.graphs.sparse_replays
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs = got[f"r{i}"]
        want = reference_logprobs(any_ckpt, prompt, tokens, _features(), options.get("exit_threshold"))
        assert tokens == want.argmax(-1).tolist(), f"prompt {i}"
        picked = want[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), picked, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("mode", ["plain", "block-d2"])
def test_cuda_split_select_in_the_engine(any_ckpt, mode, graphs, monkeypatch):
    """The split select (several programs per row and head, `select_splits`), which the
    H200 picks at small batches and long contexts, gives the reference's tokens in the
    engine, eager and captured in graphs; forced to 3 splits here because these short
    contexts would keep one program."""
    import specloop.kernels.sparse_decode_source as kernels  # `decode_select` reads `select_splits` here

    chosen = []
    monkeypatch.setattr(kernels, "select_splits", lambda *args: chosen.append(3) or 3)
    options = MODES[mode]
    engine = _engine(any_ckpt, device="cuda", enforce_eager=not graphs, **options)
    got = _run(engine, PROMPTS)
    assert chosen, "the engine never ran the fused select"
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs = got[f"r{i}"]
        want = reference_logprobs(any_ckpt, prompt, tokens, _features(), options.get("exit_threshold"))
        assert tokens == want.argmax(-1).tolist(), f"prompt {i}"
        picked = want[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), picked, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("value, message", [
    ({"key_retention": 0.0}, "key_retention must lie in"),
    ({"key_retention": 1.5}, "key_retention must lie in"),
    ({"key_retention": True}, "key_retention must lie in"),
    ({"enabled": "yes"}, "enabled must be true or false"),
    ({"retention": 0.1}, "has no option 'retention'"),
    ("{not json", "must be a JSON object"),
])
def test_configuration_errors_are_one_line(value, message):
    with pytest.raises(ConfigError, match=message):
        SparseDecodeAttention.parse(value)


def test_defaults_and_summary():
    assert not SparseDecodeAttention().enabled
    group = SparseDecodeAttention.parse("{}")
    assert group.enabled and group.key_retention == 0.20  # a fifth, not the RFC's tenth (config's docstring)
    assert key_budget(30, group.key_retention) == 6
    assert key_budget(30, 0.1) == 3  # exact: not the float product's 4
    summary = EngineConfig(model="m", sparse_decode_attention={"key_retention": 0.25}).summary()
    assert summary["sparse_decode_attention"] == {"enabled": True, "key_retention": 0.25}


def test_a_tight_decode_pool_only_slows_entry(tiny_ckpt):
    """One request cell: the decode sub-pool holds 3 slots in plain decoding, fewer than a
    recompute's replay of 5 generated tokens needs at once; the replay enters as slots free
    up, and the request resumes on the reference's tokens with nothing leaked (a pipeline's
    12 slots, likewise)."""
    for mode in ("plain", "pipeline-d1"):
        engine = _engine(tiny_ckpt, max_num_seqs=1, **MODES[mode])
        engine.add_request("r0", PROMPTS[0], GREEDY)
        out: list[int] = []
        logprobs: list[float] = []
        for step in range(400):
            if len(out) == 5 and not engine.requests["r0"].num_preemptions:
                engine.scheduler.preempt(engine.requests["r0"])
            for o in engine.step():
                out.extend(o.token_ids)
                logprobs.extend(o.logprobs)
            if not engine.has_unfinished():
                break
        assert engine.scheduler.num_preemptions == 1 and not engine.has_unfinished()
        if mode == "plain":  # the replay's 5 generated tokens wait for slots (the pipeline's 12 hold them)
            assert engine.scheduler.token_slots.decode_size < 5
        assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size
        _check(tiny_ckpt, {"r0": (out, logprobs)}, PROMPTS[:1])


def test_window_slots_count_the_general_pool_only(tiny_ckpt):
    """Prompt windows take general slots: a window larger than the general pool is refused
    at start-up with sparse decode on as without it (the decode sub-pool does not count)."""
    for decode in (None, {"key_retention": RETENTION}):
        with pytest.raises(ConfigError, match="exceeds the engine's 56 token slots"):
            _engine(tiny_ckpt, max_num_batched_tokens=8, token_sparse_prefill={"window": 64},
                    sparse_decode_attention=decode)


def test_generated_tokens_take_the_decode_sub_pool():
    """Prompt tokens never take a decode slot, generated ones only decode slots; released
    slots go back to their own pool; all or nothing per pool."""
    pool = TokenSlotPool(10, decode_size=3)
    assert pool.free_for(True) == 3 and pool.free_for(False) == 7 and pool.num_free == 10
    prompt = pool.take(7)
    assert min(prompt) >= 3
    assert pool.take(1) is None
    generated = pool.take(3, decode=True)
    assert sorted(generated) == [0, 1, 2] and pool.take(1, decode=True) is None
    pool.finish(generated[:2])
    pool.release(generated[:2])
    assert pool.free_for(True) == 2 and pool.free_for(False) == 0
    assert pool.take(3, decode=True) is None and pool.free_for(True) == 2
    plain = TokenSlotPool(4)  # no sub-pool: one pool for every token
    assert plain.take(2, decode=True) == [0, 1] and plain.free_for(False) == 2


def _group(depth: int, start: int, end: int, decode_from: int, loops: int = 1) -> RowGroup:
    return RowGroup("r", 0, 0, 0, depth, start, end, None, list(range(start, end)), [], loops=loops,
                    decode_from=decode_from)


def test_correction_rows_leave_the_dense_tiles():
    """With query tiles a pass's correction rows (each group's generated tail) are cut out of
    its tiles (the correction step computes them), and the block's roles column, its last,
    marks sources 1, corrections 2 and every other row and the padding 0: what a CUDA
    graph's masks read."""
    builder = ForwardBatchBuilder(max_rows=16, max_seqs=2, num_loops=4, max_pages_per_seq=4, page_size=4,
                                  device=torch.device("cpu"), tile_rows=(2, 8), buckets=(8, 16),
                                  parts=[SparseDecodeBatch(16, 4)])
    decode = RowGroup("a", 0, 0, 0, 0, 12, 13, None, [0], [0, 1, 2, 3], [[4, 5, 6, 7]] * 3, loops=4,
                      decode_from=10)
    chunk = RowGroup("b", 0, 1, 1, 1, 8, 12, None, [1, 2, 3, 4], [8, 9, 10], [[11, 12, 13]], loops=2,
                     decode_from=10)  # prompt rows 8, 9 then generated 10, 11; depths 1 and 2
    batch = builder.build(Plan(0, [decode, chunk], adaptive_exit=False))
    tiles = lambda t: [tuple(x) for x in t.tolist() if x[1] > 0]  # noqa: E731
    roles = lambda lp: lp.block[-lp.bucket:].tolist()  # noqa: E731
    first, second = batch.passes[0], batch.passes[1]
    # pass 0: row 0 depth 0 (dense), rows 1..4 depth 1: prompt 1, 2 dense, 3, 4 sources
    assert first.notes[SparseRows].source.tolist() == [3, 4] and first.notes[SparseRows].correction.numel() == 0
    assert sum(n for _, n, _ in tiles(first.tiles)) == 5
    assert roles(first) == [0, 0, 0, 1, 1, 0, 0, 0]
    # pass 1: row 0 depth 1 (a source), rows 1..4 depth 2: 1, 2 dense, 3, 4 corrections
    assert second.notes[SparseRows].source.tolist() == [0] and second.notes[SparseRows].correction.tolist() == [3, 4]
    dense = tiles(second.tiles)
    assert [(f, n) for f, n, _ in dense] == [(0, 1), (1, 2)]  # the corrections 3, 4 are left out
    assert roles(second) == [1, 0, 0, 2, 2, 0, 0, 0]


def test_sparse_rows_of_each_pass():
    """Sources: generated positions at depth 1; corrections: deeper; prompt rows neither."""
    ordered = [_group(0, 12, 13, 10, loops=4),  # a decode token through every loop: rows 0
               _group(1, 6, 12, 10),  # a replay chunk crossing the prompt's end at depth 1: rows 1..6
               _group(2, 3, 9, 10)]  # prompt rows only: rows 7..12
    firsts = [0, 1, 7]
    assert sparse_rows(ordered, firsts, 0) == ([5, 6], [])  # positions 10, 11 of the chunk
    assert sparse_rows(ordered, firsts, 1) == ([0], [])
    assert sparse_rows(ordered, firsts, 2) == ([], [0])
    assert sparse_rows(ordered, firsts, 3) == ([], [0])


def _roles_setup(every: bool = False):
    torch.manual_seed(0)
    refs = DecodeReferences(4, 2, 2, 8, 16, 0.5, torch.float32, torch.device("cpu"))
    k, v = torch.randn(64, 1, 8), torch.randn(64, 1, 8)
    offsets = torch.tensor([0, 4, 8, 12, 0])
    read = paged_reader(k, v, torch.arange(16), offsets, 4, every)
    return refs, read


def test_a_graphs_roles_give_what_row_lists_give():
    """A CUDA graph's form of the rows (every row listed, the roles saying which play which
    part, a padding row naming a slot past the decode ones; `every`: views, not gathers,
    and layer 1 reusing layer 0's masks) writes the same state and outputs as the eager row
    lists, and rows playing no part leave their slots alone."""
    positions = torch.tensor([9, 12, 10, 11, 0])
    slots = torch.tensor([0, 1, 2, 3, 99])
    q, dense = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    q_before, dense_before = torch.randn(5, 2, 8), torch.randn(5, 2, 8)  # a source pass over them would show
    eager, read = _roles_setup()
    graph, read_every = _roles_setup(every=True)
    for refs in (eager, graph):  # rows 2 and 3 ran loop 2 earlier, with other queries
        for layer in range(2):
            refs.attend(layer, SparseRows(torch.tensor([2, 3]), torch.zeros(0, dtype=torch.long)), q_before,
                        dense_before.clone(), positions, slots, read, False, 16)
    every = torch.arange(5)
    roles = torch.tensor([1, 1, 2, 2, 0])
    lists, form = SparseRows(torch.tensor([0, 1]), torch.tensor([2, 3])), SparseRows(
        every, every, roles == 1, roles == 2, every=True)
    for layer in range(2):
        want = eager.attend(layer, lists, q, dense.clone(), positions, slots, read, False, 16)
        got = graph.attend(layer, form, q, dense.clone(), positions, slots, read_every, False, 16)
        assert torch.equal(got, want) and not torch.equal(got[2:4], dense[2:4])
    for name in ("keys", "count", "mass", "o_ref", "c_ref"):
        assert torch.equal(getattr(graph, name), getattr(eager, name)), name
    assert torch.equal(graph.present[:4], eager.present[:4]) and bool(graph.present[:4].all())
    assert int(graph.fallbacks) == int(eager.fallbacks) == 0


def _attention(q: torch.Tensor, read, position: int) -> torch.Tensor:
    """Row 0's dense attention over its keys 0..position through `read` (fp32, [Hq, D])."""
    k_cache, v_cache, tables, offsets, page_size, packed = read(torch.tensor([0]))
    assert packed is None  # a paged pool
    j = torch.arange(position + 1)
    at = tables[int(offsets[0]) + j // page_size] * page_size + j % page_size
    k = k_cache[at].repeat_interleave(q.shape[1] // k_cache.shape[1], dim=1)  # [n, Hq, D]
    v = v_cache[at].repeat_interleave(q.shape[1] // v_cache.shape[1], dim=1)
    probs = (torch.einsum("hd,nhd->hn", q[0], k) * q.shape[2] ** -0.5).softmax(-1)
    return torch.einsum("hn,nhd->hd", probs, v)


def test_a_missing_reference_runs_dense_in_the_correction():
    """A correction row whose state is missing gets dense attention over its keys from the
    correction step itself (a backend's dense launch may have left it out), whatever its
    input row held; rows whose state is present are corrected; each missing one counted."""
    refs, read = _roles_setup()
    positions, slots = torch.tensor([9, 12, 10, 11, 0]), torch.tensor([0, 1, 2, 3, 99])
    q = torch.randn(5, 2, 8)
    out = torch.zeros(5, 2, 8)
    for layer in range(2):  # slot 2's state, not slot 3's (present once the last layer ran)
        refs.attend(layer, SparseRows(torch.tensor([2]), torch.zeros(0, dtype=torch.long)), q, out.clone(),
                    positions, slots, read, False, 16)
    got = refs.attend(0, SparseRows(torch.zeros(0, dtype=torch.long), torch.tensor([2, 3])), q, out.clone(),
                      positions, slots, read, False, 16)
    shifted = lambda r: (lambda rows: read(rows + r))  # noqa: E731 -- row r's reader as row 0's
    torch.testing.assert_close(got[3], _attention(q[3:4], shifted(3), 11), atol=1e-6, rtol=1e-6)
    assert bool(got[2].abs().sum() > 0) and int(refs.fallbacks) == 1


def test_a_missing_reference_is_never_read():
    """A correction row whose slot's state was not written for its token (marked missing
    at entry) gets dense attention over its keys, not its slot's state, and is counted; a
    row whose token exited runs neither a source nor a correction."""
    refs = DecodeReferences(4, 1, 2, 8, 16, 0.5, torch.float32, torch.device("cpu"))
    k = torch.randn(32, 1, 8)
    v = torch.randn(32, 1, 8)
    tables = torch.arange(8)
    q = torch.randn(1, 2, 8)
    dense = torch.randn(1, 2, 8)
    rows = SparseRows(torch.zeros(0, dtype=torch.long), torch.tensor([0]))
    args = (torch.tensor([9]), torch.tensor([2]), paged_reader(k, v, tables, torch.tensor([0]), 4), False, 10)
    refs.enter(torch.tensor([2]))
    out = refs.attend(0, rows, q, dense.clone(), *args)
    want = _attention(q, args[2], 9)
    torch.testing.assert_close(out[0], want, atol=1e-6, rtol=1e-6)
    assert int(refs.fallbacks) == 1
    source = SparseRows(torch.tensor([0]), torch.zeros(0, dtype=torch.long))
    refs.attend(0, source, q, dense.clone(), *args)  # loop 2 writes the state
    out = refs.attend(0, rows, q, dense.clone(), *args)
    assert not torch.allclose(out[0], want, atol=1e-3) and int(refs.fallbacks) == 1  # corrected: not dense
    refs.enter(torch.tensor([2, 7]))  # a new token in slot 2 (7: not a decode slot)
    assert not bool(refs.present[2].any())
    gone = torch.tensor([True])  # its token exited (adaptive exit): no source, no correction, no count
    out = refs.attend(0, source, q, dense.clone(), *args, exited=gone)
    assert torch.equal(out, dense) and not bool(refs.present[2].any())
    out = refs.attend(0, rows, q, dense.clone(), *args, exited=gone)
    assert torch.equal(out, dense) and int(refs.fallbacks) == 1


def test_a_source_marks_its_state_present_at_its_last_layer():
    """A source pass marks its slots' state present for every layer once its last layer has
    written it (one write a pass); rows playing no part leave their slots alone."""
    refs, read = _roles_setup()
    positions, slots = torch.tensor([9, 12, 10, 11, 0]), torch.tensor([0, 1, 2, 3, 99])
    q, out = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    every = torch.arange(5)
    rows = SparseRows(every, every, torch.tensor([True, False, True, False, False]),
                      torch.zeros(5, dtype=torch.bool), every=True)
    refs.attend(0, rows, q, out.clone(), positions, slots, read, False, 16)
    assert not bool(refs.present.any())
    refs.attend(1, rows, q, out.clone(), positions, slots, read, False, 16)
    assert refs.present[:4].tolist() == [[True, True], [False, False], [True, True], [False, False]]


def test_the_dense_launch_keeps_scores_only_when_the_scratch_holds_every_source():
    """`scores_for` gives the scratch view a dense launch stores the sources' scores in, or
    None when the pass has more source rows than it holds (the source then runs its own
    scores kernel in chunks) or there is no scratch (the torch backend)."""
    refs = DecodeReferences(4, 2, 2, 8, 16, 0.5, torch.float32, torch.device("cpu"), max_rows=3)
    view = refs.scores_for(3, 16)
    assert view is not None and view.shape[1:] == (2, 16) and view.shape[0] >= 3
    assert view.data_ptr() == refs.scratch.data_ptr()
    assert refs.scores_for(view.shape[0] + 1, 16) is None and refs.scores_for(0, 16) is None
    assert refs.scores_for(3, 99)[0].shape == (2, 16)  # contexts past max_context are cut to it
    assert DecodeReferences(4, 2, 2, 8, 16, 0.5, torch.float32, torch.device("cpu")).scores_for(1, 16) is None


def test_the_scratch_keeps_strides_of_whole_16_key_blocks_at_every_context():
    """An eager pass shapes the scratch view by its longest context; rows of whole 16-key
    blocks keep the view's strides multiples of 16, so the kernels compile no variant for a
    new context, and the buffer holds a row at the longest context too."""
    refs = DecodeReferences(4, 2, 3, 8, 37, 0.5, torch.float32, torch.device("cpu"), max_rows=1)
    assert refs.scratch.numel() == 3 * 48  # one row of 3 heads x 48 keys
    for context in range(1, 38):
        view = refs.scores_for(1, context)
        assert view is not None and view.shape[2] >= context and view.shape[2] % 16 == 0, context
        assert view.stride(0) % 16 == 0 and view.stride(1) % 16 == 0, context
    bytes_of = DecodeReferences.nbytes(4, 2, 3, 8, 37, 0.5, torch.float32, max_rows=1)
    assert bytes_of == DecodeReferences.nbytes(4, 2, 3, 8, 37, 0.5, torch.float32) + refs.scratch.numel() * 4


@pytest.mark.parametrize("key", ["sources", "corrections", "both"])
def test_graph_variants_list_the_parts_their_key_names(key, monkeypatch):
    """With `SPLIT_GRAPHS`, a graph variant's pass lists every row of its bucket for the
    steps its key names and none for the other (so it launches no step for a part none of
    its rows plays), and a pass holding such lists replays that variant; the roles say
    which rows play each part. Without it (the default) every such pass replays "both"."""
    from specloop.flashloop.sparse_decode import batch
    from specloop.flashloop.sparse_decode.batch import VARIANTS, SparseDecodeBatch, SparseRows, variant_key

    class _Pass:
        num_rows = 4
        notes: dict = {}

    monkeypatch.setattr(batch, "SPLIT_GRAPHS", False)  # (whatever SPECLOOP_SPARSE_SPLIT_GRAPHS says)
    off = SparseDecodeBatch(max_rows=8, num_loops=4)
    assert off.variant_keys == ("both",) and off.variant_key(SparseRows(torch.arange(2), torch.arange(0))) == "both"
    monkeypatch.setattr(batch, "SPLIT_GRAPHS", True)
    part = SparseDecodeBatch(max_rows=8, num_loops=4)
    assert part.variant_keys == VARIANTS
    lp = _Pass()
    lp.notes = {}
    part.graph_view(lp, torch.tensor([1, 2, 0, 1]), key)
    rows = lp.notes[SparseRows]
    assert variant_key(rows) == part.variant_key(rows) == key
    assert rows.source.tolist() == ([0, 1, 2, 3] if key != "corrections" else [])
    assert rows.correction.tolist() == ([0, 1, 2, 3] if key != "sources" else [])
    if key != "corrections":
        assert rows.source_ok.tolist() == [True, False, False, True]
    if key != "sources":
        assert rows.correction_ok.tolist() == [False, True, False, False]
    lp.notes = {}
    part.graph_view(lp, torch.tensor([1, 2, 0, 1]), None)
    assert SparseRows not in lp.notes
    # an eager or replayed pass's lists (`tail_view`) name its variant
    for sources, corrections, want in (([0], [], "sources"), ([], [1, 2], "corrections"), ([0], [1], "both")):
        assert variant_key(SparseRows(torch.tensor(sources, dtype=torch.long),
                                      torch.tensor(corrections, dtype=torch.long))) == want
