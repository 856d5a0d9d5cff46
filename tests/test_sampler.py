"""Sampler: greedy, filters, the sampled distribution, per-row seeding, logprobs, no host sync."""

from __future__ import annotations

import math

import pytest
import torch

from specloop.runtime.sampler import SamplingBatch, make_generator, sample
from specloop.sampling_params import SamplingParams


def _batch(params: list[SamplingParams], engine_seed: int = 0) -> SamplingBatch:
    gens = [make_generator(p.seed, engine_seed, i, "cpu") for i, p in enumerate(params)]
    return SamplingBatch.build(params, gens, "cpu")


def _reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """The target distribution in float64, written from the definitions."""
    scaled = [x / p.temperature for x in logits]
    top = max(scaled)
    probs = [math.exp(x - top) for x in scaled]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = set(order[:p.top_k] if p.top_k > 0 else order)
    total = sum(probs[i] for i in keep)
    mass, kept_p = 0.0, set()
    for i in order:
        if i in keep and (p.top_p >= 1 or mass < p.top_p):
            kept_p.add(i)
            mass += probs[i] / total
    keep = kept_p
    best = max(probs[i] for i in keep)
    keep = {i for i in keep if probs[i] >= p.min_p * best}
    total = sum(probs[i] for i in keep)
    return [probs[i] / total if i in keep else 0.0 for i in range(len(probs))]


def _draw(params: SamplingParams, logits_row: torch.Tensor, rows: int, steps: int, seed: int) -> torch.Tensor:
    """rows * steps draws of one distribution, each row with its own (unseeded) generator."""
    batch = _batch([params] * rows, engine_seed=seed)
    logits = logits_row.expand(rows, -1).contiguous()
    return torch.cat([sample(logits, batch).token_ids for _ in range(steps)])


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    logits[0, [3, 9, 30]] = 100.0  # a three-way tie
    out = sample(logits, _batch([SamplingParams(temperature=0)] * 6))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids[0] == 3
    assert out.logprobs is None


def test_greedy_rows_in_a_sampled_batch_stay_argmax_and_draw_no_noise():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=2.0, top_k=5, top_p=0.5, min_p=0.1)] * 3
    gens = [make_generator(7, 0, i, "cpu") for i in range(len(params))]
    before = [g.get_state() for g in gens]
    batch = SamplingBatch.build(params, gens, "cpu")
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    ids = sample(logits, batch).token_ids
    assert torch.equal(ids[::2], logits[::2].argmax(dim=-1))
    for i, (gen, state) in enumerate(zip(gens, before)):
        advanced = not torch.equal(gen.get_state(), state)
        assert advanced == (i % 2 == 1), i


@pytest.mark.parametrize("only_top", [dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6)], ids=str)
@pytest.mark.parametrize("temperature", [0.01, 0.5, 1.0, 10.0, 1000.0])
def test_keeping_only_the_top_token_is_greedy_at_any_temperature(temperature, only_top):
    params = SamplingParams(temperature=temperature, **only_top)
    batch = _batch([params] * 64)
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        logits = torch.randn(64, 100, generator=gen)
        assert torch.equal(sample(logits, batch).token_ids, logits.argmax(dim=-1))


def test_filters_never_emit_an_excluded_token():
    """Rows with different top-k / top-p / min-p in one batch; each draw is checked against
    the allowed set computed by hand for its row."""
    gen = torch.Generator().manual_seed(3)
    choices = [
        SamplingParams(top_k=4), SamplingParams(temperature=3.0, top_k=10), SamplingParams(top_p=0.6),
        SamplingParams(temperature=0.5, top_p=0.9), SamplingParams(min_p=0.2),
        SamplingParams(temperature=2.0, min_p=0.05), SamplingParams(temperature=1.5, top_k=12, top_p=0.8, min_p=0.1),
        SamplingParams(temperature=0.8),
    ]
    rows = 256
    params = [choices[i % len(choices)] for i in range(rows)]
    logits = 2.0 * torch.randn(rows, 64, generator=gen)
    allowed = [{i for i, p in enumerate(_reference_probs(row.tolist(), prm)) if p > 0}
               for row, prm in zip(logits.double(), params)]
    batch = _batch(params)
    emitted: list[set[int]] = [set() for _ in range(rows)]
    for _ in range(100):
        for r, tok in enumerate(sample(logits, batch).token_ids.tolist()):
            emitted[r].add(tok)
    for r in range(rows):
        assert emitted[r] <= allowed[r], (r, params[r], emitted[r] - allowed[r])
    filtered = [r for r in range(rows) if params[r] is not choices[-1]]
    assert all(len(allowed[r]) < 64 for r in filtered), "every filtered row must exclude something"
    assert sum(len(emitted[r]) > 1 for r in range(rows)) > rows // 2, "the test must draw varied tokens"


