"""Snapshot/restore of one request: exact resumption in every mode, and clean refusals.

A request is snapshotted after a varying number of steps (mid-prefill, mid-round,
mid-pipeline), the snapshot goes through bytes, and a fresh engine restores it: its
committed tokens plus what the restored request emits equal an uninterrupted run (same
tokens, logprobs within 1e-4), greedy and seeded sampled. The snapshotting engine runs on
unchanged. A restore that cannot resume exactly (another format version or configuration,
the ID in use, no room) raises SnapshotError and leaves the engine as it was. On the GPU
where there is one (Triton attention, CUDA graphs), on the CPU otherwise.
"""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.engine.snapshot import RequestSnapshot, SnapshotError
from specloop.errors import InvalidRequestError
from specloop.sampling_params import SamplingParams
from tests.engine_runs import MODES, Outputs, assert_same, pages_at_rest

PROMPTS = [list(range(3, 17)), [5, 9, 2], list(range(40, 20, -1)), [7] * 9]
MAX_TOKENS = 12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(ckpt, pages: int = 2048, **mode) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(str(ckpt), device=DEVICE, dtype="float32", block_size=4,
                                               num_kv_pages=pages, max_num_seqs=8, max_num_batched_tokens=48,
                                               **mode))


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=3 + i, ignore_eos=True,
                              logprobs=True)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)


def _collect(out: Outputs, outputs) -> None:
    for o in outputs:
        assert o.error is None, o.error
        tokens, logprobs = out.setdefault(o.request_id, ([], []))
        tokens.extend(o.token_ids)
        logprobs.extend(o.logprobs or [])


def _start(engine: EngineCore) -> None:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, _params(i))


def _drained(engine: EngineCore) -> None:
    assert pages_at_rest(engine)
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size
    assert engine.scheduler.cells.num_free == engine.scheduler.cells.size


@pytest.fixture(scope="module")
def uninterrupted(tiny_ckpt) -> dict[str, Outputs]:
    return {}


def _want(tiny_ckpt, cache, mode: str) -> Outputs:
    if mode not in cache:
        engine = _engine(tiny_ckpt, **MODES[mode])
        _start(engine)
        out: Outputs = {}
        _collect(out, engine.drain())
        cache[mode] = out
    return cache[mode]


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
@pytest.mark.parametrize("steps", [2, 7, 13])
def test_restored_request_resumes_exactly(tiny_ckpt, uninterrupted, mode, steps):
    want = _want(tiny_ckpt, uninterrupted, mode)
    engine = _engine(tiny_ckpt, **MODES[mode])
    _start(engine)
    got: Outputs = {}
    for _ in range(steps):
        _collect(got, engine.step())
    # r0's snapshot stays in memory while the engine runs on (it must own its tensors); the
    # others go through bytes.
    snaps = {rid: engine.snapshot(rid) if rid == "r0" else RequestSnapshot.from_bytes(engine.snapshot(rid).to_bytes())
             for rid in ("r0", "r1", "r2") if rid in engine.requests}
    assert snaps, "every request finished before the snapshot"
    _collect(got, engine.drain())  # the snapshotting engine runs on unchanged
    assert_same(got, want, 1e-4)
    _drained(engine)
    fresh = _engine(tiny_ckpt, **MODES[mode])
    for snap in snaps.values():
        fresh.restore(snap)
    resumed: Outputs = {}
    _collect(resumed, fresh.drain())
    for rid, snap in snaps.items():
        before = snap.data["request"]["output_ids"]
        tokens, logprobs = want[rid]
        assert before + resumed.get(rid, ([], []))[0] == tokens, rid
        torch.testing.assert_close(torch.tensor(resumed.get(rid, ([], []))[1]), torch.tensor(logprobs[len(before):]),
                                   atol=1e-4, rtol=1e-4)
    _drained(fresh)


