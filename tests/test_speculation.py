"""Block self-speculation: identical greedy output, lossless sampling, lifetimes, metrics."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specloop.assets import default_model_path
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams
from specloop.errors import ConfigError
from specloop.pipeline.acceptance import greedy_verify, speculative_sample
from tests.engine_runs import pages_at_rest

PROMPTS = [
    "def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "# Copyright",
    "for i in range(10):", "    return self._", "def main():\n    parser = argparse.", "x = [",
]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(**options) -> EngineCore:
    options.setdefault("dtype", "float64")
    options.setdefault("device", "cpu")
    return EngineCore(EngineConfig.from_kwargs(str(default_model_path()), **options))


def _generate(engine: EngineCore, prompts: list[str], params: SamplingParams, stagger: bool = False) -> list[list[int]]:
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:  # staggered: one new request per step
            for i, prompt in (pending[:1] if stagger else pending):
                engine.add_request(f"r{i}", prompt, params)
            pending = pending[1:] if stagger else []
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def plain_greedy() -> list[list[int]]:
    return _generate(_engine(), PROMPTS, SamplingParams(max_tokens=24, **GREEDY))


@pytest.mark.parametrize("k, d", list(itertools.product([1, 2, 4, 8], [1, 2, 3])))
def test_block_greedy_equals_plain_greedy(plain_greedy, k, d):
    batch = 1 + (k * 3 + d) % 8  # batch sizes 1..8 across the grid
    engine = _engine(speculation="block", num_speculative_tokens=k, draft_loops=d, max_num_batched_tokens=32)
    got = _generate(engine, PROMPTS[:batch], SamplingParams(max_tokens=24, **GREEDY), stagger=True)
    assert got == plain_greedy[:batch]
    stats = engine.stats()
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # the trained model's drafts get accepted
    assert pages_at_rest(engine)


def test_block_on_random_checkpoint_with_rejections(tiny_ckpt):
    """Random weights reject most drafts: rollback carries correctness."""
    def run(**spec):
        engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float64", **spec))
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (3, 17, 40)]
        return _generate(engine, prompts, SamplingParams(max_tokens=20, **GREEDY)), engine

    plain, _ = run()
    spec, engine = run(speculation="block", num_speculative_tokens=4, draft_loops=2)
    assert spec == plain
    stats = engine.stats()
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections happened


def test_rollback_frees_exactly_the_rejected_pages(tiny_ckpt):
    engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float64", block_size=2,
                                                 speculation="block", num_speculative_tokens=8, draft_loops=1))
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=30, **GREEDY))
    req = engine.requests["r"]
    checked = 0
    while engine.has_unfinished():
        engine.step()
        rnd = req.round
        if req.request_id in engine.requests and rnd is not None and rnd.row == 0 and rnd.depth == 0 and not rnd.verifying:
            # just after a round was committed: tables cover exactly the accepted positions
            key = req.kv_key
            for plane in range(4):
                assert engine.kv.frontier(key, plane) == rnd.base
                assert len(engine.kv.page_table(key, plane)) == math.ceil(rnd.base / 2)
            checked += 1
    assert checked >= 2
    assert pages_at_rest(engine)


def test_stop_inside_an_accepted_block(plain_greedy):
    expected = plain_greedy[0]
    stop_token = expected[6]
    cut = expected.index(stop_token)
    engine = _engine(speculation="block", num_speculative_tokens=8, draft_loops=2)
    engine.add_request("s", PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_token,)))
    outs = engine.drain()
    assert [t for o in outs for t in o.token_ids] == expected[: cut + 1]
    assert outs[-1].finish_reason == "stop"
    # max_tokens inside a block: exactly max_tokens tokens
    engine.add_request("m", PROMPTS[0], SamplingParams(max_tokens=7, **GREEDY))
    outs = engine.drain()
    assert [t for o in outs for t in o.token_ids] == expected[:7] and outs[-1].finish_reason == "length"


def test_stop_string_inside_a_block(plain_greedy):
    engine = _engine(speculation="block", num_speculative_tokens=8)
    full = engine.tokenizer.decode(plain_greedy[0])
    stop = full[10:14]
    engine.add_request("s", PROMPTS[0], SamplingParams(max_tokens=24, stop=stop, **GREEDY))
    outs = engine.drain()
    assert "".join(o.text for o in outs) == full[: full.find(stop)]
    assert outs[-1].finish_reason == "stop"


def test_abort_mid_round_and_id_reuse(plain_greedy):
    engine = _engine(speculation="block", num_speculative_tokens=4, max_inflight_tickets=2)
    engine.add_request("x", PROMPTS[1], SamplingParams(max_tokens=200, **GREEDY))
    for _ in range(12):
        engine.step()
    assert engine.requests["x"].round is not None and engine._inflight
    engine.abort("x")
    engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=24, **GREEDY))
    tokens = [t for o in engine.drain() if o.request_id == "x" for t in o.token_ids]
    assert tokens == plain_greedy[0]
    assert pages_at_rest(engine)
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size


def test_token_slot_exhaustion_queues_rounds(plain_greedy):
    engine = _engine(speculation="block", num_speculative_tokens=4)
    engine.scheduler.token_slots = type(engine.scheduler.token_slots)(7)
    got = _generate(engine, PROMPTS[:3], SamplingParams(max_tokens=24, **GREEDY))
    assert got == plain_greedy[:3]


def test_seeded_speculative_sampling_is_reproducible():
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True)
    a = _generate(_engine(speculation="block"), PROMPTS[:1], params)
    b = _generate(_engine(speculation="block"), PROMPTS[:3], params)  # other requests around it
    assert a[0] == b[0]


def test_metrics_in_usage_and_stats():
    engine = _engine(speculation="block", num_speculative_tokens=4)
    engine.add_request("u", PROMPTS[2], SamplingParams(max_tokens=20, **GREEDY))
    usage = engine.drain()[-1].usage
    stats = engine.stats()
    assert usage.num_drafts == stats.num_drafts > 0
    assert usage.num_accepted_tokens == stats.num_accepted_tokens <= usage.num_draft_tokens
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1]
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    m = engine.metrics
    assert m.mean_acceptance_length == pytest.approx((stats.num_accepted_tokens + stats.num_drafts) / stats.num_drafts)


def test_invalid_speculation_options():
    with pytest.raises(ConfigError, match="draft_loops"):
        _engine(speculation="block", draft_loops=4)
    with pytest.raises(ConfigError, match="speculation"):
        EngineConfig(model="x", speculation="medusa")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig(model="x", num_speculative_tokens=0)


# ---- acceptance rules on their own ---------------------------------------------------

def test_greedy_verify_counts_the_matching_prefix():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 3, 1, 4]):
        logits[row, best] = 5.0
    count, tokens = greedy_verify(logits, torch.tensor([2, 3, 0]))
    assert int(count) == 3 and tokens[:3].tolist() == [2, 3, 1]
    count, tokens = greedy_verify(logits, torch.tensor([2, 3, 1]))
    assert int(count) == 4 and tokens.tolist() == [2, 3, 1, 4]  # bonus
    count, tokens = greedy_verify(logits, torch.tensor([0, 3, 1]))
    assert int(count) == 1 and tokens[0] == 2


def test_speculative_sampling_reproduces_the_target_distribution():
    """A Markov toy: target p and draft q depend on the previous token. Run rounds of k=3
    from a fixed start and compare the joint law of the first two emitted tokens with
    the target's exact one. Bound: chi-square below its 1e-4 upper quantile."""
    vocab, k, trials = 4, 3, 12000
    gen = torch.Generator().manual_seed(0)
    p_table = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 1.5, dim=-1)
    q_table = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 1.5, dim=-1)
    start = 1
    counts = torch.zeros(vocab, vocab)
    rng = torch.Generator().manual_seed(1)
    for _ in range(trials):
        emitted: list[int] = []
        prev = start
        while len(emitted) < 2:
            cands, q_rows, p_rows, last = [], [], [], prev
            for _ in range(k):
                q_row = q_table[last]
                c = int(torch.multinomial(q_row, 1, generator=rng))
                cands.append(c)
                q_rows.append(q_row)
                p_rows.append(p_table[last])
                last = c
            p_rows.append(p_table[last])
            count, tokens = speculative_sample(torch.stack(p_rows), torch.stack(q_rows), torch.tensor(cands), rng)
            new = tokens[: int(count)].tolist()
            emitted.extend(new)
            prev = new[-1]
        counts[emitted[0], emitted[1]] += 1
    expected = trials * p_table[start][:, None] * p_table  # P(a) P(b | a)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 15 degrees of freedom: the 1e-4 upper quantile of chi-square is about 46.
    assert chi2 < 46.0, f"chi-square {chi2:.1f}"


