"""Token-sparse prefill in the runtime against the FlashLoop reference.

The reference (`specloop.model.flashloop_reference`, full recomputation, no code shared
with the runtime) says which prompt tokens each window keeps at each loop and what the
model then emits. Here the engine runs the same prompts in fp32 on the CPU (the torch
backend; one case through the Triton kernels under the interpreter) and must keep the
same tokens (a probe on the runner reports each window's selection), emit the same greedy
tokens and give first-token logprobs within 1e-5, however the windows are batched:
alone, beside other requests and decodes, split across calls by the token budget, with
adaptive exit, under speculation and through preemption and snapshot/restore.
"""

from __future__ import annotations

import math

import pytest
import torch

from specloop.checkpoint import load_model
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.errors import ConfigError
from specloop.flashloop.config import TokenSparsePrefill
from specloop.model.flashloop_reference import FlashLoopFeatures, SparsePrefill, flashloop_forward, flashloop_greedy
from specloop.flashloop.token_sparse_prefill import select as sparse_prefill
from specloop.scheduling.prompts import DensePrompts
from specloop.flashloop.token_sparse_prefill.device import WindowDevice
from specloop.flashloop.token_sparse_prefill.batch import WindowBatch, WindowRows
from specloop.runtime.kv_format import PagedKV
from specloop.runtime.slot_storage import SlotStorage
from specloop.sampling_params import SamplingParams
from tests.conftest import weights_of
from tests.engine_runs import device_feature, forbid_syncs, pages_at_rest, run_all, step_into

MAX_TOKENS = 5
_g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(3, 200, (n,), generator=_g).tolist() for n in (30, 17, 9, 41)]
CASES = {  # window, retention
    "w8": (8, (1.0, 1.0, 0.25, 0.10)),
    "w8-half": (8, (1.0, 1.0, 0.5, 0.25)),
    "w5": (5, (1.0, 1.0, 0.6, 0.3)),
    "global": (64, (1.0, 1.0, 0.25, 0.10)),  # one window holds each whole prompt
    "loop4-only": (6, (1.0, 1.0, 1.0, 0.5)),
}
KEEP_LAST = {"w8-keep-last": (8, (1.0, 1.0, 0.25, 0.10))}  # keep_last on: the prompt's last token runs every loop


def _engine(ckpt, window: int, retention, keep_last: bool = False, **kw) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(
        str(ckpt), device=kw.pop("device", "cpu"), dtype="float32", num_kv_pages=kw.pop("num_kv_pages", 512), block_size=4,
        token_sparse_prefill={"window": window, "retention": list(retention), "keep_last": keep_last}, **kw))


