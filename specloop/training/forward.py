"""A batched forward of `OuroModel` over every loop, for training and evaluation.

The serving stages work on flat rows; training wants B sequences of T tokens at once.
Rather than write the layer a second time, this module drives the model's own `loop`
stage over B*T flat rows with an attention backend that reshapes to [B, heads, T, D] and
calls `scaled_dot_product_attention(is_causal=True)` (flash attention on the GPU). So the
trained function is, by construction, the function the runtime serves; the tests check it
against `specloop.model.reference.reference_forward` anyway.

With an exit threshold below 1.0 the backend also implements LAST_EXITED (a token that
exited after loop e keeps its loop-e state, and deeper queries read its loop-e K/V),
which makes adaptive-exit evaluation exact.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn import functional as F

from specloop.model.exit_gate import exit_step
from specloop.model.ouro import OuroModel


class BatchedCausalAttention:
    """`AttentionBackend` for B sequences of T tokens at positions 0..T-1, one depth at a time.

    `exited` ([B, T] bool) and the per-layer frozen K/V implement LAST_EXITED; leave them
    unset (threshold 1.0) to attend plainly. `compute_dtype` casts q, k, v before the
    attention kernel (bf16 for flash attention under autocast).
    """

    def __init__(self, batch: int, seq_len: int, num_layers: int, compute_dtype: torch.dtype | None = None) -> None:
        self.batch = batch
        self.seq_len = seq_len
        self.compute_dtype = compute_dtype
        self.exited: torch.Tensor | None = None
        self.frozen: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.current: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.track_kv = False

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t = self.batch, self.seq_len
        heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
        if self.exited is not None and self.frozen[layer] is not None:
            mask = self.exited.reshape(b * t, 1, 1)
            k = torch.where(mask, self.frozen[layer][0], k)
            v = torch.where(mask, self.frozen[layer][1], v)
        if self.track_kv:
            self.current[layer] = (k, v)
        out_dtype = q.dtype
        if self.compute_dtype is not None:
            q, k, v = q.to(self.compute_dtype), k.to(self.compute_dtype), v.to(self.compute_dtype)
        q4 = q.view(b, t, heads, d).transpose(1, 2)
        k4 = k.view(b, t, kv_heads, d).transpose(1, 2)
        v4 = v.view(b, t, kv_heads, d).transpose(1, 2)
        if kv_heads != heads:
            k4 = k4.repeat_interleave(heads // kv_heads, dim=1)
            v4 = v4.repeat_interleave(heads // kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
        return out.transpose(1, 2).reshape(b * t, heads, d).to(out_dtype)

    def freeze(self, newly_exited: torch.Tensor) -> None:
        """After a loop: remember this loop's K/V for tokens that exited in it."""
        mask = newly_exited.reshape(-1, 1, 1)
        for layer, kv in enumerate(self.current):
            assert kv is not None
            if self.frozen[layer] is None:
                self.frozen[layer] = kv
            else:
                fk, fv = self.frozen[layer]
                self.frozen[layer] = (torch.where(mask, kv[0], fk), torch.where(mask, kv[1], fv))
        self.current = [None] * len(self.current)


@dataclasses.dataclass
class LoopOutputs:
    """hidden: per loop, end-of-loop normed states [B, T, H] (an exited token repeats its
    exit-loop state); gate_logits: [R, B, T] fp32, the pre-sigmoid exit-gate values;
    exit_loops: [B, T] 1-based exit loop under the threshold used (R at threshold 1.0)."""

    hidden: list[torch.Tensor]
    gate_logits: torch.Tensor
    exit_loops: torch.Tensor


def gate_logits(model: OuroModel, hidden: torch.Tensor) -> torch.Tensor:
    """Pre-sigmoid gate values in fp32, outside autocast (sigmoid of these is `exit_lambda`)."""
    gate = model.model.early_exit_gate
    with torch.autocast(hidden.device.type, enabled=False):
        logit = F.linear(hidden.float(), gate.weight.float(), gate.bias.float())
    return logit.squeeze(-1)


def batched_loops(
    model: OuroModel, tokens: torch.Tensor, exit_threshold: float = 1.0,
    attention_dtype: torch.dtype | None = None,
) -> LoopOutputs:
    """Run every loop over `tokens` [B, T] (each row a sequence starting at position 0)."""
    cfg = model.config
    b, t = tokens.shape
    n = b * t
    positions = torch.arange(t, device=tokens.device).repeat(b)
    backend = BatchedCausalAttention(b, t, cfg.num_hidden_layers, attention_dtype)
    adaptive = exit_threshold < 1.0
    backend.track_kv = adaptive
    h = model.embed(tokens.reshape(n))
    exited = torch.zeros(n, dtype=torch.bool, device=tokens.device)
    exit_loops = torch.full((n,), cfg.num_loops, dtype=torch.long, device=tokens.device)
    survival = torch.ones(n, dtype=torch.float32, device=tokens.device)
    hidden, logits = [], []
    for loop in range(1, cfg.num_loops + 1):
        out = model.loop(h, positions, backend)
        if adaptive:
            out = torch.where(exited[:, None], h, out)  # exited tokens keep their state
        z = gate_logits(model, out)
        logits.append(z)
        if adaptive:
            exits, survival = exit_step(survival, torch.sigmoid(z), loop, cfg.num_loops, exit_threshold)
            newly = exits & ~exited
            exit_loops = torch.where(newly, loop, exit_loops)
            backend.freeze(newly)
            exited = exited | exits
            backend.exited = exited.view(b, t)
        hidden.append(out.view(b, t, -1))
        h = out
    return LoopOutputs(hidden=hidden, gate_logits=torch.stack(logits).view(cfg.num_loops, b, t),
                       exit_loops=exit_loops.view(b, t))


def loop_logits(model: OuroModel, outputs: LoopOutputs) -> torch.Tensor:
    """Per-loop logits [R, B, T, V] in fp32 (fp64 for an fp64 model)."""
    return torch.stack([model.head(h) for h in outputs.hidden])