# ---- token pipelines ---------------------------------------------------------------

@pytest.mark.parametrize("d, batch", [(1, 1), (1, 5), (2, 3), (2, 8), (3, 2)])
def test_pipeline_greedy_equals_plain_greedy(plain_greedy, d, batch):
    engine = _engine(speculation="pipeline", draft_loops=d, max_num_batched_tokens=32)
    got = _generate(engine, PROMPTS[:batch], SamplingParams(max_tokens=24, **GREEDY), stagger=True)
    assert got == plain_greedy[:batch]
    stats = engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # acceptances and rejections
    assert pages_at_rest(engine)
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size


def test_pipeline_needs_fewer_loop_passes(plain_greedy):
    """A pipeline step reads the layer stack once for several live tokens: fewer forward
    calls than plain decoding a loop per call (each call one weight read)."""
    plain = _engine()
    plain.scheduler.multi_loop = False
    _generate(plain, PROMPTS[:1], SamplingParams(max_tokens=24, **GREEDY))
    piped = _engine(speculation="pipeline", draft_loops=1)
    _generate(piped, PROMPTS[:1], SamplingParams(max_tokens=24, **GREEDY))
    assert piped.executor.num_submitted < plain.executor.num_submitted


def test_pipeline_on_random_checkpoint(tiny_ckpt):
    def run(**spec):
        engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float64", **spec))
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (2, 19)]
        return _generate(engine, prompts, SamplingParams(max_tokens=16, **GREEDY))

    assert run(speculation="pipeline", draft_loops=1) == run()