def _chi_square_bound(df: int, z: float = 3.72) -> float:
    """Upper 1e-4 quantile (z = 3.72) of chi-square(df), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


SMALL_VOCAB_LOGITS = [0.5, 2.0, -1.0, 1.5, 0.0, -3.0, 1.0, -0.5]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.5),
    SamplingParams(temperature=2.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.7, min_p=0.15),
    SamplingParams(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05),
], ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_empirical_distribution_matches_the_target(params):
    """20,000 draws over 8 tokens (fixed seed). Bounds: chi-square below its 1e-4 upper
    quantile and total variation below 0.02 (its typical size here is ~0.007)."""
    expected = _reference_probs(SMALL_VOCAB_LOGITS, params)
    draws = _draw(params, torch.tensor(SMALL_VOCAB_LOGITS), rows=2000, steps=10, seed=11)
    n = draws.numel()
    counts = torch.bincount(draws, minlength=len(expected)).tolist()
    support = [i for i, p in enumerate(expected) if p > 0]
    assert all(counts[i] == 0 for i in range(len(expected)) if expected[i] == 0)
    chi2 = sum((counts[i] - n * expected[i]) ** 2 / (n * expected[i]) for i in support)
    tv = 0.5 * sum(abs(counts[i] / n - expected[i]) for i in range(len(expected)))
    assert chi2 < _chi_square_bound(len(support) - 1), (chi2, counts)
    assert tv < 0.02, (tv, counts)


def test_seeded_row_gives_the_same_tokens_alone_and_in_a_mixed_batch():
    target = SamplingParams(temperature=1.5, top_p=0.95, seed=1234)
    others = [SamplingParams(temperature=0), SamplingParams(seed=99, top_k=5),
              SamplingParams(temperature=0.7, min_p=0.1), SamplingParams(temperature=2.0, top_p=0.5, top_k=20)]
    batch_params = others[:2] + [target] + others[2:]
    vocab, steps = 32, 50
    gen = torch.Generator().manual_seed(5)
    step_logits = [torch.randn(5, vocab, generator=gen) for _ in range(steps)]

    alone = SamplingBatch.build([target], [make_generator(target.seed, 0, 0, "cpu")], "cpu")
    mixed = SamplingBatch.build(
        batch_params, [make_generator(p.seed, 123, i, "cpu") for i, p in enumerate(batch_params)], "cpu")
    tokens_alone = [sample(lg[2:3], alone).token_ids.item() for lg in step_logits]
    tokens_mixed = [sample(lg, mixed).token_ids[2].item() for lg in step_logits]
    assert tokens_alone == tokens_mixed
    argmax = [lg[2].argmax().item() for lg in step_logits]
    assert tokens_alone != argmax, "the target row must actually sample"

    other_seed = SamplingBatch.build([target], [make_generator(4321, 0, 0, "cpu")], "cpu")
    assert [sample(lg[2:3], other_seed).token_ids.item() for lg in step_logits] != tokens_alone


def test_make_generator_seeds():
    def stream(gen: torch.Generator) -> torch.Tensor:
        return torch.rand(8, generator=gen)

    assert torch.equal(stream(make_generator(5, 0, 0, "cpu")), stream(make_generator(5, 9, 3, "cpu")))
    assert torch.equal(stream(make_generator(None, 7, 3, "cpu")), stream(make_generator(None, 7, 3, "cpu")))
    assert not torch.equal(stream(make_generator(None, 7, 3, "cpu")), stream(make_generator(None, 7, 4, "cpu")))
    assert not torch.equal(stream(make_generator(None, 7, 3, "cpu")), stream(make_generator(None, 8, 3, "cpu")))
    for seed in (-1, 2**64 + 5, 2**64 - 1):  # any integer maps into the generator's 64-bit seed
        make_generator(seed, 0, 0, "cpu")


def test_logprobs_are_log_softmax_of_the_raw_logits_at_the_chosen_token():
    params = [SamplingParams(temperature=0, logprobs=True), SamplingParams(temperature=0.3, top_k=3),
              SamplingParams(temperature=2.0, top_p=0.7, min_p=0.1, logprobs=True), SamplingParams(seed=3)]
    logits = 3.0 * torch.randn(4, 50, generator=torch.Generator().manual_seed(6))
    out = sample(logits, _batch(params))
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(4), out.token_ids]
    torch.testing.assert_close(out.logprobs, expected, rtol=0, atol=1e-6)


def test_no_logprobs_unless_asked():
    assert sample(torch.randn(2, 10), _batch([SamplingParams(), SamplingParams(temperature=0)])).logprobs is None


def test_build_needs_one_generator_per_row():
    with pytest.raises(ValueError):
        SamplingBatch.build([SamplingParams()] * 2, [make_generator(0, 0, 0, "cpu")], "cpu")


def test_batch_flags_skip_unused_work():
    batch = _batch([SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.5, logprobs=True),
                    SamplingParams(temperature=0.9)])
    assert not (batch.all_greedy or batch.any_top_k or batch.any_top_p or batch.any_min_p)
    assert batch.any_greedy and batch.want_logprobs
    assert batch.top_k.dtype == torch.long and batch.temperature.dtype == torch.float32
    assert _batch([SamplingParams(temperature=0)] * 3).all_greedy


def _forbid_host_sync(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("sample() read a device value on the host")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_sample_does_no_host_sync(monkeypatch):
    params = [SamplingParams(temperature=0, logprobs=True), SamplingParams(top_k=5, seed=1),
              SamplingParams(top_p=0.8), SamplingParams(min_p=0.2, temperature=0.5),
              SamplingParams(top_k=8, top_p=0.9, min_p=0.05, temperature=1.7)]
    batch = _batch(params)
    all_greedy = _batch([SamplingParams(temperature=0)] * 2)
    logits = torch.randn(5, 30)
    _forbid_host_sync(monkeypatch)
    with pytest.raises(AssertionError):
        bool(logits[0, 0] > 0)  # the guard is live
    out = sample(logits, batch)
    sample(logits[:2], all_greedy)
    monkeypatch.undo()
    assert out.token_ids.shape == (5,) and out.logprobs is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sample_does_no_cuda_sync():
    params = [SamplingParams(temperature=0, logprobs=True), SamplingParams(top_k=5, seed=1),
              SamplingParams(top_p=0.8, min_p=0.2)]
    gens = [make_generator(p.seed, 0, i, "cuda") for i, p in enumerate(params)]
    batch = SamplingBatch.build(params, gens, "cuda")
    logits = torch.randn(3, 1000, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
