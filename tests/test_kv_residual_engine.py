"""INT4 cross-loop KV residuals in the engine against the FlashLoop reference.

The engine (fp32 on the CPU, the torch backend) prefills prompts long enough that groups
seal (a short tail, so prompt queries already read sealed groups within their own chunk),
then decodes; the reference (`flashloop_greedy` with the same `KVResidual`) recomputes
everything with fake quantization and serial visibility. Greedy tokens must be equal and
the first token's logprob close, however the prompt is chunked and batched, with
token-sparse prefill on and off and with adaptive exit.
"""

from __future__ import annotations

import pytest
import torch

from specloop.checkpoint import load_model
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.errors import ConfigError
from specloop.model.flashloop_reference import FlashLoopFeatures, KVResidual, SparsePrefill, flashloop_forward, \
    flashloop_greedy
from specloop.sampling_params import SamplingParams
from specloop.flashloop.kv_residual.planes import NEVER
from specloop.flashloop.kv_residual.records import GROUP as RECORD_ROWS
from tests.conftest import weights_of
from tests.engine_runs import pages_at_rest, residual_planes
from specloop.flashloop.kv_residual.batch import ResidualPass

MAX_TOKENS = 6
TAIL = 5
_g = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(3, 200, (n,), generator=_g).tolist() for n in (150, 97, 211)]
SPARSE = (16, (1.0, 1.0, 0.5, 0.25))  # window, retention


def _engine(ckpt, sparse: bool = False, **kw) -> EngineCore:
    extra = {"token_sparse_prefill": {"window": SPARSE[0], "retention": list(SPARSE[1])}} if sparse else {}
    return EngineCore(EngineConfig.from_kwargs(
        str(ckpt), device=kw.pop("device", "cpu"), dtype=kw.pop("dtype", "float64"),
        num_kv_pages=kw.pop("num_kv_pages", 512), block_size=8, attention_backend=kw.pop("attention_backend", "torch"),
        kv_residual_quantization={"tail": kw.pop("tail", TAIL), "policy": kw.pop("policy", "serial")}, **extra, **kw))


