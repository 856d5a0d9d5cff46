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
from specloop.kernels import DTYPES as KERNEL_DTYPES, norms
from specloop.kernels import gemv
from specloop.kernels.rope import rope_


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the layer's fused Triton kernels (`specloop.kernels.norms`) replace its torch
    ops: on CUDA, in fp32/bf16/fp16, without autograd (training keeps the torch ops, which
    have a backward; on CPU the interpreter would be far slower than torch)."""
    return x.is_cuda and x.dtype in KERNEL_DTYPES and not torch.is_grad_enabled()


class RMSNorm(nn.Module):
    """Variance in fp32, normalise, cast back to the input dtype, then scale.

    The normalisation is `F.rms_norm` on the fp32 copy: one fused kernel on CUDA instead
    of five eager ops (forward calls are launch-bound), the same arithmetic."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x):
            return norms.rms_norm(x, self.weight, self.eps)
        return self.torch_forward(x)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * F.rms_norm(x32, x32.shape[-1:], None, self.eps).to(x.dtype)

    def add_then(self, h: torch.Tensor, x: torch.Tensor, after: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + self(x), after(h + self(x))): the sandwich norm's residual add and the norm
        that reads it, one kernel where kernels run (the same bits as the residual add's
        kernel, `norms.add_rms_norm`, then `after`)."""
        if use_kernels(x):
            return norms.add_rms_norm_pair(h, x, self.weight, self.eps, after.weight, after.eps)
        h = h + self.torch_forward(x)
        return h, after.torch_forward(h)


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


class Projection(nn.Linear):
    """A bias-free nn.Linear (same parameters, same state-dict names) whose product at one
    row runs the kernel of `specloop.kernels.gemv` (batch-1 decode steps: CUDA, bf16/fp16,
    no autograd); cuBLAS everywhere else."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemv.linear(x, self.weight)

    def of_silu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu_mul(gate_up)); where the one-row kernel runs, with the activation in its
        operand loads (one launch and no intermediate; the same bits)."""
        if gemv.use_gemv(gate_up, self.weight):
            return gemv.gemv(gate_up, self.weight, silu=True)
        return self(norms.silu_mul(gate_up))


@torch.no_grad()
def _fuse_linears(*parts: nn.Linear) -> nn.Linear:
    """One bias-free Linear whose weight rows are the parts' rows, in order.

    The fused module is built on the meta device (no throwaway init) and takes the
    concatenated weight; the caller drops the parts, so memory peaks at one fused matrix
    above the model's size, never at two copies of the model."""
    assert all(p.bias is None for p in parts), "only bias-free projections are fused"
    weight = torch.cat([p.weight for p in parts])
    with torch.device("meta"):
        fused = Projection(weight.shape[1], weight.shape[0])
    fused.weight = nn.Parameter(weight, requires_grad=parts[0].weight.requires_grad)
    return fused


class SelfAttention(nn.Module):
    """q/k/v_proj as in the checkpoint, or after `fuse()` one qkv_proj (serving)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = Projection(cfg.hidden_size, self.num_heads * self.head_dim)
        self.k_proj = Projection(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.v_proj = Projection(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.o_proj = Projection(self.num_heads * self.head_dim, cfg.hidden_size)
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
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
        backend: AttentionBackend, layer: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`rope` (positions, inv_freq) instead of (cos, sin): rotate q and k in place in the
        fused qkv output with one kernel (`specloop.kernels.rope`)."""
        n = x.shape[0]
        if self.fused:
            # Views into one [N, (Hq + 2 Hkv) D] output: rows strided, head dim contiguous.
            rotated = (self.num_heads + self.num_kv_heads) * self.head_dim
            if rope is not None and gemv.use_gemv(x, self.qkv_proj.weight):
                qkv = gemv.gemv_rope(x, self.qkv_proj.weight, *rope, rotated)  # the rotation in the product's launch
            else:
                qkv = self.qkv_proj(x)
                if rope is not None:
                    rope_(qkv[:, :rotated].view(n, -1, self.head_dim), *rope)
            q, k, v = qkv.split(self._qkv_sizes, dim=-1)
        else:
            assert rope is None, "RoPE in place needs the fused qkv output"
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if rope is None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.attend(layer, q, k, v)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    """gate/up_proj as in the checkpoint, or after `fuse()` one gate_up_proj (serving)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Projection(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Projection(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Projection(cfg.intermediate_size, cfg.hidden_size)
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
            gate_up = self.gate_up_proj(x)
            if use_kernels(gate_up):
                if isinstance(self.down_proj, Projection):  # not a tensor-parallel wrapper
                    return self.down_proj.of_silu(gate_up)
                return self.down_proj(norms.silu_mul(gate_up))
            gate, up = gate_up.split(self._intermediate, dim=-1)
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
        self, h: torch.Tensor, x: torch.Tensor, after: RMSNorm, cos: torch.Tensor | None, sin: torch.Tensor | None,
        backend: AttentionBackend, layer: int, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, x) -> (h', after(h')): x = self.input_layernorm(h) comes in already normed (the
        previous layer computed it with its last residual add), and `after` is the norm
        that reads this layer's output (the next layer's input norm, or the loop's final
        one), so each residual add and the norm after it are one kernel: two norm
        launches a layer instead of four."""
        attn = self.self_attn(x, cos, sin, backend, layer, rope)
        h, x = self.input_layernorm_2.add_then(h, attn, self.post_attention_layernorm)
        mlp = self.mlp(x)
        return self.post_attention_layernorm_2.add_then(h, mlp, after)
