"""One rank's shard of an Ouro model: a separate pass over the unchanged model code.

A rank keeps a contiguous range of query heads with their KV heads (GQA groups stay whole:
query head h reads KV head h // (Hq / Hkv), so Hq / N query heads go with Hkv / N KV heads)
and a contiguous range of the MLP's intermediate columns:

    qkv_proj   [(Hq + 2 Hkv) D, H] -> its q, k and v rows   (column-parallel)
    o_proj     [H, Hq D]           -> its heads' columns    (row-parallel, then all-reduce)
    gate_up    [2 I, H]            -> its gate and up rows  (column-parallel)
    down_proj  [H, I]              -> its columns           (row-parallel, then all-reduce)

Embeddings, norms, the exit gate and lm_head are replicated, so after each all-reduce every
rank holds the same hidden state and the shard is an ordinary `OuroModel` of the local
shape (Hq / N, Hkv / N, I / N) whose o_proj and down_proj sum over the ranks. Attention
and the KV cache see only the local heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from specloop.config import ModelConfig
from specloop.errors import ConfigError
from specloop.model.layers import Rotary
from specloop.model.ouro import OuroModel

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the ranks, in place


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Refuse a split that would cut a head or an MLP column range unevenly."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(cfg, name)
        if value % size:
            raise ConfigError(f"tensor_parallel_size ({size}) must divide the model's {name} ({value})")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank computes: its heads and MLP columns."""
    check_divisible(cfg, size)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // size,
                               num_key_value_heads=cfg.num_key_value_heads // size,
                               intermediate_size=cfg.intermediate_size // size)


class RowParallel(nn.Module):
    """A row-parallel Linear: the rank's partial product, summed over the ranks in place."""

    def __init__(self, linear: nn.Linear, reduce: AllReduce) -> None:
        super().__init__()
        self.linear = linear
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.reduce(out)
        return out


def shard_state(state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s fused state dict from a full one (checkpoint layout or fused)."""
    d, hq, hkv, inter = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    q_rows, kv_rows, i_rows = _part(hq * d, rank, size), _part(hkv * d, rank, size), _part(inter, rank, size)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".layers." not in name or "layernorm" in name:
            out[name] = tensor  # replicated
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k, v = _parts(state, p + "self_attn.", ("q_proj", "k_proj", "v_proj"), "qkv_proj",
                         (hq * d, hkv * d, hkv * d))
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([q[q_rows], k[kv_rows], v[kv_rows]])
        out[p + "self_attn.o_proj.weight"] = state[p + "self_attn.o_proj.weight"][:, q_rows].contiguous()
        gate, up = _parts(state, p + "mlp.", ("gate_proj", "up_proj"), "gate_up_proj", (inter, inter))
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([gate[i_rows], up[i_rows]])
        out[p + "mlp.down_proj.weight"] = state[p + "mlp.down_proj.weight"][:, i_rows].contiguous()
    return out


def shard_model(state: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, size: int, reduce: AllReduce,
                device: torch.device) -> OuroModel:
    """Rank `rank`'s model on `device` from a full state dict: fused projections of the local
    shape, o_proj and down_proj wrapped in `RowParallel`; replicated weights already on
    `device` are shared, not copied."""
    local = shard_state(state, cfg, rank, size)
    with torch.device("meta"):
        model = OuroModel(local_config(cfg, size)).fuse_projections()
    model.load_state_dict({k: v.to(device) for k, v in local.items()}, assign=True)
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta).to(device)  # a buffer the state dict does not hold
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, reduce)
        layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, reduce)
    return model


def _part(total: int, rank: int, size: int) -> slice:
    share = total // size
    return slice(rank * share, (rank + 1) * share)


def _parts(state: dict[str, torch.Tensor], prefix: str, names: tuple[str, ...], fused: str,
           sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The separate projection weights under `prefix`, split again from `fused` if fused."""
    key = prefix + fused + ".weight"
    if key in state:
        return state[key].split(sizes)
    return tuple(state[prefix + n + ".weight"] for n in names)