def _run(engine: EngineCore, prompts: dict[str, list[int]], stagger: bool = False,
         max_tokens: int = MAX_TOKENS, each_step=None) -> dict[str, tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    out: dict[str, tuple[list[int], list[float]]] = {}
    pending = list(prompts.items())
    if not stagger:
        for rid, prompt in pending:
            engine.add_request(rid, prompt, params)
        pending = []
    while pending or engine.has_unfinished():
        if pending:
            rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for o in engine.step():
            assert o.error is None, o.error
            tokens, logprobs = out.setdefault(o.request_id, ([], []))
            tokens.extend(o.token_ids)
            logprobs.extend(o.logprobs or [])
        if each_step is not None:
            each_step(engine)
    assert pages_at_rest(engine)
    assert engine.kv.records.num_free == engine.kv.records.num_records
    return out


@pytest.fixture(scope="module")
def refs():
    return {}


def _reference(ckpt, cache, p: int, sparse: bool, exit_threshold: float | None = None):
    key = (str(ckpt), p, sparse, exit_threshold)
    if key not in cache:
        model, _ = load_model(ckpt, dtype=torch.float64)
        feats = FlashLoopFeatures(kv_residual=KVResidual(tail=TAIL),
                                  token_sparse_prefill=SparsePrefill(*SPARSE) if sparse else None)
        w, prompt = weights_of(model), PROMPTS[p]
        fwd = flashloop_forward(w, model.config, torch.tensor(prompt), len(prompt), feats, exit_threshold)
        tokens = flashloop_greedy(w, model.config, prompt, MAX_TOKENS, feats, exit_threshold)
        first = torch.log_softmax(fwd.logits[-1].double(), -1)[tokens[0]].item()
        dense = flashloop_greedy(w, model.config, prompt, MAX_TOKENS, FlashLoopFeatures(), exit_threshold) \
            if not sparse and exit_threshold is None else None
        cache[key] = (tokens, first, dense)
    return cache[key]


def _check(ckpt, cache, got, prompts, sparse=False, exit_threshold=None):
    for p in prompts:
        tokens, first, _ = _reference(ckpt, cache, p, sparse, exit_threshold)
        assert got[f"r{p}"][0] == tokens, f"prompt {p}"
        assert got[f"r{p}"][1][0] == pytest.approx(first, abs=1e-9), f"prompt {p}"


@pytest.mark.parametrize("batched_tokens", [2048, 64, 13])
def test_greedy_equals_the_reference(tiny_ckpt, refs, batched_tokens):
    """One call per prompt, or prompts chunked by the token budget (wavefront calls that mix
    depths and requests): the same tokens as the reference."""
    engine = _engine(tiny_ckpt, max_num_batched_tokens=batched_tokens)
    got = _run(engine, {f"r{p}": PROMPTS[p] for p in range(len(PROMPTS))})
    _check(tiny_ckpt, refs, got, range(len(PROMPTS)))


def test_staggered_arrivals_mix_prefill_and_decode(tiny_ckpt, refs):
    engine = _engine(tiny_ckpt, max_num_batched_tokens=40)
    got = _run(engine, {f"r{p}": PROMPTS[p] for p in range(len(PROMPTS))}, stagger=True)
    _check(tiny_ckpt, refs, got, range(len(PROMPTS)))


@pytest.mark.parametrize("policy, sparse", [("serial", False), ("execution", True)])
def test_graph_shaped_passes_decode_what_exact_ones_decode(tiny_ckpt, policy, sparse):
    """Passes in a CUDA graph's shape (what `LoopGraphs` replays: rows padded to a bucket, the
    pass's cells padded with the pad cell, a fixed number of candidate groups per cell and
    every plane), run eagerly: the same tokens and bit-equal logprobs as exact-sized passes,
    and the pad cell never holds a row or a record."""
    from specloop.runtime.graphs import DEFAULT_BUCKETS

    prompts = {"a": PROMPTS[1], "b": PROMPTS[0][:120]}  # groups seal in both
    want = _run(_engine(tiny_ckpt, sparse=sparse, policy=policy, max_num_batched_tokens=32), prompts, stagger=True)
    engine = _engine(tiny_ckpt, sparse=sparse, policy=policy, max_num_batched_tokens=32)
    batches = engine.executor.runner.batches
    batches.buckets = DEFAULT_BUCKETS[:7]  # up to 32 rows
    shaped = []
    build = batches.build

    def counting(plan):
        batch = build(plan)
        shaped.extend(lp.notes[ResidualPass].pass_cells.numel() > len({g.cell for g in plan.groups}) for lp in batch.passes)
        return batch

    batches.build = counting
    assert _run(engine, prompts, stagger=True) == want
    assert any(shaped), "some pass was padded to a graph's cells"
    store = residual_planes(engine)
    assert int(store.rows[store.pad_cell].sum()) == 0 and int(store.encoded[store.pad_cell].sum()) == 0
    assert bool((store.group_tables[store.pad_cell] == store.sink).all())


def _records_on_device(engine: EngineCore) -> None:
    """Every group a running request's device rows reach has a record, and it is the host's:
    records reach the device for every plane, however the planes grow."""
    store = residual_planes(engine)
    for req in engine.scheduler.running:
        tables = engine.kv.records.tables(req.kv_key)
        for p, rows in enumerate(store.rows[req.cell].tolist()):
            groups = -(-rows // RECORD_ROWS)
            assert groups <= len(tables[p]), (req.request_id, p, rows, len(tables[p]))
            device = store.group_tables[req.cell, p, :groups].tolist()
            assert device == tables[p][:groups], (req.request_id, p, device, tables[p][:groups])


def test_sparse_planes_get_records_where_dense_ones_need_none(tiny_ckpt):
    """Decoding past a prompt of 60 at window 16, 1/1/0.5/0.25: plane 2 needs its second
    record at coverage 96, where plane 0 needs none; the device must still get it."""
    engine = _engine(tiny_ckpt, sparse=True, max_num_batched_tokens=64)
    _run(engine, {"a": PROMPTS[0][:60]}, max_tokens=40, each_step=_records_on_device)


@pytest.mark.parametrize("batched_tokens", [2048, 24])
def test_with_token_sparse_prefill(tiny_ckpt, refs, batched_tokens):
    """Residual rows only for the tokens a window kept: compact rows, absent = inherited."""
    engine = _engine(tiny_ckpt, sparse=True, max_num_batched_tokens=batched_tokens)
    held: list[list[int]] = []

    def rows_fit(engine: EngineCore) -> None:
        """The host sizes a sparse plane's records by its windows' budgets: every row the
        device wrote has a record, and the sparse planes take fewer than the dense ones."""
        _records_on_device(engine)
        for req in engine.scheduler.running:
            held.append([len(t) for t in engine.kv.records.tables(req.kv_key)])

    got = _run(engine, {f"r{p}": PROMPTS[p] for p in range(len(PROMPTS))}, each_step=rows_fit)
    _check(tiny_ckpt, refs, got, range(len(PROMPTS)), sparse=True)
    assert any(h[3] < h[2] < h[0] for h in held), "window 16 at 1/1/0.5/0.25: planes 2 and 3 hold fewer records"


def test_with_adaptive_exit(tiny_ckpt, refs):
    """Exited tokens have no rows at deeper planes (LAST_EXITED as inheritance)."""
    engine = _engine(tiny_ckpt, exit_threshold=0.5, max_num_batched_tokens=64)
    got = _run(engine, {f"r{p}": PROMPTS[p] for p in range(len(PROMPTS))})
    _check(tiny_ckpt, refs, got, range(len(PROMPTS)), exit_threshold=0.5)


def test_decode_fills_a_group_and_reads_it_from_its_seal(tiny_ckpt):
    """Decode rows complete a group (its last row is a generated token, encoded in that
    token's own call) and later decode queries read it exact until its seal, reconstructed
    from the seal on: position 118 + 20 tokens crosses row 127 and seal 127 + TAIL."""
    model, _ = load_model(tiny_ckpt, dtype=torch.float64)
    prompt = torch.randint(3, 200, (118,), generator=torch.Generator().manual_seed(9)).tolist()
    feats = FlashLoopFeatures(kv_residual=KVResidual(tail=TAIL))
    w = weights_of(model)
    want = flashloop_greedy(w, model.config, prompt, 20, feats)
    # serial visibility: one pass over the whole sequence gives every step's logits
    logits = flashloop_forward(w, model.config, torch.tensor(prompt + want), len(prompt), feats, None).logits
    want_lp = [torch.log_softmax(logits[len(prompt) - 1 + i].double(), -1)[t].item() for i, t in enumerate(want)]
    engine = _engine(tiny_ckpt)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=True)
    engine.add_request("r", prompt, params)
    got: list[int] = []
    got_lp: list[float] = []
    while engine.has_unfinished():
        for o in engine.step():
            got.extend(o.token_ids)
            got_lp.extend(o.logprobs)
    assert got == want
    assert got_lp == pytest.approx(want_lp, abs=1e-9)


def test_residuals_change_what_the_model_reads(tiny_ckpt, refs):
    """Not a vacuous comparison: the quantized reference's first logprob differs from dense."""
    model, _ = load_model(tiny_ckpt, dtype=torch.float32)
    w, prompt = weights_of(model), PROMPTS[2]
    dense = flashloop_forward(w, model.config, torch.tensor(prompt), len(prompt), FlashLoopFeatures(), None)
    quant = flashloop_forward(w, model.config, torch.tensor(prompt), len(prompt),
                              FlashLoopFeatures(kv_residual=KVResidual(tail=TAIL)), None)
    assert (dense.logits[-1] - quant.logits[-1]).abs().max() > 1e-3


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is on "
                                                 "only without CUDA (tests/conftest.py); the cuda case runs instead")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_triton_reader_matches_the_torch_backend(tiny_ckpt, device):
    """The Triton backend reads through the packed attention kernel (under the interpreter on
    CPU), its prompt chunks dequantized once (`kv_residual.chunks`): in fp32 the same greedy
    tokens as the torch backend, logprobs within 1e-3 (the two attention sums differ in
    rounding, which can flip an INT4 code near a boundary: see the module docstring), and
    tail pages back in the pool at the end."""
    prompts = {"a": PROMPTS[1][:80]} if device == "cpu" else {"a": PROMPTS[0], "b": PROMPTS[2]}
    runs = {}
    for backend in ("torch", "triton"):
        engine = _engine(tiny_ckpt, dtype="float32", device=device, attention_backend=backend,
                         max_num_batched_tokens=2048)
        runs[backend] = _run(engine, prompts)
        if backend == "triton":
            assert engine.backend.kv.chunk_rows >= len(prompts["a"]), "prompt chunks left the reader"
    for rid in prompts:
        assert runs["triton"][rid][0] == runs["torch"][rid][0], rid
        assert runs["triton"][rid][1] == pytest.approx(runs["torch"][rid][1], abs=1e-3), rid


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is on "
                                                 "only without CUDA (tests/conftest.py); the cuda case runs instead")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_prompt_chunks_read_what_the_reader_reads(tiny_ckpt, device, monkeypatch):
    """Prompt chunks dequantized once read each key as the packed reader does: with plans of
    64 rows (later chunks read groups earlier ones sealed, and groups sealing inside the
    chunk) the same tokens as with every row in the reader, logprobs within 1e-4 (fp32; only
    the attention sums' order differs), and the torch backend's tokens. (On the H200 both
    Triton runs sit 1.45e-3 from the torch backend on one token of the 211-token prompt, a
    code flip the chunks do not cause.)"""
    import specloop.flashloop.kv_residual.batch as residual_batch
    prompts = {"a": PROMPTS[0]} if device == "cpu" else {"a": PROMPTS[0], "b": PROMPTS[2]}
    kw = {"dtype": "float32", "device": device, "max_num_batched_tokens": 64}
    torch_run = _run(_engine(tiny_ckpt, attention_backend="torch", **kw), prompts)
    chunked = _engine(tiny_ckpt, attention_backend="triton", **kw)
    with_chunks = _run(chunked, prompts)
    assert chunked.backend.kv.chunk_rows >= sum(len(p) for p in prompts.values())
    monkeypatch.setattr(residual_batch, "CHUNK_ROWS", 1 << 30)
    reader = _engine(tiny_ckpt, attention_backend="triton", **kw)
    without = _run(reader, prompts)
    assert reader.backend.kv.chunk_rows == 0
    for rid in prompts:
        assert with_chunks[rid][0] == without[rid][0] == torch_run[rid][0], rid
        assert with_chunks[rid][1] == pytest.approx(without[rid][1], abs=1e-4), rid


