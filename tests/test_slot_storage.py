"""Token slot storage: per-slot device state, and the engine
keeping each slot's depth, candidate and incarnation in step with its plans."""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams
from specloop.runtime.slot_storage import SlotStorage


def test_entering_a_slot_resets_its_state_and_keeps_the_others():
    store = SlotStorage(4, 6, torch.float32, torch.device("cpu"))
    everything = torch.arange(4)
    store.advance(everything, torch.tensor([2, 2, 2, 2]), torch.ones(4, 6))
    store.survival.fill_(0.25)
    store.exited.fill_(True)
    store.enter(torch.tensor([2]), torch.tensor([41]), torch.tensor([7]))
    assert store.depth.tolist() == [3, 3, 0, 3]
    assert store.candidate[2].item() == 41 and store.incarnation[2].item() == 7
    assert store.survival.tolist() == [0.25, 0.25, 1.0, 0.25] and store.exited.tolist() == [True, True, False, True]
    store.advance(torch.tensor([2]), torch.tensor([0]), torch.full((1, 6), 5.0))
    assert store.depth[2].item() == 1 and bool((store.hidden[2] == 5.0).all())


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
                assert store.depth[slot].item() == g.last_depth + 1
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
