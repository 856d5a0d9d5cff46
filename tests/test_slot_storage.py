"""Token slot storage: per-slot device state, the reference-state room, and the engine
keeping each slot's depth, candidate and incarnation in step with its plans."""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams
from specloop.runtime.slot_storage import ReferenceShape, ReferenceState, SlotStorage

SHAPE = ReferenceShape(num_layers=3, num_heads=4, head_dim=8, budget=5)


@pytest.mark.parametrize("n, retention, want", [(1, 0.1, 1), (10, 0.1, 1), (11, 0.1, 2), (100, 0.1, 10),
                                                 (7, 1.0, 7), (3, 0.25, 1), (4096, 0.1, 410)])
def test_budget_for(n, retention, want):
    assert ReferenceShape.budget_for(n, retention) == want


@pytest.mark.parametrize("n, retention", [(0, 0.1), (5, 0.0), (5, 1.5)])
def test_budget_for_rejects_bad_input(n, retention):
    with pytest.raises(ValueError):
        ReferenceShape.budget_for(n, retention)


def test_bytes_per_slot_matches_the_allocation():
    ref = ReferenceState(2, SHAPE, torch.device("cpu"))
    per_slot = sum(t[0].nbytes for t in (ref.positions, ref.count, ref.mass, ref.o_ref, ref.c_ref))
    assert SHAPE.bytes_per_slot == per_slot


def test_reference_write_read_roundtrip_touches_only_its_slots_and_layer():
    gen = torch.Generator().manual_seed(0)
    ref = ReferenceState(6, SHAPE, torch.device("cpu"))
    slots = torch.tensor([4, 1])
    positions = torch.tensor([[[3, 0, 7], [1, -1, -1], [2, 5, -1], [9, 8, 6]],
                              [[0, -1, -1], [4, 2, 1], [1, 3, -1], [6, -1, -1]]])
    mass = torch.rand(2, 4, generator=gen)
    o_ref = torch.randn(2, 4, 8, generator=gen, dtype=torch.float64)
    c_ref = torch.randn(2, 4, 8, generator=gen, dtype=torch.float64)
    ref.write(slots, 1, positions, mass, o_ref, c_ref)
    pos, count, m, o, c = ref.read(slots, 1)
    assert torch.equal(pos[:, :, :3], positions.int()) and bool((pos[:, :, 3:] == -1).all())
    assert count.tolist() == [[3, 1, 2, 3], [1, 3, 2, 1]]
    assert torch.equal(m, mass) and torch.equal(o, o_ref.float()) and torch.equal(c, c_ref.float())
    # other slots and other layers of these slots are untouched
    others = torch.tensor([0, 2, 3, 5])
    assert bool((ref.count[others] == 0).all()) and bool((ref.positions[others] == -1).all())
    assert bool((ref.count[slots][:, [0, 2]] == 0).all()) and bool((ref.o_ref[slots][:, [0, 2]] == 0).all())
    with pytest.raises(ValueError):
        ref.write(slots, 0, torch.zeros(2, 4, SHAPE.budget + 1, dtype=torch.long), mass, o_ref, c_ref)


def test_entering_a_slot_resets_its_state_and_keeps_the_others():
    store = SlotStorage(4, 6, torch.float32, torch.device("cpu"), reference=SHAPE)
    ref = store.reference
    everything = torch.arange(4)
    ref.write(everything, 2, torch.ones(4, 4, 2, dtype=torch.long), torch.ones(4, 4), torch.ones(4, 4, 8),
              torch.ones(4, 4, 8))
    store.advance(everything, torch.tensor([2, 2, 2, 2]), torch.ones(4, 6))
    store.survival.fill_(0.25)
    store.exited.fill_(True)
    store.enter(torch.tensor([2]), torch.tensor([41]), torch.tensor([7]))
    assert store.depth.tolist() == [3, 3, 0, 3]
    assert store.candidate[2].item() == 41 and store.incarnation[2].item() == 7
    assert store.survival.tolist() == [0.25, 0.25, 1.0, 0.25] and store.exited.tolist() == [True, True, False, True]
    assert ref.count[:, 2, 0].tolist() == [2, 2, 0, 2]  # the entering token has no reference yet
    assert bool((ref.positions[2] == -1).all())
    store.advance(torch.tensor([2]), torch.tensor([0]), torch.full((1, 6), 5.0))
    assert store.depth[2].item() == 1 and bool((store.hidden[2] == 5.0).all())


def test_no_reference_room_unless_asked():
    assert SlotStorage(3, 4, torch.float32, torch.device("cpu")).reference is None


@pytest.mark.parametrize("spec", [{}, {"exit_threshold": 0.6},
                                  {"speculation": "block", "draft_loops": 1, "num_speculative_tokens": 2},
                                  {"speculation": "pipeline", "draft_loops": 1},
                                  {"speculation": "pipeline", "draft_loops": 2}])
def test_slot_state_follows_every_plan(tiny_ckpt, spec):
    """After every forward call, each row's slot holds the depth it reached and the
    incarnation of its request; entering rows record the token that entered; and a
    token (request, incarnation, position) keeps one slot from loop 1 to the end, so
    pipeline shifts and rollbacks never move or mix up live tokens' state."""
    engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float32",
                                                 kv_cache_bytes=8 << 20, max_num_batched_tokens=12, **spec))
    runner = engine.executor.runner
    execute = runner.execute
    owner: dict[tuple[str, int, int], int] = {}
    checked = {"rows": 0, "entered_from_device": 0}

    def checked_execute(plan):
        next_before = runner.next_token.clone()
        out = execute(plan)
        store = runner.slots
        for g in plan.groups:
            for pos, slot in zip(range(g.start, g.end), g.token_slots):
                key = (g.request_id, g.incarnation, pos)
                if g.depth == 0:
                    owner[key] = slot
                    want = g.token_ids[pos - g.start] if g.token_ids is not None else next_before[g.cell].item()
                    checked["entered_from_device"] += g.token_ids is None
                    assert store.candidate[slot].item() == want
                assert owner[key] == slot, f"{key} moved from slot {owner[key]} to {slot}"
                assert store.depth[slot].item() == g.depth + 1
                assert store.incarnation[slot].item() == g.incarnation
                checked["rows"] += 1
        return out

    runner.execute = checked_execute
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate([[5, 9, 13, 2, 40], [7] * 17, [3, 4], [60, 61, 62, 63, 64, 65]]):
        engine.add_request(f"r{i}", prompt, params)
    outputs = engine.drain()
    assert sum(len(o.token_ids) for o in outputs) == 40
    assert checked["rows"] > 0 and checked["entered_from_device"] > 0
    if spec.get("speculation"):  # random weights: drafts get rejected, so rollbacks were exercised
        stats = engine.stats()
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    if spec.get("speculation") == "pipeline":  # rejections restarted pipelines at new incarnations
        assert len({(rid, inc) for rid, inc, _ in owner}) > 4