def test_prompt_chunks_batch_their_key_reads(tiny_ckpt, monkeypatch):
    """A pass's prompt chunks (a wavefront holds several, at different depths) have their
    contexts read by one key-read launch: the same tokens and logprobs, bit for bit, as
    with each chunk's read alone (`BATCH_KEYS` 1), and some batch held several chunks;
    `chunk_batches` cuts batches at the limit, in order."""
    import specloop.flashloop.kv_residual.chunks as chunks
    sizes: list[int] = []
    batches = chunks.chunk_batches

    def recorded(chunk_list, reads, limit=None):
        out = batches(chunk_list, reads, limit)
        sizes.extend(len(b.index) for b in out)
        return out

    monkeypatch.setattr("specloop.flashloop.kv_residual.format.chunk_batches", recorded)
    # 64 prompt positions a plan enter depth 0, the rest of the budget moves earlier chunks deeper
    monkeypatch.setattr("specloop.scheduling.scheduler.Scheduler.prompt_ahead", lambda self, req: 64)
    # the interpreter on CPU; on a CUDA machine the interpreter is off (tests/conftest.py)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = {"dtype": "float32", "device": device, "attention_backend": "triton", "max_num_batched_tokens": 256}
    batched = _run(_engine(tiny_ckpt, **kw), {"a": PROMPTS[0]}, max_tokens=2)
    assert max(sizes) > 1, sizes
    sizes.clear()
    monkeypatch.setattr(chunks, "BATCH_KEYS", 1)
    alone = _run(_engine(tiny_ckpt, **kw), {"a": PROMPTS[0]}, max_tokens=2)
    assert max(sizes) == 1, sizes
    assert batched == alone
    cut = [chunks.PromptChunk(0, 64, 0, d, c, 0) for d, c in enumerate((100, 300, 200, 50))]
    one = lambda: torch.zeros(1, dtype=torch.long)  # noqa: E731
    reads = [chunks.ChunkReads(one(), one(), one(), one(), torch.zeros(0), torch.zeros(0)) for _ in cut]
    assert [(b.index, b.keys) for b in chunks.chunk_batches(cut, reads, limit=600)] == [([0, 1], 300),
                                                                                        ([2, 3], 200)]


@pytest.mark.parametrize("kw, message", [
    ({"speculation": "block"}, "tail .5. must exceed 15 with block speculation"),
])
def test_capability_errors(tiny_ckpt, kw, message):
    cfg = {"kv_residual_quantization": {"tail": TAIL}, "attention_backend": "torch"} | kw
    with pytest.raises(ConfigError, match=message):
        EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float32", num_kv_pages=64, **cfg))


