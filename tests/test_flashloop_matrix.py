"""The FlashLoop feature matrix: every on/off combination of the three lazy updates x
{plain, block rounds, token pipelines} x {greedy, seeded sampling}, eager on CPU through
the torch backend (fp32), each against the FlashLoop reference with the same
configuration; and on the GPU under CUDA graphs (fp32, the Triton backend), where every
cell must replay graphs, and the sparse decode cells their own graphs for passes with
generated-token rows (with INT4 residuals those passes run eager, which the cell checks).

A cell runs two prompts (90 and 37 tokens) for 6 tokens and checks every emitted token's
logprob against one reference forward over prompt + emitted tokens (1e-5 on CPU; on the GPU
1e-4, and 1e-3 with INT4 residuals, where a rounding apart flips a code), and greedy tokens
against the reference's argmax. With INT4 residuals (tail 16,
groups of 64) the long prompt's queries read sealed, reconstructed K/V; token-sparse
prefill uses windows of 8 and retention 1, 1, 0.5, 0.25; sparse decode keeps 30% of the
keys. Deeper checks of each feature live in their own modules
(test_token_sparse_prefill, test_kv_residual_engine, test_sparse_decode_engine).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.model.flashloop_reference import FlashLoopFeatures, KVResidual, SparseDecode, SparsePrefill
from specloop.sampling_params import SamplingParams
from tests.engine_runs import MODES, reference_logprobs, run_all

TAIL = 16  # past the rows speculation keeps in flight (serial policy)
WINDOW, RETENTION, KEY_RETENTION = 8, (1.0, 1.0, 0.5, 0.25), 0.3
MAX_TOKENS = 6
_g = torch.Generator().manual_seed(8)
PROMPTS = [torch.randint(3, 200, (n,), generator=_g).tolist() for n in (90, 37)]
COMBOS = list(itertools.product([False, True], repeat=3))  # (token-sparse prefill, sparse decode, INT4 residuals)
SPEC = {"plain": "plain", "block": "block-d2", "pipeline": "pipeline-d1"}
SAMPLING = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, ignore_eos=True, logprobs=True),
}


def _name(combo: tuple[bool, bool, bool]) -> str:
    on = [n for n, f in zip(("prefill", "decode", "int4"), combo) if f]
    return "+".join(on) or "dense"


def _options(combo: tuple[bool, bool, bool]) -> dict:
    prefill, decode, int4 = combo
    out: dict = {}
    if prefill:
        out["token_sparse_prefill"] = {"window": WINDOW, "retention": list(RETENTION)}
    if decode:
        out["sparse_decode_attention"] = {"key_retention": KEY_RETENTION}
    if int4:
        out["kv_residual_quantization"] = {"tail": TAIL}
    return out


def _features(combo: tuple[bool, bool, bool]) -> FlashLoopFeatures:
    prefill, decode, int4 = combo
    return FlashLoopFeatures(
        token_sparse_prefill=SparsePrefill(window=WINDOW, retention=RETENTION) if prefill else None,
        sparse_decode=SparseDecode(key_retention=KEY_RETENTION) if decode else None,
        kv_residual=KVResidual(bits=4, group_size=64, tail=TAIL) if int4 else None)


def _engine(ckpt, combo, mode: str, **kw) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(
        str(ckpt), dtype="float32", num_kv_pages=512, block_size=4, **_options(combo), **MODES[SPEC[mode]], **kw))


def _check(ckpt, combo, got, sampling: str, tol: float) -> None:
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs = got[f"r{i}"]
        assert len(tokens) == MAX_TOKENS
        want = reference_logprobs(ckpt, prompt, tokens, _features(combo))
        picked = want[torch.arange(len(tokens)), torch.tensor(tokens)]
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), picked, atol=tol, rtol=tol)
        if sampling == "greedy":
            assert tokens == want.argmax(-1).tolist(), f"prompt {i}"


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("mode", list(SPEC))
@pytest.mark.parametrize("combo", COMBOS, ids=_name)
def test_eager_cell_matches_the_reference(tiny_ckpt, combo, mode, sampling):
    engine = _engine(tiny_ckpt, combo, mode, device="cpu", attention_backend="torch")
    _check(tiny_ckpt, combo, run_all(engine, PROMPTS, SAMPLING[sampling]), sampling, 1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("mode", list(SPEC))
@pytest.mark.parametrize("combo", COMBOS, ids=_name)
def test_graph_cell_matches_the_reference(tiny_ckpt, combo, mode, sampling):
    """CUDA graphs on (the default on CUDA), fp32, the Triton backend: every cell runs
    replayed passes. With sparse decode attention the passes with generated-token rows
    replay their own graphs, except with INT4 residuals, where they run eager (their keys
    are gathered per row, `gathered_reader`)."""
    engine = _engine(tiny_ckpt, combo, mode, device="cuda")
    graphs = engine.executor.runner.graphs
    assert graphs is not None and graphs.graphs
    # INT4: a GPU rounding apart can flip a code at a rounding boundary, one quantization step
    # (as test_cuda_graphs' residual cases allow); seen: 8.7e-4 for prefill+int4 at 416b9cb
    tol = 1e-3 if combo[2] else 1e-4
    _check(tiny_ckpt, combo, run_all(engine, PROMPTS, SAMPLING[sampling]), sampling, tol)
    assert graphs.replays > 0
    assert (graphs.sparse_replays > 0) == (combo[1] and not combo[2])
