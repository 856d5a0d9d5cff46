"""The engine end to end through the Triton attention backend against the torch backend.

On CPU the Triton kernels run under the interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), on CUDA natively. Every execution mode: plain decoding, adaptive exit,
block rounds (draft depth 1 and 2) and token pipelines (d = 1 and 2), with staggered
arrivals, prompts longer than a prompt chunk and than a query tile, and a seeded sampled
request beside the greedy ones. The model is fp32, so the two backends agree to
rounding: the same tokens, logprobs within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.errors import ConfigError
from specloop.runtime.attention import TorchAttention, TritonAttention, make_backend
from specloop.runtime.kv_format import PagedKV
from specloop.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODES = {
    "plain": {},
    "exit": {"exit_threshold": 0.5},
    "block-d1": {"speculation": "block", "num_speculative_tokens": 3, "draft_loops": 1},
    "block-d2": {"speculation": "block", "num_speculative_tokens": 2, "draft_loops": 2},
    "pipeline-d1": {"speculation": "pipeline", "draft_loops": 1},
    "pipeline-d2": {"speculation": "pipeline", "draft_loops": 2},
}
PROMPTS = [[5, 9, 2], list(range(3, 40)), [7] * 11]


def _run(ckpt, backend: str, mode: dict) -> dict[str, tuple[list[int], list[float]]]:
    engine = EngineCore(EngineConfig.from_kwargs(
        str(ckpt), device=DEVICE, dtype="float32", attention_backend=backend, block_size=4,
        max_num_batched_tokens=24, max_num_seqs=4, **mode))
    assert engine.backend.name == backend
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, logprobs=True)
    out: dict[str, tuple[list[int], list[float]]] = {}
    pending = list(enumerate(PROMPTS))
    while pending or engine.has_unfinished():
        if pending:  # one arrival per step: prefill beside decodes
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, sampled if i == 2 else greedy)
        for o in engine.step():
            tokens, logprobs = out.setdefault(o.request_id, ([], []))
            tokens.extend(o.token_ids)
            logprobs.extend(o.logprobs or [])
    assert engine.kv.num_free_pages == engine.kv.num_pages
    return out


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_triton_backend_equals_torch_backend(tiny_ckpt, mode):
    want = _run(tiny_ckpt, "torch", MODES[mode])
    got = _run(tiny_ckpt, "triton", MODES[mode])
    assert set(got) == set(want)
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(want[rid][1]), atol=1e-4, rtol=1e-4)


def test_mha_checkpoint(tiny_mha_ckpt):
    assert _run(tiny_mha_ckpt, "triton", {})["r1"][0] == _run(tiny_mha_ckpt, "torch", {})["r1"][0]


def test_auto_picks_triton_on_cuda_and_torch_on_cpu(monkeypatch):
    kv = PagedKV(1, 2, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert isinstance(make_backend("auto", kv, torch.device("cpu"), 4, 2), TorchAttention)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="'triton' needs a CUDA device"):
        make_backend("triton", kv, torch.device("cpu"), 4, 2)
    if torch.cuda.is_available():
        kv = PagedKV(1, 2, 4, 2, 8, torch.float32, torch.device("cuda"))
        assert isinstance(make_backend("auto", kv, torch.device("cuda"), 4, 2), TritonAttention)


def test_tile_sizes_keep_the_kernel_m_dimension():
    kv = PagedKV(1, 2, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert TritonAttention(kv, 4, 2, torch.device("cpu")).tile_rows == (8, 32)  # GQA 2: M = 16 and 64
    assert TritonAttention(kv, 16, 16, torch.device("cpu")).tile_rows == (16, 64)
    assert TritonAttention(kv, 48, 2, torch.device("cpu")).tile_rows == (1, 2)  # group 24 padded to 32
