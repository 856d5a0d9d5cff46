"""Fused q/k/v and gate/up projections (serving layout) against the checkpoint layout.

`OuroModel.fuse_projections()` must change the layout only: the same outputs (fp64 to
1e-12, fp32 to 1e-6), the same parameters in number, the parts dropped rather than kept
beside the fused copy, and the engine, which serves fused models, the same greedy tokens.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from specloop.checkpoint import load_model
from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.model.reference import _causal_attention
from specloop.sampling_params import SamplingParams

TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")


class CausalBackend:
    """One sequence at one depth: each row attends to itself and the rows before it.
    Records the strides it was given (fused k and v are strided views)."""

    def __init__(self) -> None:
        self.head_dim_strides: set[int] = set()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.head_dim_strides.update({q.stride(-1), k.stride(-1), v.stride(-1)})
        return _causal_attention(q, k, v)


def _pair(ckpt, dtype):
    """(unfused, fused) models from one checkpoint."""
    plain, _ = load_model(ckpt, dtype=dtype)
    fused, _ = load_model(ckpt, dtype=dtype)
    return plain, fused.fuse_projections()


def _run(model, ids: torch.Tensor, loops: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """`loops` loops over one sequence (all at one depth plane): last hidden and logits."""
    positions = torch.arange(ids.shape[0])
    backend = CausalBackend()
    with torch.inference_mode():
        hidden = model.embed(ids)
        for _ in range(loops):
            hidden = model.loop(hidden, positions, backend)
        assert backend.head_dim_strides == {1}
        return hidden, model.head(hidden)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_model_matches_unfused(any_ckpt, dtype):
    plain, fused = _pair(any_ckpt, dtype)
    ids = torch.randint(3, plain.config.vocab_size, (37,), generator=torch.Generator().manual_seed(0))
    want_h, want_logits = _run(plain, ids)
    got_h, got_logits = _run(fused, ids)
    tol = TOL[dtype]
    torch.testing.assert_close(got_h, want_h, atol=tol, rtol=tol)
    torch.testing.assert_close(got_logits, want_logits, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_sublayers_match_unfused(any_ckpt, dtype):
    """Attention and MLP alone, on activations of unit scale."""
    plain, fused = _pair(any_ckpt, dtype)
    n, cfg = 11, plain.config
    x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=dtype)
    cos, sin = plain.rotary.cos_sin(torch.arange(n), dtype)
    tol = TOL[dtype]
    with torch.inference_mode():
        for a, b in zip(plain.model.layers, fused.model.layers):
            torch.testing.assert_close(b.mlp(x), a.mlp(x), atol=tol, rtol=tol)
            torch.testing.assert_close(b.self_attn(x, cos, sin, CausalBackend(), 0),
                                       a.self_attn(x, cos, sin, CausalBackend(), 0), atol=tol, rtol=tol)


def test_fused_layout_and_parameters(any_ckpt):
    plain, fused = _pair(any_ckpt, torch.float32)
    cfg = plain.config
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    names = dict(fused.named_parameters())
    assert not [n for n in names if any(part in n for part in PARTS)]
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in plain.parameters())
    assert not plain.fused and fused.fused
    for index, (a, b) in enumerate(zip(plain.model.layers, fused.model.layers)):
        p = f"model.layers.{index}."
        assert names[p + "self_attn.qkv_proj.weight"].shape == (q + 2 * kv, h)
        assert names[p + "mlp.gate_up_proj.weight"].shape == (2 * i, h)
        # Rows in q, k, v and gate, up order: exactly the checkpoint's tensors stacked.
        qkv = b.self_attn.qkv_proj.weight
        assert torch.equal(qkv[:q], a.self_attn.q_proj.weight)
        assert torch.equal(qkv[q : q + kv], a.self_attn.k_proj.weight)
        assert torch.equal(qkv[q + kv :], a.self_attn.v_proj.weight)
        gate_up = b.mlp.gate_up_proj.weight
        assert torch.equal(gate_up[:i], a.mlp.gate_proj.weight)
        assert torch.equal(gate_up[i:], a.mlp.up_proj.weight)
        assert not qkv.requires_grad and not gate_up.requires_grad


def test_fuse_frees_the_parts(tiny_ckpt):
    """No doubled memory: once fused, nothing holds the separate weights."""
    model, _ = load_model(tiny_ckpt, dtype=torch.float32)
    parts = [weakref.ref(p) for n, p in model.named_parameters() if any(part in n for part in PARTS)]
    assert len(parts) == 5 * model.config.num_hidden_layers
    model.fuse_projections()
    gc.collect()
    assert all(ref() is None for ref in parts)


def test_fuse_twice_is_a_no_op(tiny_ckpt):
    model, _ = load_model(tiny_ckpt, dtype=torch.float32)
    assert model.fuse_projections() is model
    before = {n: p for n, p in model.named_parameters()}
    model.fuse_projections()
    after = dict(model.named_parameters())
    assert before.keys() == after.keys() and all(after[n] is p for n, p in before.items())


def test_unfused_model_keeps_checkpoint_names(tiny_ckpt):
    """Training and export rely on the checkpoint layout: only fusing changes it."""
    from specloop.checkpoint import expected_shapes

    model, _ = load_model(tiny_ckpt, dtype=torch.float32)
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == expected_shapes(model.config)


def _greedy(engine: EngineCore, prompts: list[list[int]], n: int) -> dict[str, tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)
    got: dict[str, tuple[list[int], list[float]]] = {}
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
        got[f"r{index}"] = ([], [])
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id][0].extend(out.token_ids)
            got[out.request_id][1].extend(out.logprobs or [])
    return got


@pytest.mark.parametrize("threshold", [1.0, 0.7])
def test_engine_serves_fused_with_the_same_tokens(any_ckpt, threshold):
    """The engine fuses what it loads; a model passed in is served as given (unfused here)."""
    options = dict(dtype="float64", device="cpu", kv_cache_bytes=8 << 20, max_num_batched_tokens=16,
                   exit_threshold=threshold)
    config = EngineConfig.from_kwargs(str(any_ckpt), **options)
    served = EngineCore(config)
    plain_model, _ = load_model(any_ckpt, dtype=torch.float64)
    plain = EngineCore(config, model=plain_model)
    assert served.model.fused and not plain.model.fused
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, plain_model.config.vocab_size, (n,), generator=gen).tolist() for n in (1, 9, 30)]
    want, got = _greedy(plain, prompts, 8), _greedy(served, prompts, 8)
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        torch.testing.assert_close(torch.tensor(got[rid][1], dtype=torch.float64),
                                   torch.tensor(want[rid][1], dtype=torch.float64), atol=1e-12, rtol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory accounting")
def test_fuse_on_cuda_does_not_double_memory(tiny_ckpt):
    """Allocated bytes are unchanged by fusing, and the peak exceeds them by at most one
    layer's parts (the concatenation is built before its parts are dropped)."""
    torch.cuda.synchronize()
    model, _ = load_model(tiny_ckpt, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model.fuse_projections()
    torch.cuda.synchronize()
    layer = model.model.layers[0]
    largest = max(layer.self_attn.qkv_proj.weight.nbytes, layer.mlp.gate_up_proj.weight.nbytes)
    assert torch.cuda.memory_allocated() == before
    assert torch.cuda.max_memory_allocated() <= before + largest + (1 << 20)  # allocator rounding
