"""SamplingParams: defaults, normalisation, and one clear error per bad field."""

from __future__ import annotations

import dataclasses

import pytest

from specloop.sampling_params import SamplingParams
from specloop.errors import InvalidRequestError, SpecloopError


def test_defaults_follow_the_openai_names():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, -1, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids) == (None, (), ())
    assert (p.ignore_eos, p.logprobs, p.skip_special_tokens) == (False, False, True)
    assert not p.is_greedy


def test_normalisation():
    p = SamplingParams(temperature=0, top_p=1, min_p=0, top_k=0, stop="###", stop_token_ids=[7, 0])
    assert p.is_greedy and p.temperature == 0.0 and isinstance(p.temperature, float)
    assert isinstance(p.top_p, float) and isinstance(p.min_p, float)
    assert p.top_k == -1  # 0 and -1 both disable top-k
    assert p.stop == ("###",)
    assert p.stop_token_ids == (7, 0)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=[]).stop == ()
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop="a"))  # usable as a key


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


def test_greedy_threshold():
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0), ("max_tokens", True), ("max_tokens", "8"),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", True), ("temperature", "1"), ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1), ("top_p", float("nan")), ("top_p", False),
    ("top_k", -2), ("top_k", 1.0), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("-inf")), ("min_p", True),
    ("seed", 1.5), ("seed", "7"), ("seed", True), ("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 2**70),
    ("max_tokens", 2**63), ("top_k", 2**63), ("top_k", 10**30), ("stop_token_ids", [2**63]),
    ("temperature", 1e39), ("top_p", 1e-300), ("top_p", 7e-46),
    ("stop", 3), ("stop", ""), ("stop", ["ok", ""]), ("stop", ["ok", 5]), ("stop", {"a"}), ("stop", [None]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", 5),
    ("stop_token_ids", "12"),
    ("ignore_eos", 1), ("logprobs", "yes"), ("skip_special_tokens", None),
])
def test_bad_value_names_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    err = info.value
    assert isinstance(err, SpecloopError)
    assert err.param == field
    message = str(err)
    assert "\n" not in message and message.startswith(field) and repr(value)[:20] in message


def test_long_bad_value_is_shortened_to_one_line():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop=["line\n" * 100, 3])
    assert "\n" not in str(info.value) and len(str(info.value)) < 200


@pytest.mark.parametrize("kwargs", [
    dict(top_k=1), dict(top_k=50), dict(top_p=1e-3), dict(min_p=1.0), dict(seed=0), dict(seed=2**63 - 1),
    dict(seed=-(2**63)), dict(seed=-4), dict(top_p=1.5e-45), dict(temperature=3.4e38), dict(top_k=2**63 - 1), dict(max_tokens=1), dict(stop_token_ids=(0, 5)), dict(ignore_eos=True, logprobs=True),
])
def test_accepts_edge_values(kwargs):
    SamplingParams(**kwargs)


def test_top_p_that_survives_fp32_keeps_the_top_token():
    """The bound on top_p is the fp32 the sampler uses: the smallest accepted value still
    samples (keeps the most likely token) instead of dropping every token."""
    import torch

    from specloop.runtime.sampler import SamplingBatch, draw_generator, sample

    params = SamplingParams(top_p=1.5e-45, temperature=1.0, seed=3)
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    batch = SamplingBatch.build([params], [draw_generator(3, 0, 0, 0, "t", "cpu")], "cpu")
    assert batch.top_p.item() > 0
    assert sample(logits, batch).token_ids.tolist() == [1]