def test_snapshot_then_abort_then_restore_in_the_same_engine(tiny_ckpt, uninterrupted):
    """The swap pattern by hand: snapshot, abort (tokens committed while quiescing come out
    in the abort's final output), restore under the same ID, and the request goes on."""
    want = _want(tiny_ckpt, uninterrupted, "block-d1")
    engine = _engine(tiny_ckpt, **MODES["block-d1"])
    _start(engine)
    got: Outputs = {}
    for _ in range(6):
        _collect(got, engine.step())
    snap = engine.snapshot("r1")
    final = engine.abort("r1")
    assert final.finished and final.finish_reason == "abort"
    _collect(got, [final])
    assert got["r1"][0] == snap.data["request"]["output_ids"]
    engine.restore(snap)
    _collect(got, engine.drain())
    assert_same(got, want, 1e-4)
    _drained(engine)


FEATURES = {"dense": {}, "prefill": {"token_sparse_prefill": {"window": 8, "retention": [1.0, 1.0, 0.5, 0.25]}},
            "decode": {"sparse_decode_attention": {"key_retention": 0.3}},
            "int4": {"kv_residual_quantization": {"tail": 16}}}
OWED_PROMPTS = {"a": list(range(40, 10, -1)), "b": [7, 8, 9, 10, 11, 12, 13, 14, 15]}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("mode", ["plain", "block-d2", "pipeline-d1"])
def test_an_abort_after_a_snapshot_loses_no_token(tiny_ckpt, mode, feature):
    """After every step: snapshot `a`, abort it, restore it where it was. The abort's final
    output carries exactly what the snapshot committed beyond what was emitted (the ticket in
    flight), nothing more or less; once, the snapshot is restored in another engine instead.
    Every token of the uninterrupted run comes out once, greedy and seeded, in every mode
    and with each FlashLoop feature."""
    options = {**MODES[mode], **FEATURES[feature], "pages": 512}
    params = {"a": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              "b": SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)}

    def start(engine):
        for rid, prompt in OWED_PROMPTS.items():
            engine.add_request(rid, prompt, params[rid])

    solo = _engine(tiny_ckpt, **options)
    start(solo)
    done = solo.drain()
    want = {rid: [t for o in done if o.request_id == rid for t in o.token_ids] for rid in OWED_PROMPTS}
    engine, elsewhere = _engine(tiny_ckpt, **options), _engine(tiny_ckpt, **options)
    start(engine)
    got: dict[str, list[int]] = {rid: [] for rid in OWED_PROMPTS}
    step, moved = 0, False
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.token_ids
        step += 1
        if "a" not in engine.requests or moved:
            continue
        snap = engine.snapshot("a")
        final = engine.abort("a")
        if final is None:  # `a` finished while the snapshot committed the ticket in flight: owed to the step
            continue
        assert final.finished and final.finish_reason == "abort"
        got["a"] += final.token_ids
        assert got["a"] == snap.data["request"]["output_ids"], f"step {step}: the abort lost or added a token"
        moved = len(got["a"]) >= 4  # mid-run: move it to the other engine, through bytes
        if moved:
            elsewhere.restore(RequestSnapshot.from_bytes(snap.to_bytes()))
        else:
            engine.restore(snap)
    for o in elsewhere.drain():
        got[o.request_id] += o.token_ids
    assert moved and got == want
    _drained(engine)
    _drained(elsewhere)


def _snapshot(tiny_ckpt, **mode) -> RequestSnapshot:
    engine = _engine(tiny_ckpt, **mode)
    _start(engine)
    for _ in range(5):
        engine.step()
    return RequestSnapshot.from_bytes(engine.snapshot("r0").to_bytes())


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d.update(format="other"), "not a request snapshot"),
    (lambda d: d["config"].update(block_size=8), "block_size=8"),
])
def test_unknown_version_or_format_or_config_is_refused(tiny_ckpt, change, match):
    snap = _snapshot(tiny_ckpt)
    change(snap.data)
    engine = _engine(tiny_ckpt)
    with pytest.raises(SnapshotError, match=match):
        engine.restore(snap)
    assert not engine.requests and pages_at_rest(engine)