class Probe:
    """What the runner selected: {(request, loop, window index): kept positions}."""

    def __init__(self, engine: EngineCore, window: int) -> None:
        self.kept: dict[tuple[str, int, int], list[int]] = {}
        self.window = window
        device_feature(engine, WindowDevice).probe = self

    def __call__(self, w: WindowRows, mask: torch.Tensor) -> None:
        key = (w.request_id, w.depth + 1, w.start // self.window)
        assert key not in self.kept, f"window {key} selected twice"
        self.kept[key] = (w.start + torch.nonzero(mask).flatten()).tolist()


def _run(engine: EngineCore, prompts, params=None, stagger: bool = False) -> dict[str, tuple[list[int], list[float]]]:
    params = params or SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    return run_all(engine, prompts, params, stagger)


@pytest.fixture(scope="module")
def refs():
    """Reference results per (checkpoint, case, prompt, exit threshold), computed once."""
    return {}


def _reference(ckpt, cache, case: str, p: int, exit_threshold: float | None = None):
    key = (str(ckpt), case, p, exit_threshold)
    if key not in cache:
        model, _ = load_model(ckpt, dtype=torch.float32)
        window, retention = CASES[case] if case in CASES else KEEP_LAST[case]
        feats = FlashLoopFeatures(token_sparse_prefill=SparsePrefill(window=window, retention=retention,
                                                                     keep_last=case in KEEP_LAST))
        w, prompt = weights_of(model), PROMPTS[p]
        fwd = flashloop_forward(w, model.config, torch.tensor(prompt), len(prompt), feats, exit_threshold)
        tokens = flashloop_greedy(w, model.config, prompt, MAX_TOKENS, feats, exit_threshold)
        bounds = fwd.audit.windows
        kept = {(loop, win): pos.tolist() for (loop, win), pos in fwd.audit.prefill_active.items()
                if len(pos) < bounds[win][1] - bounds[win][0]}  # a window kept whole runs dense: no selection
        first = torch.log_softmax(fwd.logits[-1].double(), -1)[tokens[0]].item()
        cache[key] = (tokens, first, kept, fwd)
    return cache[key]


def _check(ckpt, cache, case, got, probe, prompts=range(len(PROMPTS)), exit_threshold=None, exact_sets=True):
    for p in prompts:
        tokens, first, kept, _ = _reference(ckpt, cache, case, p, exit_threshold)
        assert got[f"r{p}"][0] == tokens, f"prompt {p}"
        assert got[f"r{p}"][1][0] == pytest.approx(first, abs=1e-5)
        if probe is not None and exact_sets:
            mine = {(loop, win): pos for (r, loop, win), pos in probe.kept.items() if r == f"r{p}"}
            assert mine == kept, f"prompt {p}"


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference(any_ckpt, refs, case):
    """Several requests in one engine: the same kept tokens per loop and window, the same
    greedy tokens, first-token logprobs within 1e-5."""
    window, retention = CASES[case]
    engine = _engine(any_ckpt, window, retention)
    probe = Probe(engine, window)
    got = _run(engine, PROMPTS)
    _check(any_ckpt, refs, case, got, probe)
    assert probe.kept, "no window was sparse"
    stats = engine.stats()
    left_out = sum(min((win + 1) * window, len(PROMPTS[int(r[1:])])) - win * window - len(pos)
                   for (r, _, win), pos in probe.kept.items())
    assert stats.prefill_rows_skipped == left_out > 0
    assert stats.token_sparse_prefill == {"enabled": True, "window": window, "retention": list(retention),
                                          "keep_last": False}


def test_the_last_tokens_need_not_be_kept(tiny_ckpt, refs):
    """Some window leaves out its last token, and some prompt its last token, at a sparse
    loop; the first output token still comes from the prompt's last state (checked above
    against the reference, here that the case is covered)."""
    window, retention = CASES["w8"]
    engine = _engine(tiny_ckpt, window, retention)
    probe = Probe(engine, window)
    _run(engine, PROMPTS)
    ends = {p: len(prompt) for p, prompt in enumerate(PROMPTS)}
    window_last = [(k, pos) for k, pos in probe.kept.items()
                   if min(k[2] * window + window, ends[int(k[0][1:])]) - 1 not in pos]
    prompt_last = [k for k, pos in probe.kept.items() if ends[int(k[0][1:])] - 1 not in pos
                   and (k[2] + 1) * window >= ends[int(k[0][1:])]]
    assert window_last and prompt_last


@pytest.mark.parametrize("rows", [2048, 3])
def test_keep_last_runs_the_prompts_last_token_every_loop(tiny_ckpt, refs, rows):
    """keep_last: every window ending a prompt keeps the prompt's last token at each sparse
    loop (without it some do not: `test_the_last_tokens_need_not_be_kept`), and the engine
    keeps the reference's sets and gives its tokens and first logprobs, in whole windows and
    in windows split across calls of 3 rows."""
    window, retention = KEEP_LAST["w8-keep-last"]
    engine = _engine(tiny_ckpt, window, retention, keep_last=True, max_num_batched_tokens=rows)
    probe = Probe(engine, window)
    got = _run(engine, PROMPTS)
    _check(tiny_ckpt, refs, "w8-keep-last", got, probe)
    ends = {f"r{p}": len(prompt) for p, prompt in enumerate(PROMPTS)}
    last_windows = [(k, pos) for k, pos in probe.kept.items() if (k[2] + 1) * window >= ends[k[0]]]
    assert last_windows and all(ends[k[0]] - 1 in pos for k, pos in last_windows)
    assert engine.stats().token_sparse_prefill["keep_last"] is True


@pytest.mark.parametrize("rows", [2, 3, 7])  # 2: fewer rows a call than the 4 a window keeps at loop 3
def test_windows_split_across_calls_and_regrouped(tiny_ckpt, refs, rows):
    """A token budget smaller than what a window keeps splits it over several calls, and
    arrivals one per step mix prompt windows with other requests' decodes: neither changes
    a window's selection or what the request emits."""
    window, retention = CASES["w8-half"]
    engine = _engine(tiny_ckpt, window, retention, max_num_batched_tokens=rows)
    probe = Probe(engine, window)
    got = _run(engine, PROMPTS, stagger=True)
    _check(tiny_ckpt, refs, "w8-half", got, probe)
    assert engine.scheduler.running == [] and not any(r.window_rows for r in engine.requests.values())


def test_adaptive_exit(tiny_ckpt, refs):
    """With Q-exit, exited tokens never run a sparse loop and never count as kept (they may
    fill a budget the others cannot, as rows that change nothing)."""
    window, retention = CASES["w8-half"]
    engine = _engine(tiny_ckpt, window, retention, exit_threshold=0.5)
    probe = Probe(engine, window)
    got = _run(engine, PROMPTS)
    _check(tiny_ckpt, refs, "w8-half", got, probe, exit_threshold=0.5, exact_sets=False)
    for p in range(len(PROMPTS)):
        _, _, kept, fwd = _reference(tiny_ckpt, refs, "w8-half", p, 0.5)
        exited = {i for i, e in enumerate(fwd.exit_loops.tolist()) if e < len(retention)}
        for (r, loop, win), pos in probe.kept.items():
            if r == f"r{p}":
                ref = kept.get((loop, win), [])
                assert set(pos) - exited == set(ref) - exited, (p, loop, win)
    assert any(e < 4 for p in range(len(PROMPTS)) for e in _reference(tiny_ckpt, refs, "w8-half", p, 0.5)[3]
               .exit_loops.tolist()), "no token exited: the case tests nothing"


@pytest.mark.parametrize("mode", [{"speculation": "block", "num_speculative_tokens": 3, "draft_loops": 1},
                                  {"speculation": "block", "num_speculative_tokens": 2, "draft_loops": 2},
                                  {"speculation": "pipeline", "draft_loops": 1}],
                         ids=["block-d1", "block-d2", "pipeline-d1"])
def test_speculation(tiny_ckpt, refs, mode):
    """Speculation drafts and verifies dense decode rows after a sparse prefill: greedy
    tokens as the reference's serial greedy decode."""
    window, retention = CASES["w8"]
    engine = _engine(tiny_ckpt, window, retention, **mode)
    probe = Probe(engine, window)
    got = _run(engine, PROMPTS)
    _check(tiny_ckpt, refs, "w8", got, probe)


@pytest.mark.parametrize("policy", ["recompute", "swap"])
def test_preemption_resumes_exactly(tiny_ckpt, refs, policy):
    """Requests preempted at fixed steps, windows split mid-loop included, emit what the
    reference does; a recomputed request selects its windows again, the same way."""
    window, retention = CASES["w8-half"]
    engine = _engine(tiny_ckpt, window, retention, max_num_batched_tokens=3, preemption_mode=policy)
    victims = []
    original = engine.scheduler.preempt
    engine.scheduler.preempt = lambda req: (victims.append((req.request_id, dict(req.window_rows))), original(req))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    out: dict[str, tuple[list[int], list[float]]] = {}
    step = 0
    while engine.has_unfinished():
        # A request mid-window whenever there is one, else any every 4 steps; each at most
        # twice, so all finish.
        running = [r for r in engine.scheduler.running if sum(v == r.request_id for v, _ in victims) < 2]
        split = [r for r in running if r.window_rows]
        if split or (running and step % 4 == 1):
            engine.scheduler.preempt((split or running)[0])
        step_into(engine, out)
        step += 1
        assert step < 3000
    assert pages_at_rest(engine)
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size
    assert len(victims) >= 4 and any(rows for _, rows in victims), "no preemption hit a split window"
    _check(tiny_ckpt, refs, "w8-half", out, None)


def test_snapshot_mid_window(tiny_ckpt, refs):
    """A snapshot taken while a window is split across calls restores (into another engine)
    to the same selection and output."""
    window, retention = CASES["w8-half"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    engine = _engine(tiny_ckpt, window, retention, max_num_batched_tokens=2)
    engine.add_request("r3", PROMPTS[3], params)
    for _ in range(200):
        engine.step()
        req = engine.requests["r3"]
        if req.window_rows:
            break
    assert req.window_rows, "the window never split"
    snap = engine.snapshot("r3")
    engine.abort("r3")
    other = _engine(tiny_ckpt, window, retention, max_num_batched_tokens=2)
    other.restore(type(snap).from_bytes(snap.to_bytes()))
    tokens = [t for o in other.drain() for t in o.token_ids]
    assert tokens == _reference(tiny_ckpt, refs, "w8-half", 3)[0]


def test_a_snapshot_from_another_window_setting_is_refused(tiny_ckpt):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine = _engine(tiny_ckpt, 8, CASES["w8"][1])
    engine.add_request("a", PROMPTS[0], params)
    engine.step()
    snap = engine.snapshot("a")
    other = _engine(tiny_ckpt, 16, CASES["w8"][1])
    with pytest.raises(Exception, match="token_sparse_prefill"):
        other.restore(snap)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter needs TRITON_INTERPRET before triton "
                    "loads; on the GPU the graph test runs the compiled kernel")
def test_triton_backend_under_the_interpreter(tiny_ckpt, refs, monkeypatch):
    """The paged attention kernel serves compacted rows with nonconsecutive positions."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    window, retention = CASES["w5"]
    engine = _engine(tiny_ckpt, window, retention, attention_backend="triton")
    probe = Probe(engine, window)
    got = _run(engine, PROMPTS[:2])
    _check(tiny_ckpt, refs, "w5", got, probe, prompts=range(2))


def test_full_retention_and_off_take_the_dense_path(tiny_ckpt):
    """Retention 1.0 everywhere or enabled false: no selection work, no previous-state copy,
    and the dense engine's output."""
    dense = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float32", num_kv_pages=512,
                                                block_size=4))
    want = _run(dense, PROMPTS)
    for group in ({"window": 8, "retention": [1, 1, 1, 1]}, {"enabled": False, "window": 8}):
        engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float32",
                                                     num_kv_pages=512, block_size=4, token_sparse_prefill=group))
        assert isinstance(engine.scheduler.prompts, DensePrompts) and engine.executor.runner.slots.previous.shape[1] == 0
        assert not [f for f in engine.features if isinstance(f, WindowDevice)], "no window selection runs"
        assert _run(engine, PROMPTS) == want


