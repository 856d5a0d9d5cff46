"""The physical KV format behind the attention backends: BF16 pages (in the model dtype).

K and V are [L, num_pages * page_size, Hkv, D]; a KV slot is page * page_size + offset.
Every depth plane of every request draws pages from this one pool; the logical KV manager
(`specloop.scheduling.kv_manager`) decides which. The KV manager sizes its pool with
`page_bytes`, the format's answer to "what does one page of one plane cost", so a packed
format (INT4 residuals) only has to answer differently. Backends read and write through
`write`, `read` and `inherit`.
"""

from __future__ import annotations

import torch

from specloop.kernels import DTYPES as KERNEL_DTYPES
from specloop.kernels.kv_write import kv_write, kv_write_reference


class PagedKV:
    name = "bf16-pages"

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
