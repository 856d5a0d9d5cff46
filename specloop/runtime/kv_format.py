"""The physical KV format behind the attention backends: BF16 pages (in the model dtype).

K and V are [L, num_pages * page_size, Hkv, D]; a KV slot is page * page_size + offset.
Every depth plane of every request draws pages from this one pool; the logical KV manager
(`specloop.scheduling.kv_manager`) decides which. The KV manager sizes its pool with
`page_bytes`, the format's answer to "what does one page of one plane cost".

A format is one object the backends use without asking which it is: it stores a layer's
rows (`write`, `encode`), attends for the torch reference (`single_keys`,
`group_attention`) and the Triton fast path (`attention`, `splits`), and says where the
keys a set of rows reads sit (`key_reader`, for sparse decode attention's kernels). A
packed format (INT4 residuals, `specloop.flashloop.kv_residual.format`) answers each of
these its own way; `pass_state` is what it derives once per loop pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from specloop.kernels import DTYPES as KERNEL_DTYPES
from specloop.kernels.kv_write import kv_write, kv_write_reference
from specloop.kernels.paged_attention import choose_splits, paged_attention
from specloop.kernels.sparse_decode_common import PackedRows

KeyReader = Callable[[torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, PackedRows | None]]
"""Rows r [n] -> (K, V [S, Hkv, D], page tables, each row's table offset [n], page size, and
`PackedRows` or None): where the keys of rows r sit as they read them: the BF16 pool, or
INT4 residual planes (then K and V are the planes' BF16 tails, and the kernels read each key
exact from them or reconstructed from the records, as the row reads it)."""


class PagedKV:
    name = "bf16-pages"
    contiguous_reads = True  # `read` returns a chunk's keys as stored (the flash prefill path gathers them)

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size

    @staticmethod
    def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one page of one plane: K and V of `page_size` tokens at every layer."""
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              keep: torch.Tensor | None) -> None:
        """Store rows' K/V; rows where `keep` is true leave the stored value (exited tokens).
        One Triton launch on CUDA (`specloop.kernels.kv_write`), its torch reference elsewhere."""
        if k.is_cuda and k.dtype in KERNEL_DTYPES:
            kv_write(self.k[layer], self.v[layer], slots, k, v, keep)
        else:
            kv_write_reference(self.k[layer], self.v[layer], slots, k, v, keep)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape) of one layer: [*slots.shape, Hkv, D]."""
        if slots.dim() == 1:  # (index_select: a third of advanced indexing's host time)
            return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)
        return self.k[layer, slots], self.v[layer, slots]

    COPY_CHUNK = 2048  # slots per copy: bounds the temporary ([L, chunk, Hkv, D] each for K and V)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from slots `src` to slots `dst` (distinct from every src):
        token-sparse prefill's left-out tokens inheriting their previous depth."""
        for at in range(0, src.numel(), self.COPY_CHUNK):
            s, d = src[at: at + self.COPY_CHUNK], dst[at: at + self.COPY_CHUNK]
            self.k.index_copy_(1, d, self.k.index_select(1, s))
            self.v.index_copy_(1, d, self.v.index_select(1, s))

    def inherit(self, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor) -> None:
        """LAST_EXITED: where `mask`, copy every layer's K/V from slot src to slot dst."""
        m = mask[None, :, None, None]
        self.k[:, dst] = torch.where(m, self.k[:, src], self.k[:, dst])
        self.v[:, dst] = torch.where(m, self.v[:, src], self.v[:, dst])

    # ---- what the backends ask of a format ------------------------------------------
    def pass_state(self, lp: Any) -> Any:
        """What the format derives once per loop pass (`LoopPass`): pages need nothing."""
        return None

    def encode(self, layer: int, state: Any) -> None:
        """After a layer's rows are written, before anyone reads them: pages store as written."""

    def single_keys(self, layer: int, key_slots: torch.Tensor, rows: slice, state: Any
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [G, L, Hkv, D] a run of single-row groups (rows) reads at `key_slots` [G, L]."""
        return self.read(layer, key_slots)

    def group_attention(self, layer: int, q: torch.Tensor, key_slots: torch.Tensor, mask: torch.Tensor,
                        rows: slice, scale: float, state: Any) -> torch.Tensor:
        """The torch reference's attention of one group's rows q [n, Hq, D] over its keys at
        `key_slots` [Lk] (mask [n, Lk]: which key each query may read)."""
        keys, values = self.read(layer, key_slots)
        return sdpa(q, keys, values, mask, scale)

    def splits(self, num_tiles: int, num_kv_heads: int, longest: int, num_sms: int) -> int:
        """Split-KV of the Triton launch for a pass of `num_tiles` query tiles."""
        return choose_splits(num_tiles, num_kv_heads, longest, num_sms)

    def attention(self, layer: int, q: torch.Tensor, meta: Any, state: Any, out: torch.Tensor | None,
                  return_lse: bool, scores: torch.Tensor | None, score_rows: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The Triton launch over the pass's query tiles (`TritonMeta`): the paged kernel."""
        return paged_attention(q, self.k[layer], self.v[layer], meta.tables, meta.positions, meta.tiles,
                               self.page_size, tile_rows=meta.tile_rows, num_splits=meta.num_splits, out=out,
                               return_lse=return_lse, scores=scores, score_rows=score_rows)

    def key_reader(self, layer: int, tables: torch.Tensor, table_offsets: torch.Tensor, every: bool,
                   state: Any) -> KeyReader:
        """Where the keys of a set of rows sit, as they read them (`every`: the rows asked
        for are every row of the pass)."""
        return paged_reader(self.k[layer], self.v[layer], tables, table_offsets, self.page_size, every)


def paged_reader(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, table_offsets: torch.Tensor,
                 page_size: int, every: bool = False) -> KeyReader:
    """Keys in one layer of the BF16 page pool (`every`: the rows asked for are every row)."""
    return lambda r: (k_cache, v_cache, tables, table_offsets if every else table_offsets[r].contiguous(), page_size,
                      None)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D], k/v [Lk, Hkv, D], mask [n, Lk] -> [n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale
    )
    return out[0].transpose(0, 1)