def test_tail_pages_return_to_the_pool(tiny_ckpt, refs):
    """Once every position of a tail page reads its packed groups, the page goes back: three
    211-, 150- and 97-token requests in a pool that holds one prompt's BF16 planes (27 x 4
    pages of 8) plus a little run side by side, reuse each other's released pages, and still
    emit the reference's tokens (a page read after its release would show)."""
    engine = _engine(tiny_ckpt, num_kv_pages=150, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    for p in (2, 0, 1):
        engine.add_request(f"r{p}", PROMPTS[p], params)
    got: dict[str, tuple[list[int], list[float]]] = {}
    most_running, least_held = 0, None
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            tokens, logprobs = got.setdefault(o.request_id, ([], []))
            tokens.extend(o.token_ids)
            logprobs.extend(o.logprobs or [])
        most_running = max(most_running, len(engine.scheduler.running))
        for req in engine.scheduler.running:
            if req.output_ids and req.kv_key in engine.kv.requests():  # decoding: the prompt's pages went back
                held = engine.kv.held_pages(req.kv_key)
                least_held = held if least_held is None else min(least_held, held)
    _check(tiny_ckpt, refs, got, range(len(PROMPTS)))
    assert most_running >= 2, "the pool holds one prompt's BF16 planes: a second runs only on released pages"
    assert least_held is not None and least_held <= 4 * 4  # the tail: <= 4 pages of 8 a plane at TAIL 5
    assert pages_at_rest(engine)


@pytest.mark.parametrize("sparse", [False, True])
def test_shallow_planes_release_behind_their_own_frontier(tiny_ckpt, refs, sparse):
    """A wavefront prefill (chunks of 13 rows: plane 0 runs chunks ahead of plane 3) gives a
    plane's tail pages back behind that plane's frontier (and the next plane's, with
    token-sparse prefill, whose windows copy from it), not the deepest plane's: during the
    prompt plane 0 has released more pages than plane 3, and the tokens are the reference's
    (a page read after its release would show). Only the dense case tells the per-plane rule
    from one frontier for all planes: sparse planes seal later anyway."""
    engine = _engine(tiny_ckpt, sparse=sparse, max_num_batched_tokens=13)
    got, ahead = {}, []

    def look(e: EngineCore) -> None:
        for req in e.scheduler.running:
            if not req.output_ids and req.kv_key in e.kv.requests():
                ahead.append(e.kv.released(req.kv_key, 0) - e.kv.released(req.kv_key, e.kv.num_planes - 1))

    got = _run(engine, {"r0": PROMPTS[0]}, each_step=look)
    assert max(ahead) > 0, "plane 0 gave pages back while plane 3 still prefilled"
    _check(tiny_ckpt, refs, got, [0], sparse=sparse)


@pytest.mark.parametrize("rows, sparse, inflight, chunked", [
    (13, False, 2, False), (8, False, 3, False), (13, True, 2, False), (13, False, 1, False),
    (64, False, 2, True), (64, False, 3, True), (64, True, 2, True), (64, False, 1, True)])
def test_a_lone_request_runs_in_the_pages_admission_counts(tiny_ckpt, refs, rows, sparse, inflight, chunked):
    """Admission counts a request's pages at once (`KVManager.pages_at_once`: its tail and
    wavefront span per plane), not every position it covers: in a pool of exactly that many
    pages (fewer than the request covers, but with token-sparse prefill, whose 64-row groups
    span more than this prompt at retention 0.25), the longest prompt runs alone with no preemption
    (a bound too small would preempt it forever) and emits the reference's tokens. `chunked`:
    the pool holds only the span of the smallest prompt chunk (one block a plan at depth 0,
    `KVManager.prompt_ahead`), well under a plan's rows, and a lone request still runs."""
    kw = {"sparse": sparse, "max_num_batched_tokens": rows, "max_inflight_tickets": inflight}
    total = len(PROMPTS[2]) + MAX_TOKENS
    pages = _engine(tiny_ckpt, num_kv_pages=1 if chunked else 512, **kw).kv.pages_at_once(total)
    engine = _engine(tiny_ckpt, num_kv_pages=pages, **kw)
    if chunked and not sparse:  # (a sparse plane's span covers this whole prompt at any chunk)
        assert engine.kv.prompt_ahead(total) == 8 < rows  # one block
    assert pages < engine.kv.pages_for(total) or sparse  # (a sparse plane's groups span this whole prompt)
    assert engine.kv.fits_ever(total, len(PROMPTS[2]))
    peak = []

    def look(e: EngineCore) -> None:
        assert e.scheduler.num_preemptions == 0, "the lone request did not fit the pages admission counted"
        peak.append(e.kv.num_pages - e.kv.num_free_pages)

    got = _run(engine, {"r2": PROMPTS[2]}, each_step=look)
    assert 0 < max(peak) <= pages
    _check(tiny_ckpt, refs, got, [2], sparse=sparse)


def test_admission_refuses_what_cannot_run_alone(tiny_ckpt):
    """A request whose pages at once exceed the pool even at the smallest prompt chunk, or
    whose records exceed the record pool, is refused with the count, not admitted to preempt
    itself forever."""
    from specloop.errors import InvalidRequestError
    engine = _engine(tiny_ckpt, max_num_batched_tokens=13)
    total = len(PROMPTS[2]) + MAX_TOKENS
    least = _engine(tiny_ckpt, max_num_batched_tokens=13, num_kv_pages=1).kv.pages_at_once(total)
    small = _engine(tiny_ckpt, max_num_batched_tokens=13, num_kv_pages=least - 1)
    assert small.kv.prompt_ahead(total) == 8
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="KV pages at once"):
        small.add_request("r", PROMPTS[2], params)
    records = engine.kv.records  # pages to spare, one record short of the request's groups
    records.allocator = type(records.allocator)(records.records_for(None, total, len(PROMPTS[2])) - 1)
    with pytest.raises(InvalidRequestError, match="residual records"):
        engine.add_request("r", PROMPTS[2], params)
    assert not engine.has_unfinished()


