"""Readable dense reference: full recomputation of every loop for a whole sequence.

This is the oracle for the runtime. It shares no code with `specloop.model.ouro` except
the exit-gate arithmetic (whose definition is tested on hand-computed cases): every norm,
rotation, projection and attention is written out here again in plain PyTorch, reading
weights by their checkpoint names, so a bug in the runtime's layers cannot hide in both.

Adaptive exit follows LAST_EXITED: a token that exited after loop e keeps its loop-e
hidden state, and queries at any deeper loop read its loop-e K/V.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch.nn import functional as F

from specloop.config import ModelConfig
from specloop.model.exit_gate import exit_lambda, exit_step


@dataclasses.dataclass
class ReferenceOutput:
    """logits: [T, V] fp32 (fp64 for fp64 weights) at each token's exit loop; loop_logits: [R, T, V] per loop (a
    token that exited repeats its exit-loop values at deeper loops); loop_hidden: [R, T, H]
    end-of-loop states likewise; exit_loops: [T] 1-based; lambdas: [R, T] fp32 gate values
    (meaningful up to each token's exit loop)."""

    logits: torch.Tensor
    loop_logits: torch.Tensor
    loop_hidden: torch.Tensor
    exit_loops: torch.Tensor
    lambdas: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D]: pairs (i, i + D/2) rotated by position * theta^(-2i/D)."""
    d = x.shape[-1]
    inv_freq = (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float()
    acc = torch.promote_types(x.dtype, torch.float32)
    angle = positions.to(acc)[:, None] * inv_freq[None, :].to(x.device, acc)  # [T, D/2]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[:, None, :].to(x.dtype)
    sin = torch.cat([angle.sin(), angle.sin()], -1)[:, None, :].to(x.dtype)
    first, second = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-second, first], -1) * sin


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; scores and softmax in fp32."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * d**-0.5
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.to(acc)).to(q.dtype)


def reference_forward(
    weights: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    token_ids: torch.Tensor,
    exit_threshold: float | None = None,
) -> ReferenceOutput:
    """Run all loops over `token_ids` [T] from scratch. Differentiable in `weights`."""
    q_exit = cfg.early_exit_threshold if exit_threshold is None else exit_threshold
    w = weights
    eps = cfg.rms_norm_eps
    num_loops, num_layers = cfg.num_loops, cfg.num_hidden_layers
    t = token_ids.shape[0]
    positions = torch.arange(t, device=token_ids.device)

    h = w["model.embed_tokens.weight"][token_ids]
    exited = torch.zeros(t, dtype=torch.bool, device=h.device)
    exit_loops = torch.full((t,), num_loops, dtype=torch.long, device=h.device)
    survival = torch.ones(t, dtype=torch.float32, device=h.device)
    frozen_kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
    loop_hidden, loop_logits, lambdas = [], [], []

    for loop in range(1, num_loops + 1):
        x = h
        layer_kv = []
        for i in range(num_layers):
            p = f"model.layers.{i}."
            a = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
            q = (a @ w[p + "self_attn.q_proj.weight"].T).view(t, cfg.num_attention_heads, cfg.head_dim)
            k = (a @ w[p + "self_attn.k_proj.weight"].T).view(t, cfg.num_key_value_heads, cfg.head_dim)
            v = (a @ w[p + "self_attn.v_proj.weight"].T).view(t, cfg.num_key_value_heads, cfg.head_dim)
            q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
            if frozen_kv[i] is not None:  # LAST_EXITED: exited tokens expose their exit-loop K/V
                k = torch.where(exited[:, None, None], frozen_kv[i][0], k)
                v = torch.where(exited[:, None, None], frozen_kv[i][1], v)
            layer_kv.append((k, v))
            o = _causal_attention(q, k, v).reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
            x = x + _rms_norm(o, w[p + "input_layernorm_2.weight"], eps)
            m = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
            m = (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T))
            m = m @ w[p + "mlp.down_proj.weight"].T
            x = x + _rms_norm(m, w[p + "post_attention_layernorm_2.weight"], eps)
        out = _rms_norm(x, w["model.norm.weight"], eps)
        out = torch.where(exited[:, None], h, out)  # exited tokens keep their state

        lam = exit_lambda(out, w["model.early_exit_gate.weight"], w["model.early_exit_gate.bias"])
        exits, survival = exit_step(survival, lam, loop, num_loops, q_exit)
        newly = exits & ~exited
        exit_loops = torch.where(newly, loop, exit_loops)
        for i, (k, v) in enumerate(layer_kv):
            if frozen_kv[i] is None:
                frozen_kv[i] = (k, v)
            else:
                frozen_kv[i] = (torch.where(newly[:, None, None], k, frozen_kv[i][0]),
                                torch.where(newly[:, None, None], v, frozen_kv[i][1]))
        exited = exited | exits

        h = out
        lambdas.append(lam)
        loop_hidden.append(out)
        logits = out @ w["lm_head.weight"].T
        loop_logits.append(logits.to(torch.promote_types(logits.dtype, torch.float32)))

    loop_logits_t = torch.stack(loop_logits)
    final = loop_logits_t.gather(0, (exit_loops - 1)[None, :, None].expand(1, t, loop_logits_t.shape[-1]))[0]
    return ReferenceOutput(
        logits=final,
        loop_logits=loop_logits_t,
        loop_hidden=torch.stack(loop_hidden),
        exit_loops=exit_loops,
        lambdas=torch.stack(lambdas),
    )


@torch.no_grad()
def reference_greedy(
    weights: Mapping[str, torch.Tensor], cfg: ModelConfig, prompt: list[int], max_new_tokens: int,
    exit_threshold: float | None = None,
) -> list[int]:
    """Greedy continuation by full recomputation at every step (slow, obviously right)."""
    device = next(iter(weights.values())).device
    ids = list(prompt)
    for _ in range(max_new_tokens):
        out = reference_forward(weights, cfg, torch.tensor(ids, device=device), exit_threshold)
        ids.append(int(out.logits[-1].argmax()))
    return ids[len(prompt):]
