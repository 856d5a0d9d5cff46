"""INT4 cross-loop KV residuals in the engine against the FlashLoop reference.

The engine (fp32 on the CPU, the torch backend) prefills prompts long enough that groups
seal (a short tail, so prompt queries already read sealed groups within their own chunk),
then decodes; the reference (`flashloop_greedy` with the same `KVResidual`) recomputes
everything with fake quantization and serial visibility. Greedy tokens must be equal and
the first token's logprob close, however the prompt is chunked and batched, with
token-sparse prefill on and off and with adaptive exit.
"""

from __future__ import annotations

import pytest
import torch

from specloop.checkpoint import load_model
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.errors import ConfigError
from specloop.model.flashloop_reference import FlashLoopFeatures, KVResidual, SparsePrefill, flashloop_forward, \
    flashloop_greedy
from specloop.sampling_params import SamplingParams
from tests.conftest import weights_of

MAX_TOKENS = 6
TAIL = 5
_g = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(3, 200, (n,), generator=_g).tolist() for n in (150, 97, 211)]
SPARSE = (16, (1.0, 1.0, 0.5, 0.25))  # window, retention


def _engine(ckpt, sparse: bool = False, **kw) -> EngineCore:
    extra = {"token_sparse_prefill": {"window": SPARSE[0], "retention": list(SPARSE[1])}} if sparse else {}
    return EngineCore(EngineConfig.from_kwargs(
        str(ckpt), device="cpu", dtype=kw.pop("dtype", "float64"), num_kv_pages=kw.pop("num_kv_pages", 512), block_size=8,
        attention_backend="torch", kv_residual_quantization={"tail": TAIL}, **extra, **kw))