# ---- the selection step alone ---------------------------------------------------------------
def _storage(hidden: torch.Tensor, previous: torch.Tensor, depth: int) -> SlotStorage:
    n, h = hidden.shape
    slots = SlotStorage(n + 1, h, torch.float32, torch.device("cpu"), keep_previous=True)
    slots.hidden[:n], slots.previous[:n] = hidden, previous
    slots.depth[:n] = depth
    return slots


def _batch(groups: list[dict], pad: int) -> WindowBatch:
    """A WindowBatch of groups given as dicts: slots, start, depth, budget, rank, rows, first,
    table, inherited (what the forward batch builder uploads)."""
    width = max(len(g["slots"]) for g in groups)
    slots = torch.tensor([g["slots"] + [pad] * (width - len(g["slots"])) for g in groups])
    info = torch.tensor([[g["start"], len(g["slots"]), g["depth"], g["budget"], int(g["rank"] == 0),
                          g.get("table", 0), g.get("inherited", 0), g.get("last", -1)] for g in groups])
    rows = [r for g in groups for r in range(g["first"], g["first"] + g["rows"])]
    of = [i for i, g in enumerate(groups) for _ in range(g["rows"])]
    ranks = [k for g in groups for k in range(g["rank"], g["rank"] + g["rows"])]
    moved_of = [i for i, g in enumerate(groups) if g["rank"] == 0 for _ in range(len(g["slots"]) - g["budget"])]
    moved = [k for g in groups if g["rank"] == 0 for k in range(g["budget"], len(g["slots"]))]
    host = [WindowRows("r", g["first"], g["rows"], slots[i, : len(g["slots"])], g["start"], g["depth"], g["budget"],
                       g["rank"], False) for i, g in enumerate(groups)]
    return WindowBatch(host, slots, info, torch.tensor(rows), torch.tensor(of), torch.tensor(ranks),
                       torch.tensor(moved_of, dtype=torch.long), torch.tensor(moved, dtype=torch.long))