def test_byte_budget_split_and_stats(tiny_ckpt):
    """A byte budget splits into BF16 pages (tail_share) and records (the rest); stats count
    both, per request and in total, and everything returns at the end."""
    from specloop.runtime.kv_format import PagedKV
    from specloop.flashloop.kv_residual.planes import PackedResiduals
    budget = 8 << 20
    engine = EngineCore(EngineConfig.from_kwargs(
        str(tiny_ckpt), device="cpu", dtype="float64", kv_cache_bytes=budget, block_size=8, attention_backend="torch",
        kv_residual_quantization={"tail": TAIL, "tail_share": 0.25}))
    cfg = engine.model.config
    page = PagedKV.page_bytes(cfg.num_hidden_layers, 8, cfg.num_key_value_heads, cfg.head_dim, torch.float64)
    record = PackedResiduals.record_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    assert engine.kv.num_pages == budget // 4 // page
    assert engine.kv.records.num_records == (budget - budget // 4) // record
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("a", PROMPTS[2], params)
    seen, most = False, 0
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        if "a" in stats.kv_bytes_per_request:
            seen = True
            assert stats.kv_bytes_per_request["a"] == stats.kv_bytes_used  # the only request
            assert 0 < stats.kv_record_bytes_used < stats.kv_bytes_used
            assert stats.kv_record_bytes_used % record == 0
            most = max(most, stats.kv_record_bytes_used)
    assert seen
    assert most == 4 * 4 * record  # 211 positions: 4 groups a plane (taken as the prompt's chunks enter)
    stats = engine.stats()
    assert stats.kv_bytes_used == stats.kv_record_bytes_used == 0
    assert stats.kv_records_free == engine.kv.records.num_records
    assert stats.kv_residual_quantization["tail"] == TAIL and stats.kv_residual_quantization["enabled"]


def _collector(got: dict[str, tuple[list[int], list[float]]]):
    """A function adding a step's outputs (tokens, logprobs) to `got`, failing on errors."""
    def collect(outs) -> None:
        for o in outs:
            assert o.error is None, o.error
            tokens, logprobs = got.setdefault(o.request_id, ([], []))
            tokens.extend(o.token_ids)
            logprobs.extend(o.logprobs or [])
    return collect


@pytest.mark.parametrize("steps, sparse", [(3, False), (9, False), (14, False), (9, True)])
def test_snapshot_restores_the_packed_planes(tiny_ckpt, refs, steps, sparse):
    """A snapshot taken mid-prefill or mid-decode (groups encoded, tail pages given back)
    carries the records, maps and counters; restored into a fresh engine through bytes, the
    requests finish with the reference's tokens and logprobs. With token-sparse prefill the
    planes hold different numbers of records."""
    from specloop.engine.snapshot import RequestSnapshot
    engine = _engine(tiny_ckpt, sparse=sparse, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    for p in range(len(PROMPTS)):
        engine.add_request(f"r{p}", PROMPTS[p], params)
    got: dict[str, tuple[list[int], list[float]]] = {}
    collect = _collector(got)

    for _ in range(steps):
        collect(engine.step())
    released = sum(engine.kv.released(r.kv_key, p) for r in engine.scheduler.running for p in range(4))
    snaps = {rid: RequestSnapshot.from_bytes(engine.snapshot(rid).to_bytes()) for rid in list(engine.requests)}
    assert snaps
    if steps == 14:
        assert released > 0, "the late snapshot is taken after tail pages went back"
    if sparse:
        counts = [s.data["residual"]["groups_per_plane"] for s in snaps.values()]
        assert any(c[3] < c[0] for c in counts), counts
    collect(engine.step())  # what quiescing committed comes out of the next step
    fresh = _engine(tiny_ckpt, sparse=sparse, max_num_batched_tokens=64)
    for snap in snaps.values():
        fresh.restore(snap)
    while fresh.has_unfinished():
        collect(fresh.step())
    _check(tiny_ckpt, refs, got, range(len(PROMPTS)), sparse=sparse)
    assert pages_at_rest(fresh) and fresh.kv.records.num_free == fresh.kv.records.num_records


def test_a_snapshot_owns_its_planes_state(tiny_ckpt):
    """A snapshot kept in memory (a swap) shares no storage with the live planes: the engine
    rewrites its cells' maps and counters while the snapshot waits (on CPU `.cpu()` of a view
    is the view itself)."""
    engine = _engine(tiny_ckpt, max_num_batched_tokens=64)
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    res = engine.snapshot("r").data["residual"]
    live = residual_planes(engine)
    for name in ("row_maps", "rows", "encoded"):
        assert res[name].untyped_storage().data_ptr() != getattr(live, name).untyped_storage().data_ptr(), name
        assert res[name].untyped_storage().nbytes() == res[name].numel() * res[name].element_size(), name
    engine.drain()


def test_a_restore_takes_only_the_pages_not_given_back(tiny_ckpt, refs):
    """A snapshot of a decoding request whose tail pages went back holds only its other
    pages, and its restore takes only those: it restores into a pool smaller than the pages
    its positions cover (before, it needed them all, so a swapped-out long request could
    never come back) and finishes with the reference's tokens."""
    from specloop.engine.snapshot import RequestSnapshot
    engine = _engine(tiny_ckpt, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    engine.add_request("r2", PROMPTS[2], params)
    got: dict[str, tuple[list[int], list[float]]] = {}
    collect = _collector(got)

    while not got:  # through the prompt: its groups sealed and tail pages went back
        collect(engine.step())
    snap = RequestSnapshot.from_bytes(engine.snapshot("r2").to_bytes())
    collect(engine.step())
    kv = snap.data["kv"]
    held = sum(kv["pages_per_plane"] - r for r in kv["released"])
    assert held < kv["pages_per_plane"] * 4, "tail pages went back before the snapshot"
    assert [k.shape[1] for k in kv["k"]] == [(kv["pages_per_plane"] - r) * 8 for r in kv["released"]]
    small = _engine(tiny_ckpt, max_num_batched_tokens=64, num_kv_pages=held + 4)
    assert small.kv.num_pages < kv["pages_per_plane"] * 4
    small.restore(snap)
    while small.has_unfinished():
        collect(small.step())
    _check(tiny_ckpt, refs, got, [2])
    assert pages_at_rest(small)


def test_swap_preemption_carries_the_packed_planes(tiny_ckpt, refs):
    """preemption_mode swap: requests swapped out mid-prompt and while decoding come back
    through snapshots of their packed planes and still emit the reference's tokens. (The
    swaps are forced: admission keeps prompts that grow together from preempting each other,
    `test_prompts_growing_together_do_not_preempt_each_other`.)"""
    engine = _engine(tiny_ckpt, num_kv_pages=150, max_num_batched_tokens=64, preemption_mode="swap")
    steps = [0]

    def swap_some(e: EngineCore) -> None:
        steps[0] += 1
        running = [r for r in e.scheduler.running if r.num_preemptions < 2]
        if len(running) > 1 and steps[0] % 4 == 2:
            e.scheduler.preempt(running[-1])
    got = _run(engine, {f"r{p}": PROMPTS[p] for p in (2, 0, 1)}, each_step=swap_some)
    _check(tiny_ckpt, refs, got, range(len(PROMPTS)))
    assert engine.scheduler.num_preemptions >= 3


def test_prompts_growing_together_do_not_preempt_each_other(tiny_ckpt, refs):
    """Three prompts at once in a pool that holds one prompt's BF16 planes (27 x 4 pages of 8)
    plus a little: admission counts the pages at once and the records of the prompts already
    entering theirs, so none is preempted (before 2026-12-06 this pool forced preemptions:
    admission counted a prompt's first plan), the tail pages released behind one prompt serve
    the next, and every request emits the reference's tokens."""
    engine = _engine(tiny_ckpt, num_kv_pages=150, max_num_batched_tokens=64)
    most = [0]

    def watch(e: EngineCore) -> None:
        most[0] = max(most[0], len(e.scheduler.running))
    got = _run(engine, {f"r{p}": PROMPTS[p] for p in (2, 0, 1)}, each_step=watch)
    _check(tiny_ckpt, refs, got, range(len(PROMPTS)))
    assert engine.scheduler.num_preemptions == 0
    assert most[0] >= 2


def test_a_snapshot_without_packed_planes_is_refused(tiny_ckpt):
    from specloop.engine.snapshot import SnapshotError
    plain = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float64", num_kv_pages=512,
                                                block_size=8, attention_backend="torch"))
    plain.add_request("a", PROMPTS[1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    plain.step()
    snap = plain.snapshot("a")
    with pytest.raises(SnapshotError, match="kv_residual_quantization"):
        _engine(tiny_ckpt).restore(snap)


SPEC_TAIL = 13  # > (max_inflight_tickets + 1) x a round's rows (k 3: 4 rows, 2 tickets): the least allowed
SPEC_TOKENS = 22


def _check_serial(ckpt, prompt: list[int], tokens: list[int], logprobs: list[float]) -> None:
    """The engine's tokens are the reference's greedy ones and its logprobs the reference's.
    Under serial visibility one reference pass over prompt + tokens gives every step's
    logits, so each token must be the argmax at its step (by induction, the reference's
    own greedy continuation) and its logprob equal."""
    model, _ = load_model(ckpt, dtype=torch.float64)
    w, feats = weights_of(model), FlashLoopFeatures(kv_residual=KVResidual(tail=SPEC_TAIL))
    logits = flashloop_forward(w, model.config, torch.tensor(prompt + tokens), len(prompt), feats, None).logits
    steps = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].double(), -1)
    assert steps.argmax(-1).tolist() == tokens
    assert logprobs == pytest.approx(steps[torch.arange(len(tokens)), tokens].tolist(), abs=1e-9)


SPEC_MODES = {
    "block-d1": {"speculation": "block", "draft_loops": 1, "num_speculative_tokens": 3},
    "block-d2": {"speculation": "block", "draft_loops": 2, "num_speculative_tokens": 3},
    "pipeline-d1": {"speculation": "pipeline", "draft_loops": 1},
}


def _spec_engine(mode: str, kv: dict, **extra) -> EngineCore:
    """The shipped model (its drafts get accepted and rejected), fp64 on the torch backend."""
    from specloop.assets import default_model_path
    return EngineCore(EngineConfig.from_kwargs(
        str(default_model_path()), device="cpu", dtype="float64", num_kv_pages=512, block_size=8,
        attention_backend="torch", max_num_batched_tokens=64, kv_residual_quantization=kv, **SPEC_MODES[mode],
        **extra))


def _spec_prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(3)
    return {"a": torch.randint(3, 4000, (120,), generator=gen).tolist(),
            "b": torch.randint(3, 4000, (56,), generator=gen).tolist()}


@pytest.mark.parametrize("mode", list(SPEC_MODES))
def test_speculation_reads_what_serial_decoding_reads(mode):
    """Block rounds and token pipelines under the serial policy (the shipped model, whose
    drafts get accepted and rejected): candidates stay in the tail until committed, rejected
    ones leave every plane (their compact rows are reused), and a verification row reads
    every key as serial decoding would: the greedy tokens and every logprob equal the
    reference's (which decodes serially), across groups that fill and seal during decode."""
    from specloop.assets import default_model_path
    ckpt = default_model_path()
    prompts = _spec_prompts()  # decoding fills a group (row 127; row 63) and reads it from its seal on (140; 76)
    engine = _spec_engine(mode, {"tail": SPEC_TAIL})
    got = _run(engine, prompts, max_tokens=SPEC_TOKENS)
    stats = engine.stats()
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0, "rounds must both accept and reject"
    for rid, prompt in prompts.items():
        assert len(got[rid][0]) == SPEC_TOKENS, rid
        _check_serial(ckpt, prompt, *got[rid])


# --- the execution policy ----------------------------------------------------------------

def _encoded_groups(engine: EngineCore):
    """(request, cell, plane, group, record, positions [64]) of every encoded group of the
    running requests."""
    store = residual_planes(engine)
    for req in engine.scheduler.running:
        for p in range(store.num_planes):
            for g in range(int(store.encoded[req.cell, p])):
                record = int(store.group_tables[req.cell, p, g])
                yield req, req.cell, p, g, record, store.row_pos[record].long()


def _fresh_encodings(engine: EngineCore) -> int:
    """Every encoded group whose rows' tail pages are held holds the bytes encoding them
    now gives (the torch reference, into a copy of the layer's pools), at every layer: no
    encoding of rejected candidates, or against a predecessor that changed since, survives.
    And every position whose tail page went back still reads packed (a rollback never
    unseals a group a given-back page needs). Returns how many groups it checked."""
    from specloop.kernels.residual_encode import encode_groups_reference
    store, kv = residual_planes(engine), engine.executor.runner.backend.kv
    names = ("k_codes", "k_scale", "k_lo", "v_codes", "v_scale", "v_lo")
    for req in engine.scheduler.running:
        for p in range(store.num_planes):
            gone = torch.arange(engine.kv.released(req.kv_key, p) * kv.page_size)
            if gone.numel():
                seal = store.seals(torch.tensor([req.cell]), p, gone[None])[0]
                assert (seal < NEVER).all(), (req.request_id, p, "a given-back position reads exact")
    checked = 0
    for req, cell, p, g, record, positions in _encoded_groups(engine):
        if int(positions.min()) < engine.kv.released(req.kv_key, p) * kv.page_size:
            continue  # its tail went back: nothing can change it any more
        tables = torch.tensor(engine.kv.page_table(req.kv_key, p))
        one = lambda t: torch.tensor([t])  # noqa: E731
        for layer in range(store.k_codes.shape[0]):
            pools = [getattr(store, n)[layer].clone() for n in names]
            encode_groups_reference(kv.k[layer], kv.v[layer], tables, kv.page_size, p, one(cell), positions[None],
                                    one(record), torch.tensor([True]), one(0), *pools, store.group_tables,
                                    store.row_maps, sink=store.sink)
            rows = slice(record * RECORD_ROWS, (record + 1) * RECORD_ROWS)
            for n, new in zip(names, pools):
                at = rows if n.startswith("v_") else slice(record, record + 1)
                assert torch.equal(new[at], getattr(store, n)[layer][at]), (req.request_id, p, g, layer, n)
        checked += 1
    return checked


@pytest.mark.parametrize("sparse", [False, True])
def test_execution_policy_decodes_what_serial_decodes(tiny_ckpt, sparse):
    """Prompts too short for any group to seal while they prefill: every group completes
    and seals during decode, one position a pass, where the execution policy's safe point
    is the serial policy's seal: the same tokens and bit-equal logprobs."""
    prompts = {"a": PROMPTS[0][:60], "b": PROMPTS[1][:44]}  # group 0 fills at 63 and seals at 68: decode
    runs = {policy: _run(_engine(tiny_ckpt, sparse=sparse, policy=policy, max_num_batched_tokens=64), prompts,
                         max_tokens=26) for policy in ("serial", "execution")}
    assert runs["execution"] == runs["serial"]


def test_execution_policy_seals_at_safe_points(tiny_ckpt):
    """Chunked prefill: a chunk reads the groups it completes exact (its first query is the
    safe point), so a group seals at or after its serial seal, later where a chunk held
    it; every encoded group holds what its rows encode to."""
    late, checked = [], []

    def look(engine: EngineCore) -> None:
        store = residual_planes(engine)
        for _, _, _, _, record, positions in _encoded_groups(engine):
            seal, serial = int(store.seal[record]), int(positions[-1]) + TAIL
            assert seal >= serial, (seal, serial)
            late.append(seal > serial)
        checked.append(_fresh_encodings(engine))

    engine = _engine(tiny_ckpt, policy="execution", max_num_batched_tokens=64)
    got = _run(engine, {f"r{p}": PROMPTS[p] for p in range(len(PROMPTS))}, each_step=look)
    assert any(late), "a chunk's own groups seal at a later pass"
    assert sum(checked) > 0
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in got.values())