def test_pipeline_stops_abort_and_reuse(plain_greedy):
    expected = plain_greedy[0]
    stop_token = expected[5]
    engine = _engine(speculation="pipeline", draft_loops=1)
    engine.add_request("s", PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop_token,)))
    outs = engine.drain()
    assert [t for o in outs for t in o.token_ids] == expected[: expected.index(stop_token) + 1]
    engine.add_request("x", PROMPTS[1], SamplingParams(max_tokens=200, **GREEDY))
    for _ in range(15):
        engine.step()
    engine.abort("x")
    engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=24, **GREEDY))
    assert [t for o in engine.drain() if o.request_id == "x" for t in o.token_ids] == expected
    assert pages_at_rest(engine)
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size


def test_pipeline_seeded_sampling_reproducible():
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    a = _generate(_engine(speculation="pipeline", draft_loops=1), PROMPTS[:1], params)
    b = _generate(_engine(speculation="pipeline", draft_loops=1), PROMPTS[:4], params)
    assert a[0] == b[0]


def test_verify_single_reproduces_the_target_distribution():
    """One-candidate speculative sampling: P(emitted = x) = p(x) for any draft q."""
    from specloop.pipeline.acceptance import verify_single

    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(6, generator=gen) * 1.5, dim=0)
    q = torch.softmax(torch.randn(6, generator=gen) * 1.5, dim=0)
    trials = 20000
    counts = torch.zeros(6)
    for _ in range(trials):
        c = torch.multinomial(q, 1, generator=gen)[0]
        _, token = verify_single(torch.zeros(6), c, p, q, gen)
        counts[int(token)] += 1
    expected = trials * p
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 29.6, f"chi-square {chi2:.1f}"  # 5 degrees of freedom, 1e-5 upper quantile


@pytest.mark.parametrize("inflight", [2, 4])
@pytest.mark.parametrize("spec", [{"speculation": "pipeline", "draft_loops": 1},
                                  {"speculation": "block", "num_speculative_tokens": 4, "draft_loops": 2}])
def test_speculation_keeps_a_ticket_in_flight(plain_greedy, spec, inflight):
    """The next call is planned before the previous verification is read back (rounds
    guess that every candidate passes); rejections are rolled back. Deeper ticket queues
    stay correct too."""
    engine = _engine(max_inflight_tickets=inflight, **spec)
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=24, **GREEDY))
    tokens, in_flight = [], []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.token_ids]
        in_flight.append(len(engine._inflight))
    assert tokens == plain_greedy[0]
    stats = engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # acceptances and rollbacks both happened
    assert sum(n >= 1 for n in in_flight) >= 0.8 * len(in_flight)
    assert pages_at_rest(engine)
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size


def test_row_budget_must_fit_a_verification(plain_greedy):
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        _engine(speculation="block", num_speculative_tokens=8, max_num_batched_tokens=4)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        _engine(speculation="pipeline", max_num_batched_tokens=2)
    # the smallest budget that fits runs to the end without stalling
    engine = _engine(speculation="block", num_speculative_tokens=8, max_num_batched_tokens=9, max_num_seqs=2)
    assert _generate(engine, PROMPTS[:2], SamplingParams(max_tokens=24, **GREEDY)) == plain_greedy[:2]


@pytest.mark.parametrize("spec", [{"speculation": "block"}, {"speculation": "pipeline", "draft_loops": 1}])
def test_seeded_speculative_sampling_ignores_discarded_calls(spec):
    """Deeper ticket queues discard more speculative calls; the seeded text is unchanged."""
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=21, ignore_eos=True)
    shallow = _generate(_engine(max_inflight_tickets=1, **spec), PROMPTS[:1], params)
    deep = _generate(_engine(max_inflight_tickets=4, **spec), PROMPTS[:1], params)
    assert shallow == deep
