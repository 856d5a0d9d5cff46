"""Building blocks of the Ouro layer: RMSNorm, rotary embedding, SwiGLU MLP, attention.

Rows are flat: hidden states are [N, H] where each row is one (token, depth) unit of work,
so rows of different requests and depths share every matrix product. Only attention
depends on a row's depth; it is delegated to an `AttentionBackend`.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from specloop.config import ModelConfig


class RMSNorm(nn.Module):
    """Variance in fp32, normalise, cast back to the input dtype, then scale.

    The normalisation is `F.rms_norm` on the fp32 copy: one fused kernel on CUDA instead
    of five eager ops (forward calls are launch-bound), the same arithmetic."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * F.rms_norm(x32, x32.shape[-1:], None, self.eps).to(x.dtype)


class Rotary(nn.Module):
    """Rotate-half RoPE at absolute positions (the same position at every loop)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, 1, head_dim] in `dtype`."""
        acc = torch.promote_types(dtype, torch.float32)  # fp32 angles, fp64 for fp64 models
        angles = positions.to(acc)[:, None] * self.inv_freq.to(positions.device, acc)[None, :]
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated by (cos, sin) [N, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class AttentionBackend(Protocol):
    """Stores the rows' K/V in their depth planes and attends each row to its plane.

    The caller (a runner) prepares per-call metadata before the forward; layers only call
    `attend`. q is [N, Hq, D], k and v are [N, Hkv, D], already rotated; returns [N, Hq, D].
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@torch.no_grad()
def _fuse_linears(*parts: nn.Linear) -> nn.Linear:
    """One bias-free Linear whose weight rows are the parts' rows, in order.

    The fused module is built on the meta device (no throwaway init) and takes the
    concatenated weight; the caller drops the parts, so memory peaks at one fused matrix
    above the model's size, never at two copies of the model."""
    assert all(p.bias is None for p in parts), "only bias-free projections are fused"
    weight = torch.cat([p.weight for p in parts])
    with torch.device("meta"):
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    fused.weight = nn.Parameter(weight, requires_grad=parts[0].weight.requires_grad)
    return fused


class SelfAttention(nn.Module):
    """q/k/v_proj as in the checkpoint, or after `fuse()` one qkv_proj (serving)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.fused = False
        kv = self.num_kv_heads * self.head_dim
        self._qkv_sizes = (self.num_heads * self.head_dim, kv, kv)

    def fuse(self) -> None:
        """Replace q/k/v_proj by one qkv_proj [(Hq + 2 Hkv) D, H], rows in q, k, v order, and
        drop the parts: one matmul instead of three (fewer kernel launches on a host-bound
        forward, one read of x and of one weight matrix). A second call does nothing."""
        if self.fused:
            return
        self.qkv_proj = _fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj
        self.fused = True

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        backend: AttentionBackend, layer: int,
    ) -> torch.Tensor:
        n = x.shape[0]
        if self.fused:
            # Views into one [N, (Hq + 2 Hkv) D] output: rows strided, head dim contiguous.
            q, k, v = self.qkv_proj(x).split(self._qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.attend(layer, q, k, v)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """gate/up_proj as in the checkpoint, or after `fuse()` one gate_up_proj (serving)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused = False
        self._intermediate = cfg.intermediate_size

    def fuse(self) -> None:
        """Replace gate/up_proj by one gate_up_proj [2 I, H] (gate rows first) and drop the
        parts: one matmul instead of two, for the same reasons as `SelfAttention.fuse`.
        A second call does nothing."""
        if self.fused:
            return
        self.gate_up_proj = _fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).split(self._intermediate, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class OuroLayer(nn.Module):
    """Sandwich-norm layer: each sub-block's output is normed again before the residual add."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg)
        self.mlp = SwiGLU(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, eps)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        backend: AttentionBackend, layer: int,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), cos, sin, backend, layer)
        h = h + self.input_layernorm_2(attn)
        mlp = self.mlp(self.post_attention_layernorm(h))
        return h + self.post_attention_layernorm_2(mlp)