def _kept(slots: SlotStorage, n: int, depth: int) -> list[int]:
    return (slots.selected[:n] == depth).nonzero().flatten().tolist()


def test_selection_breaks_ties_by_position_and_keeps_the_highest_scores():
    previous = torch.zeros(6, 4)
    hidden = torch.ones(6, 4)
    previous[1] = previous[4] = 0.5  # tokens 1 and 4 changed less; 0, 2, 3, 5 tie
    slots = _storage(hidden, previous, depth=2)
    kept = sparse_prefill.select(slots, _batch([dict(slots=list(range(6)), start=16, depth=2, budget=3, rank=0,
                                                     first=0, rows=3)], pad=6), 1e-6)
    assert _kept(slots, 6, 2) == [0, 2, 3] and kept[0].nonzero().flatten().tolist() == [0, 2, 3]
    scores = sparse_prefill.change_scores(slots, torch.arange(6), 1e-6)
    assert torch.allclose(scores, torch.tensor([1.0, 0.5, 1.0, 1.0, 0.5, 1.0]))


def test_selection_is_nested_and_exited_tokens_only_fill():
    """At depth 3 only tokens that ran depth 2 are eligible; exited ones rank below every
    eligible one and above the rest."""
    hidden = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    slots = _storage(hidden, torch.zeros(6, 4), depth=3)
    slots.depth[[0, 5]] = 2  # did not run loop 3: never eligible for loop 4
    slots.exited[2] = True
    group = dict(slots=list(range(6)), start=0, depth=3, budget=3, rank=0, first=0, rows=3)
    sparse_prefill.select(slots, _batch([group], pad=6), 1e-6)
    assert set(_kept(slots, 6, 3)) == {1, 3, 4}
    slots.selected.fill_(-1)
    sparse_prefill.select(slots, _batch([{**group, "budget": 4, "rows": 4}], pad=6), 1e-6)
    assert set(_kept(slots, 6, 3)) == {1, 2, 3, 4}