def _run(engine: EngineCore, prompts: dict[str, list[int]], stagger: bool = False) -> dict[str, tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    out: dict[str, tuple[list[int], list[float]]] = {}
    pending = list(prompts.items())
    if not stagger:
        for rid, prompt in pending:
            engine.add_request(rid, prompt, params)
        pending = []
    while pending or engine.has_unfinished():
        if pending:
            rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for o in engine.step():
            assert o.error is None, o.error
            tokens, logprobs = out.setdefault(o.request_id, ([], []))
            tokens.extend(o.token_ids)
            logprobs.extend(o.logprobs or [])
    assert engine.kv.num_free_pages == engine.kv.num_pages
    assert engine.kv.records.num_free == engine.kv.records.num_records
    return out


@pytest.fixture(scope="module")
def refs():
    return {}


def _reference(ckpt, cache, p: int, sparse: bool, exit_threshold: float | None = None):
    key = (str(ckpt), p, sparse, exit_threshold)
    if key not in cache:
        model, _ = load_model(ckpt, dtype=torch.float64)
        feats = FlashLoopFeatures(kv_residual=KVResidual(tail=TAIL),
                                  token_sparse_prefill=SparsePrefill(*SPARSE) if sparse else None)
        w, prompt = weights_of(model), PROMPTS[p]
        fwd = flashloop_forward(w, model.config, torch.tensor(prompt), len(prompt), feats, exit_threshold)
        tokens = flashloop_greedy(w, model.config, prompt, MAX_TOKENS, feats, exit_threshold)
        first = torch.log_softmax(fwd.logits[-1].double(), -1)[tokens[0]].item()
        dense = flashloop_greedy(w, model.config, prompt, MAX_TOKENS, FlashLoopFeatures(), exit_threshold) \
            if not sparse and exit_threshold is None else None
        cache[key] = (tokens, first, dense)
    return cache[key]


def _check(ckpt, cache, got, prompts, sparse=False, exit_threshold=None):
    for p in prompts:
        tokens, first, _ = _reference(ckpt, cache, p, sparse, exit_threshold)
        assert got[f"r{p}"][0] == tokens, f"prompt {p}"
        assert got[f"r{p}"][1][0] == pytest.approx(first, abs=1e-9), f"prompt {p}"


@pytest.mark.parametrize("batched_tokens", [2048, 64, 13])
def test_greedy_equals_the_reference(tiny_ckpt, refs, batched_tokens):
    """One call per prompt, or prompts chunked by the token budget (wavefront calls that mix
    depths and requests): the same tokens as the reference."""
    engine = _engine(tiny_ckpt, max_num_batched_tokens=batched_tokens)
    got = _run(engine, {f"r{p}": PROMPTS[p] for p in range(len(PROMPTS))})
    _check(tiny_ckpt, refs, got, range(len(PROMPTS)))


def test_staggered_arrivals_mix_prefill_and_decode(tiny_ckpt, refs):
    engine = _engine(tiny_ckpt, max_num_batched_tokens=40)
    got = _run(engine, {f"r{p}": PROMPTS[p] for p in range(len(PROMPTS))}, stagger=True)
    _check(tiny_ckpt, refs, got, range(len(PROMPTS)))


@pytest.mark.parametrize("batched_tokens", [2048, 24])
def test_with_token_sparse_prefill(tiny_ckpt, refs, batched_tokens):
    """Residual rows only for the tokens a window kept: compact rows, absent = inherited."""
    engine = _engine(tiny_ckpt, sparse=True, max_num_batched_tokens=batched_tokens)
    got = _run(engine, {f"r{p}": PROMPTS[p] for p in range(len(PROMPTS))})
    _check(tiny_ckpt, refs, got, range(len(PROMPTS)), sparse=True)


def test_with_adaptive_exit(tiny_ckpt, refs):
    """Exited tokens have no rows at deeper planes (LAST_EXITED as inheritance)."""
    engine = _engine(tiny_ckpt, exit_threshold=0.5, max_num_batched_tokens=64)
    got = _run(engine, {f"r{p}": PROMPTS[p] for p in range(len(PROMPTS))})
    _check(tiny_ckpt, refs, got, range(len(PROMPTS)), exit_threshold=0.5)


def test_decode_fills_a_group_and_reads_it_from_its_seal(tiny_ckpt):
    """Decode rows complete a group (its last row is a generated token, encoded in that
    token's own call) and later decode queries read it exact until its seal, reconstructed
    from the seal on: position 118 + 20 tokens crosses row 127 and seal 127 + TAIL."""
    model, _ = load_model(tiny_ckpt, dtype=torch.float64)
    prompt = torch.randint(3, 200, (118,), generator=torch.Generator().manual_seed(9)).tolist()
    feats = FlashLoopFeatures(kv_residual=KVResidual(tail=TAIL))
    w = weights_of(model)
    want = flashloop_greedy(w, model.config, prompt, 20, feats)
    # serial visibility: one pass over the whole sequence gives every step's logits
    logits = flashloop_forward(w, model.config, torch.tensor(prompt + want), len(prompt), feats, None).logits
    want_lp = [torch.log_softmax(logits[len(prompt) - 1 + i].double(), -1)[t].item() for i, t in enumerate(want)]
    engine = _engine(tiny_ckpt)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=True)
    engine.add_request("r", prompt, params)
    got: list[int] = []
    got_lp: list[float] = []
    while engine.has_unfinished():
        for o in engine.step():
            got.extend(o.token_ids)
            got_lp.extend(o.logprobs)
    assert got == want
    assert got_lp == pytest.approx(want_lp, abs=1e-9)


def test_residuals_change_what_the_model_reads(tiny_ckpt, refs):
    """Not a vacuous comparison: the quantized reference's first logprob differs from dense."""
    model, _ = load_model(tiny_ckpt, dtype=torch.float32)
    w, prompt = weights_of(model), PROMPTS[2]
    dense = flashloop_forward(w, model.config, torch.tensor(prompt), len(prompt), FlashLoopFeatures(), None)
    quant = flashloop_forward(w, model.config, torch.tensor(prompt), len(prompt),
                              FlashLoopFeatures(kv_residual=KVResidual(tail=TAIL)), None)
    assert (dense.logits[-1] - quant.logits[-1]).abs().max() > 1e-3


@pytest.mark.parametrize("kw, message", [
    ({"speculation": "block"}, "does not run with speculation yet"),
    ({"preemption_mode": "swap"}, "preempts by recompute only"),
    ({"kv_residual_quantization": {"policy": "execution"}}, "'execution' is not implemented yet"),
])
def test_capability_errors(tiny_ckpt, kw, message):
    cfg = {"kv_residual_quantization": {"tail": TAIL}, "attention_backend": "torch"} | kw
    with pytest.raises(ConfigError, match=message):
        EngineCore(EngineConfig.from_kwargs(str(tiny_ckpt), device="cpu", dtype="float32", num_kv_pages=64, **cfg))
