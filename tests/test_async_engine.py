"""AsyncEngine and the synchronous LLM API on the tiny checkpoint."""

from __future__ import annotations

import asyncio

import pytest

from specloop.engine.async_engine import AsyncEngine, EngineDeadError
from specloop.sampling_params import SamplingParams
from specloop.errors import InvalidRequestError
from specloop.llm import LLM

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture()
async def engine(tiny_ckpt):
    eng = AsyncEngine.from_options(str(tiny_ckpt), device="cpu", dtype="float64")
    yield eng
    await eng.shutdown()


async def _collect(engine: AsyncEngine, prompt, params, rid=None):
    outs = [o async for o in engine.generate(prompt, params, request_id=rid)]
    return outs


async def test_concurrent_streams_match_solo_runs(engine, tiny_ckpt):
    prompts = [[5, 6, 7], list(range(10, 40)), [100] * 5, list(range(50, 61))]
    solo = LLM(str(tiny_ckpt), device="cpu", dtype="float64").generate(prompts, GREEDY)
    results = await asyncio.gather(*(_collect(engine, p, GREEDY) for p in prompts))
    for outs, expected in zip(results, solo):
        assert [t for o in outs for t in o.token_ids] == expected.token_ids
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert sum(len(o.token_ids) for o in outs[:-1]) == 7  # streamed one token at a time
        assert "".join(o.text for o in outs) == expected.text


async def test_leaving_the_stream_aborts_and_frees_pages(engine):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    count = 0
    async for _ in engine.generate(list(range(5, 25)), params, request_id="leaver"):
        count += 1
        if count == 3:
            break
    for _ in range(100):
        await asyncio.sleep(0.02)
        stats = engine.stats()
        if stats.running == 0 and stats.kv_bytes_used == 0:
            break
    assert engine.stats().running == 0 and engine.stats().kv_bytes_used == 0
    again = await _collect(engine, [5, 6], GREEDY, rid="leaver")  # the ID is free again
    assert again[-1].finished


async def test_abort_by_id(engine):
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def consume():
        return [o async for o in engine.generate([7, 8, 9], params, request_id="victim")]

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    await engine.abort("victim")
    outs = await asyncio.wait_for(task, 10)
    assert outs[-1].finish_reason == "abort"


async def test_invalid_request_raises_in_caller(engine):
    with pytest.raises(InvalidRequestError) as info:
        await _collect(engine, [], GREEDY)
    assert info.value.param == "prompt"
    assert (await _collect(engine, [5], GREEDY))[-1].finished  # still serving


async def test_shutdown_then_generate_fails(tiny_ckpt):
    eng = AsyncEngine.from_options(str(tiny_ckpt), device="cpu")
    await eng.shutdown()
    with pytest.raises(EngineDeadError):
        await _collect(eng, [5], GREEDY)


async def test_a_command_that_races_the_shutdown_is_answered(tiny_ckpt):
    """A command queued after the engine thread stopped taking commands (a caller that passed
    its liveness check just before `shutdown`) gets EngineDeadError instead of waiting forever."""
    eng = AsyncEngine.from_options(str(tiny_ckpt), device="cpu")
    await eng.shutdown()
    assert not eng._thread.is_alive()
    late = eng._submit(lambda: "ran")  # past the check a public call would make
    with pytest.raises(EngineDeadError):
        late.result(timeout=5)


def test_llm_outputs(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cpu")
    outs = llm.generate(["hello", "def f(x):"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert all(o.finish_reason == "length" and isinstance(o.text, str) for o in outs)
    assert outs[0].usage.prompt_tokens == len(llm.tokenizer.encode("hello", add_special_tokens=False))
    with pytest.raises(InvalidRequestError):
        llm.generate(["ok", ""], SamplingParams(max_tokens=2))
    assert llm.generate("again", SamplingParams(max_tokens=2))[0].finish_reason in ("length", "stop")


async def test_cancel_while_adding_does_not_orphan_the_request(engine):
    params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)  # would run for long
    for _ in range(5):
        stream = engine.generate([5, 6, 7], params)
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the add is submitted, not yet confirmed
        task.cancel()
        with pytest.raises((asyncio.CancelledError, StopAsyncIteration)):
            await task
        await stream.aclose()
    for _ in range(200):
        await asyncio.sleep(0.02)
        if engine.stats().running == 0 and engine.stats().waiting == 0 and engine.stats().kv_bytes_used == 0:
            break
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_bytes_used == 0
    assert engine.is_alive
    assert (await _collect(engine, [5], GREEDY))[-1].finished  # still serving
