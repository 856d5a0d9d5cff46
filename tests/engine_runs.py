"""Shared by the tests that run one engine two ways and compare what it emits (attention
backends, multi-loop plans, CUDA graphs): the execution modes, a staggered run, the check."""

from __future__ import annotations

import functools

import torch

from specloop.checkpoint import load_model
from specloop.engine.core import EngineCore
from specloop.model.flashloop_reference import FlashLoopFeatures, flashloop_forward
from specloop.sampling_params import SamplingParams

MODES = {
    "plain": {},
    "exit": {"exit_threshold": 0.5},
    "block-d1": {"speculation": "block", "num_speculative_tokens": 3, "draft_loops": 1},
    "block-d2": {"speculation": "block", "num_speculative_tokens": 2, "draft_loops": 2},
    "pipeline-d1": {"speculation": "pipeline", "draft_loops": 1},
    "pipeline-d2": {"speculation": "pipeline", "draft_loops": 2},
}
Outputs = dict[str, tuple[list[int], list[float]]]


def pages_at_rest(engine: EngineCore) -> bool:
    """No request holds a page: each is free or held by the prefix cache alone (on by
    default), whose invariants hold."""
    kv, cache = engine.kv, engine.scheduler.prefix_cache
    idle = 0
    if cache is not None:
        cache.check()
        idle = cache.num_evictable_pages
    return not kv.requests() and kv.num_free_pages + idle == kv.num_pages


def run_staggered(engine: EngineCore, prompts: list[list[int]], max_tokens: int, sampled: int = 1,
                  seed: int = 5) -> Outputs:
    """One arrival per step (prefill beside decodes), greedy except request `sampled`
    (seeded, top-p); every page and token slot must return. Tokens and logprobs per request."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    seeded = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True,
                            logprobs=True)
    return run_all(engine, prompts, [seeded if i == sampled else greedy for i in range(len(prompts))], stagger=True)


def assert_same(got: Outputs, want: Outputs, tol: float) -> None:
    """The same tokens per request, logprobs within `tol`."""
    assert set(got) == set(want)
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(want[rid][1]), atol=tol, rtol=tol)


def forbid_syncs(engine: EngineCore) -> None:
    """Make every submission of `engine` raise on a synchronising CUDA call (sync debug mode)."""
    submit = engine.executor.submit

    def checked_submit(plan):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return submit(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine.executor.submit = checked_submit


def step_into(engine: EngineCore, out: Outputs) -> None:
    """One engine step; its outputs join `out` (no request may fail)."""
    for o in engine.step():
        assert o.error is None, o.error
        tokens, logprobs = out.setdefault(o.request_id, ([], []))
        tokens.extend(o.token_ids)
        logprobs.extend(o.logprobs or [])


def run_all(engine: EngineCore, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
            stagger: bool = False) -> Outputs:
    """Every prompt as r0, r1, ... (with `stagger`, one arrival per step, prefill beside
    decodes; `params` one for all or one each); no request may fail, and every page and
    token slot must return. Tokens and logprobs per request."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    pending = list(enumerate(prompts))
    out: Outputs = {}
    while pending or engine.has_unfinished():
        while pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, each[i])
            if stagger:
                break
        step_into(engine, out)
    assert pages_at_rest(engine)
    assert engine.scheduler.token_slots.num_free == engine.scheduler.token_slots.size
    return out


@functools.lru_cache(maxsize=4)
def _weights(ckpt: str, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], object]:
    model, _ = load_model(ckpt, dtype=dtype)
    return {name: p.detach() for name, p in model.named_parameters()}, model.config


def reference_logprobs(ckpt, prompt: list[int], tokens: list[int], feats: FlashLoopFeatures,
                       exit_threshold: float | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[T, V] fp64 log-probabilities the FlashLoop reference (`dtype`, fp32 by default, full
    recomputation) gives each of `tokens`' positions after `prompt`: one forward over
    prompt + tokens[:-1]."""
    weights, cfg = _weights(str(ckpt), dtype)
    ids = torch.tensor(prompt + tokens[:-1])
    logits = flashloop_forward(weights, cfg, ids, len(prompt), feats, exit_threshold).logits
    return torch.log_softmax(logits[len(prompt) - 1:].double(), -1)


def device_feature(engine: EngineCore, kind: type):
    """The engine's FlashLoop feature device half of type `kind` (`EngineCore.features`)."""
    found = [f for f in engine.features if isinstance(f, kind)]
    assert len(found) == 1, f"the engine has {len(found)} {kind.__name__}"
    return found[0]


def residual_planes(engine: EngineCore):
    """The INT4 residual planes (`PackedResiduals`) of an engine with kv_residual_quantization on."""
    from specloop.flashloop.kv_residual.device import ResidualDevice

    return device_feature(engine, ResidualDevice).store


def decode_references(engine: EngineCore):
    """The decode slots' reference state (`DecodeReferences`) of an engine with sparse decode attention on."""
    from specloop.flashloop.sparse_decode.device import ReferencesDevice

    return device_feature(engine, ReferencesDevice).references