@pytest.mark.parametrize("mode", ["block-d1", "pipeline-d1"])
def test_execution_policy_under_speculation_rolls_sealed_candidates_back(mode):
    """A tail of 2 (the serial policy refuses it with speculation): groups seal over
    candidates that get rejected. The rollback unseals them and the groups encoded against
    them, their tails stay until their rows commit, and after every step every encoded
    group holds what its current rows encode to; pages and records all come back."""
    prompts = _spec_prompts()
    engine = _spec_engine(mode, {"tail": 2, "policy": "execution"})
    store = residual_planes(engine)
    unsealed = []
    truncate = store.truncate

    def counting(cells, keep):
        before = store.encoded[cells].sum()
        truncate(cells, keep)
        unsealed.append(int(before - store.encoded[cells].sum()))

    store.truncate = counting
    checked = []
    tokens = 14  # a's group 1 fills at token 8; rejections after it unseal
    got = _run(engine, prompts, max_tokens=tokens, each_step=lambda e: checked.append(_fresh_encodings(e)))
    stats = engine.stats()
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0, "rounds must both accept and reject"
    assert sum(unsealed) > 0, "some rollback must unseal a group that sealed over candidates"
    assert sum(checked) > 0
    assert all(len(got[rid][0]) == tokens for rid in prompts)