def test_other_engine_configuration_is_refused(tiny_ckpt):
    snap = _snapshot(tiny_ckpt, **MODES["pipeline-d1"])
    for other in ({}, MODES["pipeline-d2"], {"seed": 1}):
        with pytest.raises(SnapshotError, match="this engine has"):
            _engine(tiny_ckpt, **other).restore(snap)


def test_a_snapshot_from_before_keep_last_restores_and_keep_last_is_checked(tiny_ckpt):
    """Snapshots taken before token_sparse_prefill had `keep_last` (their group lacks it) were
    taken with it off: they restore into an engine with it off; one taken with it on is
    refused by an engine with it off."""
    group = FEATURES["prefill"]["token_sparse_prefill"]
    snap = _snapshot(tiny_ckpt, token_sparse_prefill=group)
    del snap.data["config"]["token_sparse_prefill"]["keep_last"]
    engine = _engine(tiny_ckpt, token_sparse_prefill=group)
    engine.restore(snap)
    assert "r0" in engine.requests
    on = _snapshot(tiny_ckpt, token_sparse_prefill={**group, "keep_last": True})
    with pytest.raises(SnapshotError, match="keep_last"):
        _engine(tiny_ckpt, token_sparse_prefill=group).restore(on)


def test_a_feature_off_on_both_sides_ignores_its_other_settings(tiny_ckpt):
    """A snapshot taken with a feature off restores into an engine with it off whatever the
    group's other settings say (sparse decode attention's default key retention moved from
    0.10 to 0.20 on 2026-12-07; snapshots without the feature must not be refused for it);
    with the feature on, a setting that differs is still refused."""
    snap = _snapshot(tiny_ckpt)
    group = snap.data["config"]["sparse_decode_attention"]
    assert group["enabled"] is False
    snap.data["config"]["sparse_decode_attention"] = {**group, "key_retention": 0.1}
    engine = _engine(tiny_ckpt)
    engine.restore(snap)
    assert "r0" in engine.requests
    on = _snapshot(tiny_ckpt, sparse_decode_attention={"key_retention": 0.1})
    with pytest.raises(SnapshotError, match="key_retention"):
        _engine(tiny_ckpt, sparse_decode_attention={"key_retention": 0.2}).restore(on)


def test_refused_for_lack_of_room_or_a_taken_id_changes_nothing(tiny_ckpt):
    snap = _snapshot(tiny_ckpt)
    small = _engine(tiny_ckpt, pages=8)
    with pytest.raises(SnapshotError, match="KV pages"):
        small.restore(snap)
    assert not small.requests and pages_at_rest(small)
    busy = _engine(tiny_ckpt)
    busy.add_request("r0", [1, 2, 3], _params(0))
    free = busy.kv.num_free_pages, busy.scheduler.token_slots.num_free
    with pytest.raises(SnapshotError, match="in use"):
        busy.restore(snap)
    assert (busy.kv.num_free_pages, busy.scheduler.token_slots.num_free) == free


def test_garbage_bytes_and_unknown_requests(tiny_ckpt):
    with pytest.raises(SnapshotError, match="not a request snapshot"):
        RequestSnapshot.from_bytes(b"not a snapshot")
    with pytest.raises(InvalidRequestError):
        _engine(tiny_ckpt).snapshot("nobody")


def test_snapshots_carry_every_per_slot_tensor():
    """A field added to the slot storage (the sparse-decode reference state) must be carried
    by snapshots, or a restored token would lose it."""
    from specloop.runtime.slot_storage import SlotStorage

    storage = SlotStorage(4, 8, torch.float32, torch.device("cpu"))
    per_slot = {name for name, value in vars(storage).items() if isinstance(value, torch.Tensor)}
    assert per_slot - {"incarnation"} == set(SlotStorage.CARRIED)
