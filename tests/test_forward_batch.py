"""The forward batch: what every call uploads, and that its device metadata says what the plan says.

Across every mode (plain, adaptive exit, block rounds, token pipelines; greedy and sampled)
each forward call makes at most two host-to-device copies (the batch's integers and its
floats) and no `torch.tensor` / `torch.as_tensor` of Python data, and each row's KV slot,
computed on the device from page tables, equals the KV manager's host reference
(`KVManager.slot`) in its own plane and, with adaptive exit, in every deeper plane.
"""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.plan import Draft, Verify, VerifyCandidate
from specloop.runtime import forward_batch
from specloop.sampling_params import SamplingParams

MODES = [{}, {"exit_threshold": 0.6}, {"speculation": "block", "num_speculative_tokens": 3, "draft_loops": 1},
         {"speculation": "block", "num_speculative_tokens": 2, "draft_loops": 2},
         {"speculation": "pipeline", "draft_loops": 1}, {"speculation": "pipeline", "draft_loops": 2}]


@pytest.mark.parametrize("mode", MODES, ids=["plain", "exit", "block-d1", "block-d2", "pipe-d1", "pipe-d2"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_one_upload_per_kind_and_device_kv_slots(tiny_ckpt, monkeypatch, mode, temperature):
    engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float32", block_size=4,
                                                 kv_cache_bytes=4 << 20, max_num_batched_tokens=16, **mode))
    runner, kv = engine.executor.runner, engine.kv
    builder = runner.batches
    keys = {}  # request id -> kv key, for the host reference
    counts = {"tensor": 0, "calls": 0, "rows": 0, "max_uploads": 0, "multi": 0}
    real_tensor, real_as_tensor = torch.tensor, torch.as_tensor

    def counting(fn):
        def wrapper(data, *args, **kwargs):
            counts["tensor"] += not isinstance(data, torch.Tensor)  # as_tensor of a tensor copies nothing
            return fn(data, *args, **kwargs)
        return wrapper

    real_build = builder.build

    def checked_build(plan):
        batch = real_build(plan)
        ordered = sorted(plan.groups, key=lambda g: (-g.loops, g.num_rows > 1))
        assert len(batch.passes) == max(g.loops for g in plan.groups)
        for p, lp in enumerate(batch.passes):
            members = [g for g in ordered if g.loops > p]  # the pass's rows are a prefix
            assert lp.num_rows == sum(g.num_rows for g in members)
            for group, shape in zip(members, lp.groups, strict=True):
                key = keys[group.request_id]
                rows = slice(shape.first, shape.first + shape.rows)
                positions = list(range(group.start, group.end))
                assert lp.positions[rows].tolist() == positions
                assert lp.depths[rows].tolist() == [group.depth + p] * group.num_rows
                assert batch.cells[rows].tolist() == [group.cell] * group.num_rows
                assert batch.token_slots[rows].tolist() == group.token_slots
                assert lp.write_slots[rows].tolist() == [kv.slot(key, group.depth + p, q) for q in positions]
                if plan.adaptive_exit:
                    for plane in range(group.depth + 1, 4):
                        want = [kv.slot(key, plane, q) for q in positions]
                        assert lp.deeper_slots[rows, plane].tolist() == want
                    assert (lp.deeper_slots[rows, : group.depth + 1] == -1).all()
                counts["rows"] += group.num_rows
                counts["multi"] += p > 0
        for kind, segment in batch.heads.items():
            for i, group in enumerate(segment.groups):
                assert type(group.head) is kind
                assert segment.cell[i].item() == group.cell
                if kind in (Draft, VerifyCandidate):
                    assert segment.aux[i].item() == group.head.position
                if kind is Verify:
                    assert segment.aux[i].item() == group.head.num_candidates
                assert bool(segment.greedy[i]) == group.head.params.is_greedy
        return batch

    real_execute = runner.execute

    def execute(plan):
        before = builder.uploads
        monkeypatch.setattr(torch, "tensor", counting(real_tensor))
        monkeypatch.setattr(torch, "as_tensor", counting(real_as_tensor))
        try:
            out = real_execute(plan)
        finally:
            monkeypatch.setattr(torch, "tensor", real_tensor)
            monkeypatch.setattr(torch, "as_tensor", real_as_tensor)
        counts["max_uploads"] = max(counts["max_uploads"], builder.uploads - before)
        counts["calls"] += 1
        return out

    monkeypatch.setattr(builder, "build", checked_build)
    monkeypatch.setattr(runner, "execute", execute)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, ignore_eos=True)
    for i, prompt in enumerate([[5, 9, 13, 2, 40], [7] * 23, [3, 4], list(range(60, 80))]):
        engine.add_request(f"r{i}", prompt, params)
        keys[f"r{i}"] = engine.requests[f"r{i}"].kv_key
    outputs = engine.drain()
    assert sum(len(o.token_ids) for o in outputs) == 48
    assert counts["calls"] > 10 and counts["rows"] > 100
    if mode.get("speculation") != "pipeline":  # decode tokens, draft rows (d > 1) and verifications
        assert counts["multi"] > 0, "no multi-loop group was planned"
    assert counts["tensor"] == 0, "the forward path made tensors from Python data"
    assert 1 <= counts["max_uploads"] <= 2


def test_builder_refuses_a_plan_beyond_its_capacity(tiny_ckpt):
    builder = forward_batch.ForwardBatchBuilder(max_rows=2, max_seqs=1, num_loops=4, max_pages_per_seq=1,
                                                page_size=4, device=torch.device("cpu"))
    engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", kv_cache_bytes=1 << 20))
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=1))
    plan = engine.scheduler.schedule()
    with pytest.raises(ValueError, match="exceeds the forward batch"):
        builder.build(plan)


def test_attention_backend_option(tiny_ckpt, caplog):
    from specloop.engine.config import ATTENTION_BACKENDS
    from specloop.errors import ConfigError
    from specloop.runtime.attention import BACKENDS

    assert ATTENTION_BACKENDS == BACKENDS
    with pytest.raises(ConfigError, match="attention_backend must be one of auto, torch"):
        EngineConfig(model="x", attention_backend="flash")
    with caplog.at_level("INFO", logger="specloop.engine.core"):
        engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", kv_cache_bytes=1 << 20))
    assert engine.backend.name == "torch" and "attention backend torch" in caplog.text  # auto says what it chose
    explicit = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", kv_cache_bytes=1 << 20,
                                                   attention_backend="torch"))
    assert explicit.backend.name == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staging_is_not_overwritten_while_its_copy_is_pending(tiny_ckpt):
    """With the GPU far behind (a long sleep kernel queued first), building the next batches
    must not change what the pending copy of the first one uploads."""
    engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cuda", dtype="float32",
                                                 kv_cache_bytes=8 << 20))
    builder = engine.executor.runner.batches
    engine.add_request("a", list(range(5, 25)), SamplingParams(max_tokens=1))
    engine.add_request("b", list(range(30, 33)), SamplingParams(max_tokens=1))
    plans = [engine.scheduler.schedule() for _ in range(3)]  # depths 0, 1, 2 of both prompts
    for plan in plans:  # first use loads the kernels, which waits for the device
        builder.build(plan)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keeps the stream busy while the CPU builds ahead
    first = builder.build(plans[0])
    got = first.passes[0].depths.clone()  # ordered after the copy on the stream: what the copy uploaded
    for plan in plans[1:]:  # the same rows at depths 1 and 2: other values in the same places
        builder.build(plan)
    torch.cuda.synchronize()
    assert [g.depth for g in plans[1].groups] == [1, 1] and got.tolist() == [0] * 23
