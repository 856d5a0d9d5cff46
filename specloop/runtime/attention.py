"""Paged KV storage and the torch attention backend for mixed-depth rows.

Physical format (BF16 pages, in the model dtype): K and V are [L, num_pages * block_size,
Hkv, D]; a flat slot is page * block_size + offset. Every depth plane of every request
draws pages from this one pool; the logical KV manager decides which. Packed formats
(INT4 residuals) will implement the same small interface: `write`, `gather`, `inherit`.

`PagedAttention` is the attention backend a forward call uses: it writes each row's K/V
into its plane, then attends per group (one request, one depth, a contiguous query range)
over that plane's keys [0, position]. Single-row groups (decodes) are batched into one
padded gather; multi-row groups (prompt chunks) run scaled-dot-product attention each.
All sizes come from the plan on the CPU: the forward never reads a device value back.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn import functional as F


class PagedKVStorage:
    def __init__(
        self, num_layers: int, num_pages: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        shape = (num_layers, num_pages * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def page_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one page: K and V of `block_size` tokens at every layer of one plane."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              keep: torch.Tensor | None) -> None:
        """Store rows' K/V; rows where `keep` is true leave the stored value (exited tokens)."""
        if keep is not None:
            k = torch.where(keep[:, None, None], self.k[layer, slots], k)
            v = torch.where(keep[:, None, None], self.v[layer, slots], v)
        self.k[layer, slots] = k
        self.v[layer, slots] = v

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, slots], self.v[layer, slots]

    def inherit(self, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor) -> None:
        """LAST_EXITED: where `mask`, copy every layer's K/V from slot src to slot dst."""
        m = mask[None, :, None, None]
        self.k[:, dst] = torch.where(m, self.k[:, src], self.k[:, dst])
        self.v[:, dst] = torch.where(m, self.v[:, src], self.v[:, dst])


@dataclasses.dataclass
class PrefillGroup:
    rows: slice  # the group's rows in the call
    key_slots: torch.Tensor  # [Lk] flat slots of keys 0..end-1
    mask: torch.Tensor  # [n, Lk] True where query i may read key j


@dataclasses.dataclass
class DecodeBatch:
    rows: torch.Tensor  # [G] row index of each single-row group
    key_slots: torch.Tensor  # [G, Lmax]
    valid: torch.Tensor  # [G, Lmax] key j <= the row's position


class PagedAttention:
    """AttentionBackend over `PagedKVStorage`; the runner sets the per-call metadata."""

    def __init__(self, storage: PagedKVStorage) -> None:
        self.storage = storage
        self.write_slots: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None
        self.prefills: list[PrefillGroup] = []
        self.decodes: DecodeBatch | None = None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.write_slots is not None, "the runner sets metadata before the forward"
        self.storage.write(layer, self.write_slots, k, v, self.keep)
        out = torch.empty_like(q)
        scale = q.shape[-1] ** -0.5
        for group in self.prefills:
            keys, values = self.storage.gather(layer, group.key_slots)
            out[group.rows] = _sdpa(q[group.rows], keys, values, group.mask, scale)
        if self.decodes is not None:
            d = self.decodes
            keys, values = self.storage.gather(layer, d.key_slots)  # [G, Lmax, Hkv, D]
            out[d.rows] = _decode_attention(q[d.rows], keys, values, d.valid, scale)
        return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D], k/v [Lk, Hkv, D], mask [n, Lk] -> [n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale
    )
    return out[0].transpose(0, 1)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """q [G, Hq, D], k/v [G, L, Hkv, D], valid [G, L]; scores and softmax in >= fp32."""
    acc = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[2]
    qg = q.view(q.shape[0], k.shape[2], group, q.shape[2]).to(acc)  # [G, Hkv, g, D]
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k.to(acc)) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v.to(acc))
    return out.reshape(q.shape).to(q.dtype)