LONG = torch.randint(3, 200, (480,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.mark.parametrize("p, chunk", [(0, 64), (2, 64), (2, 2048), ("long", 2048)])
def test_execution_policy_equals_its_reference(tiny_ckpt, p, chunk):
    """One request alone, its prompt in passes of `chunk` positions a plane, then decoding:
    its tokens and every logprob are the FlashLoop reference's with the execution policy's
    safe points (the chunk starts, then every position; `KVResidual.safe_point`), which
    differ from the serial reference's. The long prompt leaves 7 full groups a plane for
    the first decode pass to seal (more than a decode pass's own rows would look at), with
    passes in graph buckets' shape where they fit (a bucket of 1 whose fixed candidate
    count is too small for that pass falls back to an exact-sized one)."""
    prompt = LONG if p == "long" else PROMPTS[p]
    engine = _engine(tiny_ckpt, policy="execution", max_num_batched_tokens=chunk)
    if p == "long":
        engine.executor.runner.batches.buckets = (1, 256)
    tokens, logprobs = _run(engine, {"r": prompt}, max_tokens=12 if p != "long" else 4)["r"]
    model, _ = load_model(tiny_ckpt, dtype=torch.float64)
    w = weights_of(model)
    steps = {}
    for policy in ("execution", "serial"):
        feats = FlashLoopFeatures(kv_residual=KVResidual(tail=TAIL, policy=policy, chunk=chunk))
        logits = flashloop_forward(w, model.config, torch.tensor(prompt + tokens), len(prompt), feats, None).logits
        steps[policy] = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].double(), -1)
    assert steps["execution"].argmax(-1).tolist() == tokens
    assert logprobs == pytest.approx(steps["execution"][torch.arange(len(tokens)), tokens].tolist(), abs=1e-9)
    assert not torch.allclose(steps["execution"], steps["serial"], atol=1e-6), "the policies read differently"


