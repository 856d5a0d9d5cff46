"""The Ouro looped transformer as three stages: embed, loop and head.

A forward call of the runtime is one `loop` over a set of rows (token, depth); the layer
stack is shared by every depth, so rows at different depths share every weight read.
Parameter names match the Hugging Face checkpoint exactly (`model.layers.{i}...`,
`lm_head.weight`), so loading is a name-for-name assignment. Serving then calls
`fuse_projections()`, which trades those names for fewer, wider matrices.
"""

from __future__ import annotations

import torch
from torch import nn

from specloop.config import ModelConfig
from specloop.model.exit_gate import exit_lambda
from specloop.model.layers import AttentionBackend, OuroLayer, Projection, RMSNorm, Rotary, use_kernels


class OuroBody(nn.Module):
    """Weights under the checkpoint's `model.` prefix."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OuroLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1, bias=True)


class OuroModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = OuroBody(cfg)
        self.lm_head = Projection(cfg.hidden_size, cfg.vocab_size)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def fuse_projections(self) -> OuroModel:
        """Fuse every layer's q/k/v and gate/up matrices in place (see `SelfAttention.fuse`)
        and return the model. Serving only: the state dict no longer has the checkpoint's
        names, so training, export and the reference use unfused models. Idempotent."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    @property
    def fused(self) -> bool:
        return all(layer.self_attn.fused and layer.mlp.fused for layer in self.model.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids [N] -> depth-0 input hidden [N, H]."""
        return self.model.embed_tokens(token_ids)

    def loop(self, hidden: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """One application of the L-layer stack plus the end-of-loop norm.

        hidden [N, H] is each row's input at its depth (the embedding at depth 0, the
        previous loop's normed output otherwise); positions [N] are absolute. The backend
        knows each row's depth plane. Returns the normed output [N, H].
        """
        rope = cos = sin = None
        if self.fused and use_kernels(hidden):  # RoPE in one kernel, in place in each layer's qkv
            rope = (positions, self.rotary.inv_freq)
        else:
            cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        layers = self.model.layers
        h, x = hidden, layers[0].input_layernorm(hidden)
        for index, layer in enumerate(layers):
            after = layers[index + 1].input_layernorm if index + 1 < len(layers) else self.model.norm
            h, x = layer(h, x, after, cos, sin, backend, index, rope)
        return x

    def exit_lambda(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exit-gate lambda [N] (fp32) of end-of-loop hidden states [N, H]."""
        gate = self.model.early_exit_gate
        return exit_lambda(hidden, gate.weight, gate.bias)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """End-of-loop hidden [N, H] -> logits [N, V] in fp32 (fp64 for an fp64 model)."""
        logits = self.lm_head(hidden)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
