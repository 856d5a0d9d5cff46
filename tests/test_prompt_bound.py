"""The character bound that refuses a prompt too long to fit before it is tokenized.

Soundness: for a tokenizer without a normalizer, no token covers more than
`longest_token_bytes` bytes of the text, so no text whose tokens would fit is refused.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specloop.checkpoint import load_tokenizer
from specloop.checkpoint.tokenizer import longest_token_bytes
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.errors import InvalidRequestError
from specloop.llm import default_model

TEXTS = st.text(st.characters(codec="utf-8"), max_size=300) | st.sampled_from(
    ["<|im_end|>" * 20, " " * 200, "\n\n\t" * 50, "é" * 100, "𝄞" * 80, "def f(x):\n    return x\n" * 10])


@pytest.fixture(scope="module", params=["tiny", "shipped"])
def tokenizer(request, tiny_ckpt):
    return load_tokenizer(tiny_ckpt if request.param == "tiny" else default_model())


@settings(max_examples=200, deadline=None)
@given(text=TEXTS)
def test_no_token_covers_more_than_the_longest(tokenizer, text):
    longest = longest_token_bytes(tokenizer)
    assert longest is not None  # both are byte-level BPEs without a normalizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) * longest >= len(text.encode("utf-8"))


def test_engine_refuses_before_tokenizing(tiny_ckpt, monkeypatch):
    engine = EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", max_model_len=64))
    bound = engine.max_prompt_chars
    assert bound is not None and bound >= 64
    calls = []
    real = type(engine.tokenizer).encode
    monkeypatch.setattr(type(engine.tokenizer), "encode",
                        lambda self, text, *a, **k: calls.append(len(text)) or real(self, text, *a, **k))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("long", "x" * (bound + 1), engine_params())
    assert info.value.param == "prompt" and calls == []
    with pytest.raises(InvalidRequestError, match="context length"):  # under the bound: tokenized, then refused
        engine.add_request("long", "x" * bound, engine_params())
    assert calls == [bound]


def engine_params():
    from specloop.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1)