def test_groups_of_a_call_select_independently():
    """Two windows (one short, padded) in one batch choose as each would alone; a group
    continuing a split window keeps the marks an earlier call made."""
    gen = torch.Generator().manual_seed(2)
    hidden, previous = torch.randn(11, 4, generator=gen), torch.randn(11, 4, generator=gen)
    alone = []
    for members, budget in ((list(range(8)), 3), ([8, 9, 10], 2)):
        slots = _storage(hidden, previous, depth=2)
        sparse_prefill.select(slots, _batch([dict(slots=members, start=0, depth=2, budget=budget, rank=0, first=0,
                                                  rows=budget)], pad=11), 1e-6)
        alone.append(_kept(slots, 11, 2))
    slots = _storage(hidden, previous, depth=2)
    both = _batch([dict(slots=list(range(8)), start=0, depth=2, budget=3, rank=0, first=0, rows=3),
                   dict(slots=[8, 9, 10], start=8, depth=2, budget=2, rank=0, first=3, rows=2)], pad=11)
    sparse_prefill.select(slots, both, 1e-6)
    assert _kept(slots, 11, 2) == sorted(alone[0] + alone[1])
    slots = _storage(hidden, previous, depth=2)
    slots.selected[[1, 4, 6]] = 2  # a split window selected in an earlier call: its later group keeps that
    later = _batch([dict(slots=list(range(8)), start=0, depth=2, budget=3, rank=2, first=0, rows=1)], pad=11)
    kept = sparse_prefill.select(slots, later, 1e-6)
    assert _kept(slots, 11, 2) == [1, 4, 6] and kept[0].nonzero().flatten().tolist() == [1, 4, 6]


