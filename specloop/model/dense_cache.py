"""A contiguous per-depth KV cache with a readable torch attention backend.

Storage is one plane per depth: K/V [R, L, S, T, Hkv, D] for S sequences of at most T
positions. A row at depth r writes its K/V into plane r and attends causally to plane r of
its own sequence. Adaptive exit is LAST_EXITED: `inherit` copies an exited token's K/V
into every deeper plane so deeper queries read its exit-depth version.

This is the simple backend the model tests and the loop stepper use; the serving runtime
pages the same logical planes.
"""

from __future__ import annotations

import torch

from specloop.config import ModelConfig


class PerDepthKVCache:
    def __init__(
        self, cfg: ModelConfig, max_seqs: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        shape = (cfg.num_loops, cfg.num_hidden_layers, max_seqs, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._read_len = 0

    def set_rows(self, seq_ids: torch.Tensor, positions: torch.Tensor, depths: torch.Tensor) -> None:
        """Per-call metadata: each row's sequence, absolute position and depth (0-based)."""
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} exceeds cache length {self.max_len}")
        self._rows = (seq_ids, positions, depths)
        self._read_len = int(positions.max()) + 1

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self._rows is not None, "set_rows must be called before the forward"
        seq, pos, depth = self._rows
        self.k[depth, layer, seq, pos] = k
        self.v[depth, layer, seq, pos] = v
        span = torch.arange(self._read_len, device=q.device)
        keys = self.k[depth[:, None], layer, seq[:, None], span[None, :]]  # [N, S, Hkv, D]
        values = self.v[depth[:, None], layer, seq[:, None], span[None, :]]
        group = q.shape[1] // keys.shape[2]
        acc = torch.promote_types(q.dtype, torch.float32)  # scores and softmax in >= fp32
        keys = keys.repeat_interleave(group, dim=2).to(acc)
        values = values.repeat_interleave(group, dim=2).to(acc)
        scores = torch.einsum("nhd,nshd->nhs", q.to(acc), keys) * q.shape[-1] ** -0.5
        future = span[None, :] > pos[:, None]  # [N, S]
        probs = scores.masked_fill(future[:, None, :], float("-inf")).softmax(-1)
        return torch.einsum("nhs,nshd->nhd", probs, values).to(q.dtype)

    def inherit(self, seq: int, positions: torch.Tensor, exit_depth: int) -> None:
        """LAST_EXITED: planes deeper than `exit_depth` read these tokens' exit-depth K/V."""
        src_k = self.k[exit_depth, :, seq, positions]
        src_v = self.v[exit_depth, :, seq, positions]
        for deeper in range(exit_depth + 1, self.k.shape[0]):
            self.k[deeper, :, seq, positions] = src_k
            self.v[deeper, :, seq, positions] = src_v
