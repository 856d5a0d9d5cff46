"""Shared fixtures: small random checkpoints written in the real Hugging Face layout."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from specloop.checkpoint import load_model
from specloop.checkpoint.random_checkpoint import PRESETS, write_random_checkpoint
from specloop.config import ModelConfig

TINY = PRESETS["tiny"]  # GQA: 4 query heads over 2 KV heads
TINY_MHA = dataclasses.replace(TINY, num_key_value_heads=4, num_hidden_layers=3, hidden_size=48,
                               head_dim=12, vocab_size=300)


def make_checkpoint(root: Path, cfg: ModelConfig, seed: int = 0, dtype=torch.float32, **kw) -> Path:
    return write_random_checkpoint(root, cfg, seed=seed, dtype=dtype, **kw)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), TINY, seed=1)


@pytest.fixture(scope="session")
def tiny_mha_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny_mha"), TINY_MHA, seed=2)


@pytest.fixture(params=["gqa", "mha"])
def any_ckpt(request, tiny_ckpt, tiny_mha_ckpt) -> Path:
    return tiny_ckpt if request.param == "gqa" else tiny_mha_ckpt


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


@pytest.fixture(scope="session")
def tiny_model_fp32(tiny_ckpt):
    model, _ = load_model(tiny_ckpt, dtype=torch.float32)
    return model
