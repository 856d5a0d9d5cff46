"""The serving core against the dense reference, and its lifetimes under abort and reuse."""

from __future__ import annotations

import pytest
import torch

from specloop.checkpoint import load_model
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore, QueueFullError
from specloop.sampling_params import SamplingParams
from specloop.errors import InvalidRequestError
from specloop.model.reference import reference_greedy
from tests.conftest import weights_of
from tests.engine_runs import pages_at_rest

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(ckpt, **options) -> EngineCore:
    options.setdefault("dtype", "float64")
    options.setdefault("device", "cpu")
    return EngineCore(EngineConfig.from_kwargs(str(ckpt), **options))


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def _run(engine: EngineCore, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]) -> dict[str, list[int]]:
    """Add requests at the given step numbers; step until done; collect token ids."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
            tokens[rid] = []
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
        step += 1
    assert set(finish) == set(tokens)
    return tokens


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    model, _ = load_model(tiny_ckpt, dtype=torch.float64)
    weights = weights_of(model)
    cache: dict = {}

    def greedy(prompt: list[int], n: int, threshold: float = 1.0) -> list[int]:
        key = (tuple(prompt), n, threshold)
        if key not in cache:
            cache[key] = reference_greedy(weights, model.config, prompt, n, threshold)
        return cache[key]

    return greedy


@pytest.mark.parametrize("rows", [8, 64, 4096])
@pytest.mark.parametrize("threshold", [1.0, 0.7])
def test_many_requests_equal_reference_greedy(tiny_ckpt, reference, rows, threshold):
    engine = _engine(tiny_ckpt, max_num_batched_tokens=rows, exit_threshold=threshold, max_num_seqs=5)
    lengths = [1, 5, 17, 40, 3, 23, 9, 31]
    prompts = _prompts(engine.model.config.vocab_size, lengths, seed=1)
    new_tokens = [6, 9, 4, 7, 12, 5, 8, 6]
    arrivals: dict[int, list] = {}
    for i, (p, n) in enumerate(zip(prompts, new_tokens)):
        arrivals.setdefault([0, 0, 1, 3, 7, 7, 12, 20][i], []).append((f"r{i}", p, SamplingParams(max_tokens=n, **GREEDY)))
    got = _run(engine, arrivals)
    for i, (p, n) in enumerate(zip(prompts, new_tokens)):
        assert got[f"r{i}"] == reference(p, n, threshold), f"request r{i}"
    assert pages_at_rest(engine)


def test_single_inflight_ticket_gives_same_tokens(tiny_ckpt, reference):
    engine = _engine(tiny_ckpt, max_inflight_tickets=1, max_num_batched_tokens=16)
    prompts = _prompts(engine.model.config.vocab_size, [12, 30], seed=2)
    got = _run(engine, {0: [(f"r{i}", p, SamplingParams(max_tokens=8, **GREEDY)) for i, p in enumerate(prompts)]})
    assert [got["r0"], got["r1"]] == [reference(p, 8) for p in prompts]


def test_seeded_sampling_is_reproducible_across_batches(tiny_ckpt):
    vocab = 384
    [target, *others] = _prompts(vocab, [10, 7, 19, 4], seed=3)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = _run(_engine(tiny_ckpt), {0: [("t", target, params)]})["t"]
    crowd = {0: [("a", others[0], SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True))],
             1: [("t", target, params), ("b", others[1], SamplingParams(max_tokens=5, **GREEDY))],
             2: [("c", others[2], SamplingParams(max_tokens=9, temperature=0.5, seed=7, ignore_eos=True))]}
    together = _run(_engine(tiny_ckpt, max_num_batched_tokens=8), crowd)["t"]
    assert alone == together
    other_seed = _run(_engine(tiny_ckpt), {0: [("t", target, SamplingParams(
        max_tokens=12, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True))]})["t"]
    assert other_seed != alone


def test_abort_mid_generation_frees_every_page(tiny_ckpt):
    engine = _engine(tiny_ckpt)
    prompts = _prompts(384, [20, 8], seed=4)
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=5, **GREEDY))
    seen = []
    for _ in range(12):
        seen += engine.step()
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort"
    seen += engine.drain()
    assert not [o for o in seen if o.request_id == "a" and o.finished and o.finish_reason != "abort"]
    assert engine.abort("a") is None  # after finish: nothing to do
    assert pages_at_rest(engine)
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size
    assert engine.scheduler.cells.num_free == engine.scheduler.cells.size


def test_reused_request_id_never_receives_old_tokens(tiny_ckpt, reference):
    engine = _engine(tiny_ckpt, max_inflight_tickets=2)
    old, new = _prompts(384, [15, 6], seed=5)
    engine.add_request("x", old, SamplingParams(max_tokens=30, **GREEDY))
    outputs = []
    for _ in range(9):  # mid-decode: a ticket holding samples of the old request is in flight
        outputs += engine.step()
    assert engine._inflight, "the race needs a ticket in flight"
    engine.abort("x")
    engine.add_request("x", new, SamplingParams(max_tokens=6, **GREEDY))
    after = engine.drain()
    tokens = [t for o in after if o.request_id == "x" for t in o.token_ids]
    assert tokens == reference(new, 6)
    assert pages_at_rest(engine)


def test_memory_pressure_requests_wait_for_pages(tiny_ckpt, reference):
    # Each request reserves 4 planes x ceil(40 / 16) = 12 pages; 26 pages admit two at a time.
    engine = _engine(tiny_ckpt, num_kv_pages=26, block_size=16)
    prompts = _prompts(384, [30, 25, 28, 10, 33, 20], seed=6)
    params = SamplingParams(max_tokens=10, **GREEDY)
    max_running = 0
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(6)}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
        max_running = max(max_running, len(engine.scheduler.running))
    assert max_running == 2
    assert [tokens[f"r{i}"] for i in range(6)] == [reference(p, 10) for p in prompts]


def test_slot_pool_exhaustion_queues_rows(tiny_ckpt, reference):
    engine = _engine(tiny_ckpt, max_num_batched_tokens=64)
    engine.scheduler.token_slots = type(engine.scheduler.token_slots)(5)  # far fewer than a chunk
    prompts = _prompts(384, [23, 11], seed=7)
    got = _run(engine, {0: [(f"r{i}", p, SamplingParams(max_tokens=4, **GREEDY)) for i, p in enumerate(prompts)]})
    assert [got["r0"], got["r1"]] == [reference(p, 4) for p in prompts]


def test_finish_reasons_and_stops(tiny_ckpt, reference):
    engine = _engine(tiny_ckpt)
    prompt = _prompts(384, [9], seed=8)[0]
    expected = reference(prompt, 10)
    stop_token = expected[4]
    first = expected.index(stop_token)
    outs = engine.add_request("s", prompt, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_token,)))
    outs = engine.drain()
    assert outs[-1].finish_reason == "stop" and [t for o in outs for t in o.token_ids] == expected[: first + 1]
    engine.add_request("l", prompt, SamplingParams(max_tokens=3, **GREEDY))
    outs = engine.drain()
    assert outs[-1].finish_reason == "length" and outs[-1].usage.completion_tokens == 3


def test_stop_string_ends_text_before_it(tiny_ckpt, reference):
    engine = _engine(tiny_ckpt)
    tok = engine.tokenizer
    for seed in range(40, 100):  # a random model: find a prompt whose greedy text is ASCII (40 is one)
        prompt = _prompts(384, [6], seed=seed)[0]
        expected = reference(prompt, 12)
        full = tok.decode(expected, skip_special_tokens=True)
        if len(full) >= 6 and full.isascii() and full.isprintable() and full.find(full[3:5]) == 3:
            break
    else:
        pytest.fail("no prompt with an ASCII continuation")
    stop = full[3:5]
    engine.add_request("s", prompt, SamplingParams(max_tokens=12, stop=stop, **GREEDY))
    outs = engine.drain()
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == full[:3]


def test_eos_stops_unless_ignored(tiny_ckpt):
    engine = _engine(tiny_ckpt)
    engine.stop_ids = frozenset(range(384))  # every token is a stop token
    engine.add_request("e", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0))
    outs = engine.drain()
    assert outs[-1].finish_reason == "stop" and outs[-1].usage.completion_tokens == 1
    engine.add_request("i", [5, 6, 7], SamplingParams(max_tokens=5, **GREEDY))
    assert engine.drain()[-1].usage.completion_tokens == 5


def test_logprobs_of_chosen_tokens(tiny_ckpt):
    engine = _engine(tiny_ckpt)
    engine.add_request("g", [5, 6, 7, 8], SamplingParams(max_tokens=4, logprobs=True, **GREEDY))
    outs = engine.drain()
    logprobs = [lp for o in outs for lp in o.logprobs]
    assert len(logprobs) == 4 and all(lp <= 0 for lp in logprobs)


@pytest.mark.parametrize("make, param", [
    (lambda e: e.add_request("b", [], SamplingParams()), "prompt"),
    (lambda e: e.add_request("b", "", SamplingParams()), "prompt"),
    (lambda e: e.add_request("b", [1] * 3000, SamplingParams()), "prompt"),
    (lambda e: e.add_request("b", [1, 2], SamplingParams(max_tokens=2047)), "prompt"),
    (lambda e: e.add_request("b", [400], SamplingParams()), "prompt"),
    (lambda e: e.add_request("b", [1, 2], SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda e: e.add_request("b", [1, 2], SamplingParams(temperature=-1.0)), "temperature"),
    (lambda e: e.add_request("b", [1, 2], SamplingParams(top_p=0.0)), "top_p"),
    (lambda e: e.add_request("b", [1, 2], SamplingParams(top_p=1.5)), "top_p"),
    (lambda e: e.add_request("b", [1, 2], SamplingParams(stop=5)), "stop"),
])
def test_bad_inputs_raise_and_engine_keeps_serving(tiny_ckpt, reference, make, param):
    engine = _engine(tiny_ckpt)
    with pytest.raises(InvalidRequestError) as info:
        make(engine)
    assert info.value.param == param and "\n" not in str(info.value)
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=3, **GREEDY))
    assert [t for o in engine.drain() for t in o.token_ids] == reference([5, 6, 7], 3)


def test_request_that_can_never_fit_is_rejected(tiny_ckpt):
    engine = _engine(tiny_ckpt, num_kv_pages=8)
    with pytest.raises(InvalidRequestError, match="KV pages"):
        engine.add_request("big", list(range(3, 40)), SamplingParams(max_tokens=10))


def test_waiting_queue_is_bounded(tiny_ckpt):
    engine = _engine(tiny_ckpt, max_waiting_requests=2)
    engine.add_request("a", [5], SamplingParams())
    engine.add_request("b", [5], SamplingParams())
    with pytest.raises(QueueFullError):
        engine.add_request("c", [5], SamplingParams())
    engine.drain()
    engine.add_request("c", [5], SamplingParams())


def test_duplicate_live_request_id_rejected(tiny_ckpt):
    engine = _engine(tiny_ckpt)
    engine.add_request("a", [5], SamplingParams())
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("a", [6], SamplingParams())


def test_unknown_engine_option(tiny_ckpt):
    from specloop.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown engine option 'max_num_seq'"):
        EngineConfig.from_kwargs(str(tiny_ckpt), max_num_seq=3)


def test_queue_time_and_tokens_per_step(tiny_ckpt):
    """The final output carries how long the request waited before its first admission (one
    cell: the second waits for the first to finish, the third is aborted while it waits), and
    the stats count the tokens each plan took into the loops (vLLM's iteration tokens)."""
    engine = _engine(tiny_ckpt, max_num_seqs=1)
    params = SamplingParams(max_tokens=3, **GREEDY)
    for rid, prompt in (("a", [5, 6, 7]), ("b", [8, 9]), ("c", [4])):
        engine.add_request(rid, prompt, params)
    engine.step()
    aborted = engine.abort("c")
    assert aborted.finish_reason == "abort" and aborted.queue_time is None  # never admitted
    finals = {o.request_id: o for o in engine.drain() if o.finished}
    assert 0 <= finals["a"].queue_time < finals["b"].queue_time
    buckets, total = engine.stats().iteration_tokens, engine.stats().iteration_tokens_sum
    assert buckets[-1][0] == float("inf") and [b for b, _ in buckets[:3]] == [1.0, 8.0, 16.0]
    assert [n for _, n in buckets] == sorted(n for _, n in buckets)  # cumulative
    assert total == 3 + 2 + 2 * 2  # the prompts, and every sampled token but each request's last
    assert buckets[-1][1] >= 3  # a plan per step at least until the prompts finished
