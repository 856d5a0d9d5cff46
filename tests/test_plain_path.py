"""The plain-PyTorch yardstick (`bench/plain_path.py`) computes specloop's model.

fp32 on CPU, the tiny GQA checkpoint (2 layers x 4 loops, 4 query heads over 2 KV heads):
the plain path's prefill logits and five greedy decode steps through its static cache
(eager layer, no graph) against specloop's `OuroModel` run with every loop over the whole
sequence, to 1e-4 relative. The same check must fail on plausible mistakes in the plain
model (norm placement, RoPE convention, the decode mask, the cache planes, the loop
count, a warm-up that overwrites the prompt's cache), so a passing check means something.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parent.parent / "bench" / "plain_path.py"
TOL = 1e-4


def _load_module():
    spec = importlib.util.spec_from_file_location("bench_plain_path", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


pp = _load_module()


def _check(ckpt, batch: int = 2, **kw) -> dict:
    return pp.check_against_specloop(ckpt, batch=batch, prompt_len=9, steps=5, device="cpu",
                                     dtype=torch.float32, tolerance=TOL, **kw)


@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_and_decode_match_specloop(tiny_ckpt, batch):
    result = _check(tiny_ckpt, batch)
    assert len(result["rel_errors"]) == 6  # the prefill's last position, then 5 decode steps
    assert result["ok"], result
    assert result["max_rel_error"] < TOL
    assert result["greedy_agreement"] == 1.0


def test_matmul_decode_attention_matches_specloop(tiny_ckpt):
    model = pp.PlainOuro.from_checkpoint(tiny_ckpt, "cpu", torch.float32, attention="matmul")
    result = _check(tiny_ckpt, model=model)
    assert result["ok"], result


def _interleaved_rope(x, cos, sin):
    """The other RoPE convention: pairs (2i, 2i + 1) instead of (i, i + D/2)."""
    rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    return x * cos + rotated * sin


def _one_loop_short(folder):
    shape = READ_SHAPE(folder)
    return dataclasses.replace(shape, loops=shape.loops - 1)


def _warm_up_from_zero(self, steps=3):
    """A warm-up (compile, capture) that starts at position 0: it overwrites the prompt's keys."""
    tokens, pos = self.tokens.clone(), self.pos.clone()
    self.pos.zero_()
    for _ in range(steps):
        self._step()
    self.tokens.copy_(tokens)
    self.pos.copy_(pos)


READ_SHAPE = pp.read_shape
MUTANTS = {
    "pre-norm residual (no sandwich norm)": ("sandwich_add", lambda h, out, weight, eps: h + out),
    "interleaved RoPE pairs": ("rotate", _interleaved_rope),
    "no RoPE": ("rotate", lambda x, cos, sin: x),
    "decode reads one slot ahead": ("visible_keys", lambda index, pos: (index <= pos + 1).view(1, 1, 1, -1)),
    "decode misses its own key": ("visible_keys", lambda index, pos: (index < pos).view(1, 1, 1, -1)),
    "one cache plane per layer, not per (loop, layer)": ("StaticCache.plane", lambda self, loop, layer: (
        self.k[0, layer], self.v[0, layer])),
    "one loop short": ("read_shape", _one_loop_short),
    "warm-up writes over the prompt": ("DecodeStep.warm_up", _warm_up_from_zero),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_check_fails_on_a_wrong_model(tiny_ckpt, monkeypatch, mutant):
    name, replacement = MUTANTS[mutant]
    owner, _, attr = name.rpartition(".")
    monkeypatch.setattr(getattr(pp, owner) if owner else pp, attr, replacement)
    result = _check(tiny_ckpt)
    assert not result["ok"]
    assert result["max_rel_error"] > 100 * TOL, result
