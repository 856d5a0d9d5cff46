"""Random-initialised checkpoints in exactly the Hugging Face Ouro layout.

Tests and benchmarks use these instead of downloaded weights. Tensors are generated and
written shard by shard, so an ouro-2.6b-shaped checkpoint never sits in memory whole.
Initialisation keeps activations O(1): std fan_in^-0.5 for projections, 1 for the
embedding, norm weights near 1, and an exit gate whose lambdas spread over (0, 1) so that
adaptive exit actually exits early on random checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specloop.checkpoint.loader import expected_shapes
from specloop.checkpoint.safetensors_files import INDEX_FILE, SINGLE_FILE
from specloop.checkpoint.tokenizer import byte_level_tokenizer, save_tokenizer
from specloop.config import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, total_ut_steps=4,
        max_position_embeddings=2048, eos_token_ids=(0,), bos_token_id=0,
    ),
    "ouro-1.4b": ModelConfig(
        vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, head_dim=128, total_ut_steps=4,
        max_position_embeddings=65536, eos_token_ids=(0,), bos_token_id=0,
    ),
    "ouro-2.6b": ModelConfig(
        vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=16, head_dim=128, total_ut_steps=4,
        max_position_embeddings=65536, eos_token_ids=(0,), bos_token_id=0,
    ),
}

SHAPE_OPTIONS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "total_ut_steps",
                 "max_position_embeddings", "rope_theta", "early_exit_threshold")


def preset_config(preset: str, **overrides: object) -> ModelConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: choose from {', '.join(PRESETS)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(PRESETS[preset], **given)


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight") or "layernorm" in name:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    if name == "model.early_exit_gate.bias":
        return torch.zeros(shape)
    if name == "model.early_exit_gate.weight":  # gate logits ~ N(0, 4): lambdas spread over (0, 1)
        return torch.randn(shape, generator=gen) * 2 * shape[-1] ** -0.5
    return torch.randn(shape, generator=gen) * shape[-1] ** -0.5


def write_random_checkpoint(
    out: str | Path, cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Write config.json, safetensors (sharded past `max_shard_bytes`) and a tokenizer."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = expected_shapes(cfg)
    shards: list[list[str]] = [[]]
    size = 0
    elem = torch.empty((), dtype=dtype).element_size()
    for name, shape in shapes.items():
        nbytes = elem * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for index, names in enumerate(shards):
        file = SINGLE_FILE if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _random_tensor(n, shapes[n], gen).to(dtype).contiguous() for n in names}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    save_tokenizer(byte_level_tokenizer(), out, max_length=cfg.max_position_embeddings)
    return out