@pytest.mark.parametrize("policy", ["serial", "execution"])
def test_snapshots_right_after_rollbacks(policy, monkeypatch):
    """Block rounds with token-sparse prefill on the shipped model: after every step the
    request is snapshotted (each rollback's truncate still pending on the device: the
    snapshot applies it first, so no rejected row or group sealed over one is captured);
    the first snapshot and each that met a pending rollback is restored into a fresh
    engine, whose planes equal the live ones' (rows, maps, encoded groups' bytes and
    seals), and the live run goes on to the end."""
    from specloop.engine.snapshot import RequestSnapshot, SnapshotError

    def make() -> EngineCore:
        return _spec_engine("block-d1", {"tail": 2 if policy == "execution" else SPEC_TAIL, "policy": policy},
                            token_sparse_prefill={"window": 16, "retention": [1.0, 1.0, 0.5, 0.25]})

    from specloop.flashloop.kv_residual.snapshot import ResidualPart
    flush, pending = ResidualPart._flush, []

    def counting(part, key, cell):  # did the capture meet a truncate the device lacks?
        pending.append(part.records._requests[key].truncate is not None)
        flush(part, key, cell)

    monkeypatch.setattr(ResidualPart, "_flush", counting)
    engine = make()
    gen = torch.Generator().manual_seed(3)
    engine.add_request("a", torch.randint(3, 4000, (60,), generator=gen).tolist(),
                       SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    restored = 0
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
        if not engine.scheduler.running:
            continue
        req = engine.scheduler.running[0]
        try:  # quiescing commits every ticket: a rollback truncates the host, not yet the device
            snap = RequestSnapshot.from_bytes(engine.snapshot("a").to_bytes())
        except SnapshotError:
            break  # it finished as its tickets completed
        live = residual_planes(engine)
        assert torch.equal(live.rows[req.cell], (live.row_maps[req.cell] >= 0).sum(-1))
        if restored and not pending[-1]:
            continue  # restore the first snapshot and those that met a pending rollback
        fresh = make()
        fresh.restore(snap)
        restored += 1
        copy = residual_planes(fresh)
        other = fresh.scheduler.running[0]
        covered = engine.kv.coverage(req.kv_key)
        assert torch.equal(live.rows[req.cell], copy.rows[other.cell])
        assert torch.equal(live.encoded[req.cell], copy.encoded[other.cell])
        assert torch.equal(live.row_maps[req.cell, :, :covered], copy.row_maps[other.cell, :, :covered])
        for p in range(live.num_planes):
            for g in range(int(live.encoded[req.cell, p])):
                a, b = int(live.group_tables[req.cell, p, g]), int(copy.group_tables[other.cell, p, g])
                assert live.seal[a] == copy.seal[b]
                assert torch.equal(live.k_codes[:, a], copy.k_codes[:, b]) and torch.equal(live.row_pos[a], copy.row_pos[b])
    assert any(pending) and restored > 0, "a snapshot must meet a pending rollback"
    assert engine.stats().num_draft_tokens > engine.stats().num_accepted_tokens


@pytest.mark.parametrize("kw", [
    {"policy": "serial"},
    {"policy": "execution"},
    {"policy": "execution", "sparse": True},
    {"policy": "execution", "speculation": "block", "draft_loops": 1, "num_speculative_tokens": 3,
     "tail": SPEC_TAIL},
    {"policy": "serial", "speculation": "block", "draft_loops": 1, "num_speculative_tokens": 3, "tail": SPEC_TAIL},
])
def test_every_seal_lies_a_tail_past_its_rows(tiny_ckpt, kw):
    """What the packed reader's `exact_gap` relies on (a key within the tail of a query reads
    exact without a look at its seal): after every step, each sealed record's seal lies at
    least `tail` past its last row's position, under both policies, with token-sparse
    prefill, and with speculation's rollbacks (which unseal under the execution policy)."""
    tail = kw.get("tail", TAIL)
    engine = _engine(tiny_ckpt, max_num_batched_tokens=64, **kw)
    checked = [0]

    def check(e: EngineCore) -> None:
        planes = e.backend.kv.planes
        sealed = planes.seal[:-1] < NEVER  # (the sink record, last, is never read)
        last = planes.row_pos[:-1, -1].long()
        bad = sealed & (planes.seal[:-1].long() < last + tail)
        assert not bad.any(), f"records {bad.nonzero().flatten().tolist()[:4]} sealed within the tail of their rows"
        checked[0] += int(sealed.sum())
    _run(engine, {f"r{p}": PROMPTS[p] for p in range(len(PROMPTS))}, each_step=check, max_tokens=20)
    assert checked[0] > 0