def test_rows_fill_in_position_order_and_the_rest_inherit():
    n = 6
    slots = _storage(torch.zeros(n, 4), torch.zeros(n, 4), depth=2)
    slots.selected[[4, 1, 5]] = 2
    kv = PagedKV(2, 8, 4, 1, 2, torch.float32, torch.device("cpu"))
    kv.k.normal_()
    kv.v.normal_()
    before_k = kv.k.clone()
    tables = torch.tensor([4, 5, 6, 0, 1, 2])  # plane 1 pages at offset 0, plane 2 pages at offset 3
    wb = _batch([dict(slots=list(range(n)), start=2, depth=2, budget=3, rank=0, first=2, rows=2, table=3,
                      inherited=0)], pad=n)  # positions 2..7, ranks 0..1
    kept = (slots.selected[:n] == 2)[None]
    order = sparse_prefill.by_rank(kept)
    assert order.tolist() == [[1, 4, 5, 0, 2, 3]]
    sparse_prefill.inherit(kv, wb, order, tables, 4)
    src = [tables[0 + p // 4] * 4 + p % 4 for p in range(2, 8)]
    dst = [tables[3 + p // 4] * 4 + p % 4 for p in range(2, 8)]
    for layer in range(2):
        for i in range(n):
            want = before_k[layer, src[i]] if i not in (1, 4, 5) else before_k[layer, dst[i]]
            assert torch.equal(kv.k[layer, dst[i]], want)
    untouched = sorted(set(range(32)) - set(int(d) for d in dst))
    assert torch.equal(kv.k[:, untouched], before_k[:, untouched])
    batch_slots = torch.full((5,), -1)
    lp = type("LP", (), {"token_slots": torch.full((5,), -1), "positions": torch.full((5,), -1)})()
    sparse_prefill.fill_rows(wb, order, batch_slots, lp)
    assert batch_slots.tolist() == [-1, -1, 1, 4, -1] and lp.positions.tolist() == [-1, -1, 3, 6, -1]
    assert lp.token_slots.tolist() == [-1, -1, 1, 4, -1]


# ---- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize("value, message", [
    ("{", "must be a JSON object"),
    ("[1]", "must be a JSON object"),
    ({"window": 0}, "window must be a positive integer"),
    ({"retention": [1, 0.5, 0.25, 0.1]}, "keep loops 1 and 2 dense"),
    ({"retention": [1, 1, 0.1, 0.25]}, "must not increase"),
    ({"retention": [1, 1, 0, 0]}, "must lie in"),
    ({"retention": "x"}, "list of numbers"),
    ({"windw": 8}, "has no option 'windw'"),
    ({"enabled": "yes"}, "true or false"),
    ({"keep_last": 1}, "keep_last must be true or false"),
])
def test_configuration_errors_are_one_line(value, message):
    with pytest.raises(ConfigError, match=message) as info:
        EngineConfig.from_kwargs("m", token_sparse_prefill=value)
    assert "\n" not in str(info.value)


def test_start_up_checks(tiny_ckpt):
    with pytest.raises(ConfigError, match="retention has 3 values; the model runs 4 loops"):
        EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", token_sparse_prefill={"retention": [1, 1, 0.5]}))
    with pytest.raises(ConfigError, match="exceeds the engine's .* token slots"):
        EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", max_num_batched_tokens=4,
                                            token_sparse_prefill={"window": 1000}))


def test_defaults_and_summary():
    cfg = EngineConfig.from_kwargs("m", token_sparse_prefill="{}")
    group = cfg.token_sparse_prefill
    assert group.enabled and group.retention == (1.0, 1.0, 0.25, 0.10)
    assert cfg.summary()["token_sparse_prefill"] == {"enabled": True, "window": group.window,
                                                      "retention": [1.0, 1.0, 0.25, 0.1], "keep_last": False}
    assert not EngineConfig.from_kwargs("m").token_sparse_prefill.enabled
    assert [group.budget(2, n) for n in (10, 3, 1, 8)] == [3, 1, 1, 2]
    assert [group.budget(3, n) for n in (10, 11, 100)] == [1, 2, 10]
    assert TokenSparsePrefill(enabled=True, retention=(1, 1, 0.07, 0.07)).budget(2, 100) == 7  # not 8
    assert TokenSparsePrefill(window=8).bounds(13, 20) == (8, 16)
    assert TokenSparsePrefill(window=8).bounds(17, 20) == (16, 20)
    assert TokenSparsePrefill(window=8).bounds(3, 5) == (0, 5)
    assert math.ceil(100 * 0.07) == 8  # why the budget reads the decimal: 100 x 0.07 is 7.000000000000001


# ---- CUDA graphs and the device seam ----------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_padded_pass_blocks(tiny_ckpt):
    """Rows filled in on the device land in blocks padded to graph buckets (what a replay
    copies) as in unpadded ones."""
    window, retention = CASES["w8"]
    want = _run(_engine(tiny_ckpt, window, retention, max_num_batched_tokens=16), PROMPTS, stagger=True)
    engine = _engine(tiny_ckpt, window, retention, max_num_batched_tokens=16)
    engine.executor.runner.batches.buckets = (1, 2, 4, 8, 16)
    assert _run(engine, PROMPTS, stagger=True) == want


@cuda
def test_graphs_replay_window_rows(tiny_ckpt, refs):
    """On the GPU, passes holding a window's rows replay through CUDA graphs where they fit a
    bucket, and emit the reference's greedy tokens (fp32; logprobs within 1e-4 of eager)."""
    window, retention = CASES["w8"]
    kw = dict(device="cuda", max_num_batched_tokens=16)
    eager = _run(_engine(tiny_ckpt, window, retention, enforce_eager=True, **kw), PROMPTS, stagger=True)
    engine = _engine(tiny_ckpt, window, retention, **kw)
    runner = engine.executor.runner
    built, replayed = [], []
    build, replay = runner.batches.build, runner.graphs.replay
    runner.batches.build = lambda plan: built.append(build(plan)) or built[-1]
    runner.graphs.replay = lambda lp, hidden: (replayed.append(WindowBatch in built[-1].notes), replay(lp, hidden))[1]
    got = _run(engine, PROMPTS, stagger=True)
    assert any(replayed), "no pass with window rows was replayed"
    for r, (tokens, logprobs) in eager.items():
        assert got[r][0] == tokens and got[r][1] == pytest.approx(logprobs, abs=1e-4)
    _check(tiny_ckpt, refs, "w8", got, None)


@cuda
def test_selection_does_not_synchronise(tiny_ckpt):
    window, retention = CASES["w8"]
    engine = _engine(tiny_ckpt, window, retention, device="cuda", max_num_batched_tokens=16)
    forbid_syncs(engine)
    got = _run(engine, PROMPTS)
    assert all(len(t) == MAX_TOKENS for t, _ in got.values()) and engine.stats().prefill_rows_skipped > 0


def test_aborts_and_id_reuse_mid_window_leave_nothing(tiny_ckpt, refs):
    """Requests aborted while their windows wait, run or are split (pre-taken token slots
    included) give everything back; a request reusing an aborted ID runs as if alone."""
    window, retention = CASES["w8-half"]
    engine = _engine(tiny_ckpt, window, retention, max_num_batched_tokens=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    aborted = set()
    out: dict[str, list[int]] = {}
    for step in range(4000):
        if not engine.has_unfinished():
            break
        split = [r for r in engine.scheduler.running if r.window_rows and r.request_id not in aborted]
        if split and len(aborted) < 2:
            victim = split[0].request_id
            engine.abort(victim)
            aborted.add(victim)
            out.pop(victim, None)
            engine.add_request(victim, PROMPTS[int(victim[1:])], params)  # the same ID again
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    assert len(aborted) == 2, "no request was caught mid-window"
    assert pages_at_rest(engine)
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size
    assert engine.scheduler.cells.num_free == engine.scheduler.cells.size
    for i in range(len(PROMPTS)):
        assert out[f"r{i}"] == _reference(tiny_ckpt, refs, "w8-half", i)[0], f"r{i}"


# ---- scheduling guards ------------------------------------------------------------------------
def test_a_window_takes_all_its_token_slots_or_none(tiny_ckpt):
    """The first token of a window takes the slots of the whole window at once; with fewer
    free it waits, holding nothing; a younger request may not start a window while an older
    one waits for its slots, but may continue one it holds."""
    engine = _engine(tiny_ckpt, 8, CASES["w8"][1])
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[3], params)
    sched = engine.scheduler
    sched._admit()
    a, b = engine.requests["a"], engine.requests["b"]
    pool = sched.token_slots
    held = pool.take(pool.num_free - 5)
    assert sched._entry_rows(a, 0, 12) == 0 and not a.token_slots and pool.num_free == 5
    pool.retire(held)
    pool.release(held)
    assert sched._entry_rows(a, 0, 12) == 12  # windows [0, 8) and [8, 16): 16 slots taken
    assert sorted(a.token_slots) == list(range(16)) and pool.num_free == pool.size - 16
    assert sched._entry_rows(b, 0, 5, may_start=False) == 0 and not b.token_slots
    assert sched._entry_rows(a, 12, 4, may_start=False) == 4  # its window's slots are taken
    assert sched._entry_rows(a, 16, 8, may_start=False) == 0


def test_a_single_row_of_a_sparse_window_never_runs_every_loop(tiny_ckpt):
    engine = _engine(tiny_ckpt, 8, CASES["w8"][1])
    dense = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float32", num_kv_pages=64,
                                                block_size=4))
    for e in (engine, dense):
        e.add_request("a", PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        e.scheduler._admit()
        req = e.requests["a"]
        for plane in range(4):
            e.kv.advance(req.kv_key, plane, 8)
    assert engine.scheduler._entry_loops(engine.requests["a"], 8, 1, 100) == 1
    assert dense.scheduler._entry_loops(dense.requests["a"], 8, 1, 100) == 4


def test_seeded_sampling_does_not_depend_on_batching(tiny_ckpt):
    """Seeded sampled requests after a sparse prefill draw the same tokens alone, all at once,
    staggered and split over small calls (keyed draws; the selection does not move)."""
    window, retention = CASES["w8-half"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    alone = {}
    for i, prompt in enumerate(PROMPTS):
        got = _run(_engine(tiny_ckpt, window, retention), [prompt], params)
        alone[f"r{i}"] = got["r0"][0]
    together = _run(_engine(tiny_ckpt, window, retention), PROMPTS, params)
    split = _run(_engine(tiny_ckpt, window, retention, max_num_batched_tokens=3), PROMPTS, params, stagger=True)
    assert {r: t for r, (t, _) in together.items()} == alone == {r: t for r, (t, _) in split.items()}
