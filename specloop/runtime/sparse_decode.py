"""Sparse decode attention in the runtime: the loop-2 reference state of generated tokens,
kept in their token slots, and the attention step that writes and reads it.

A generated token's row (position at or past its request's prompt, `RowGroup.decode_from`)
is a *source* at loop 2 (depth 1): it attends to every causal key as usual and also keeps,
per layer and query head, the top-b keys of its probabilities, their mass m, C_ref and the
full output O_ref (`specloop.kernels.sparse_decode`). At loops 3 and 4 (depths >= 2) the
same token's row is a *correction*: it attends to its kept keys of that depth alone and
outputs O_ref - C_ref + m * sum p V. Prompt rows stay dense.

The state lives in the token's slot (`DecodeReferences`, indexed by token slot: generated
tokens take their slots from the decode sub-pool of `TokenSlotPool`, the only slots with
room for it). A token keeps its slot from loop 1 to its last loop, so the state survives
between the calls of a token pipeline or a round's draft and verification, moves with the
pipeline's survivors (nothing is copied: slots travel with the tokens in the plan), and a
rejected token's slot is retired with it. `enter` marks a slot's state missing when a new
token takes the slot; a source write marks it present. A correction row whose state is
missing (which the scheduler's ordering never produces: a token's loop 2 always runs
before its loop 3) takes the dense output computed for it and is counted in `fallbacks`,
never consuming another token's state.

With INT4 residual planes the source and correction read each key as the row reads it
(exact from the BF16 tail or reconstructed from the packed planes, by the read rule),
through a per-layer gather of the rows' keys (`gathered_reader`): correct, not fast.

Not done yet: the dense attention still runs for every row, sparse ones included, before
their outputs are replaced (correct, not yet faster); CUDA graphs are refused at start-up
with a capability error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from specloop.kernels.sparse_decode import DecodeSource, decode_correction, decode_source, key_budget


@dataclasses.dataclass
class SparseRows:
    """A loop pass's generated-token rows: `source` (depth 1) and `correction` (depth >= 2)
    batch rows, [Ns] and [Nc] long on the device."""

    source: torch.Tensor
    correction: torch.Tensor


class DecodeReferences:
    """Reference state of the decode slots [0, num_slots): per slot, layer and query head the
    kept keys (int32, rank order, -1 past the count), the count (per slot: it depends on
    the position alone), m, O_ref and C_ref (fp32; fp64 for an fp64 model), and whether
    the slot's state was written for its current token (`present`, per layer)."""

    def __init__(self, num_slots: int, num_layers: int, num_heads: int, head_dim: int, max_context: int,
                 key_retention: float, dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots = num_slots
        self.key_retention = key_retention
        self.max_context = max_context
        self.capacity = key_budget(max_context, key_retention)
        acc = torch.promote_types(dtype, torch.float32)
        self.keys = torch.full((num_slots, num_layers, num_heads, self.capacity), -1, dtype=torch.int32,
                               device=device)
        self.count = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.mass = torch.zeros(num_slots, num_layers, num_heads, dtype=acc, device=device)
        self.o_ref = torch.zeros(num_slots, num_layers, num_heads, head_dim, dtype=acc, device=device)
        self.c_ref = torch.zeros_like(self.o_ref)
        # One row past the decode slots: the sink `enter` sends other slots to (no mask, no sync).
        self.present = torch.zeros(num_slots + 1, num_layers, dtype=torch.bool, device=device)
        self.fallbacks = torch.zeros((), dtype=torch.long, device=device)  # correction rows served dense
        # Its host copy, refreshed behind each call's work (`publish`): stats never wait on the device.
        self.fallbacks_host = torch.zeros((), dtype=torch.long, pin_memory=device.type == "cuda")
        self.nbytes_held = sum(t.numel() * t.element_size()
                               for t in (self.keys, self.count, self.mass, self.o_ref, self.c_ref, self.present))

    @staticmethod
    def nbytes(num_slots: int, num_layers: int, num_heads: int, head_dim: int, max_context: int,
               key_retention: float, dtype: torch.dtype) -> int:
        """Device bytes of the state for `num_slots` slots (what the KV budget leaves room for)."""
        acc = torch.promote_types(dtype, torch.float32).itemsize
        per_head = key_budget(max_context, key_retention) * 4 + acc * (1 + 2 * head_dim)
        return num_slots * (num_layers * (num_heads * per_head + 1) + 4) + num_layers  # + the sink row

    def publish(self) -> None:
        """Copy the fallback count to the host behind the call's work (complete once the
        call's ticket is)."""
        self.fallbacks_host.copy_(self.fallbacks, non_blocking=True)

    def enter(self, slots: torch.Tensor) -> None:
        """Tokens entering loop 1 in `slots`: a decode slot's state is missing until its
        token's loop 2 writes it (other slots hold none)."""
        self.present.index_fill_(0, torch.where(slots < self.num_slots, slots, self.num_slots), False)

    def attend(self, layer: int, rows: SparseRows, q: torch.Tensor, out: torch.Tensor, positions: torch.Tensor,
               token_slots: torch.Tensor, read: KeyReader, use_triton: bool, context: int,
               exited: torch.Tensor | None = None) -> torch.Tensor:
        """`out` [N, Hq, D] (the dense attention of the pass's rows) with the generated
        tokens' rows replaced: sources keep their state and output O_ref, corrections output
        the corrected attention where their state is present. Rows whose token exited
        (`exited` [N], adaptive exit: their outputs are dropped) run neither. One layer;
        `read` gives the keys a set of rows reads (`KeyReader`); `context` (host) bounds
        every row's position + 1; no host sync."""
        if rows.source.numel():
            self._source(layer, rows.source, q, out, positions, token_slots, read, use_triton, exited,
                         min(context, self.max_context))
        if rows.correction.numel():
            self._correct(layer, rows.correction, q, out, positions, token_slots, read, use_triton, exited)
        return out

    def _source(self, layer: int, r: torch.Tensor, q: torch.Tensor, out: torch.Tensor, positions: torch.Tensor,
                token_slots: torch.Tensor, read: KeyReader, use_triton: bool, exited: torch.Tensor | None,
                context: int) -> None:
        """`context`: the pass's longest context (host), which sizes the selection's scratch."""
        run = _running(r, exited)
        k_cache, v_cache, tables, offsets, page_size = read(r)
        src = decode_source(q[r].contiguous(), k_cache, v_cache, tables, torch.where(run, positions[r], -1), offsets,
                            page_size, self.key_retention, self.capacity, max_context=context,
                            out=out[r].contiguous(), use_triton=use_triton)
        slots = token_slots[r]
        self.keys[slots, layer] = src.keys
        if layer == 0:  # the count depends on the position alone
            self.count[slots] = src.count
        self.mass[slots, layer] = src.mass.to(self.mass.dtype)
        self.o_ref[slots, layer] = src.o_ref.to(self.o_ref.dtype)
        self.c_ref[slots, layer] = src.c_ref.to(self.c_ref.dtype)
        self.present[slots, layer] = run
        out[r] = src.out

    def _correct(self, layer: int, r: torch.Tensor, q: torch.Tensor, out: torch.Tensor, positions: torch.Tensor,
                 token_slots: torch.Tensor, read: KeyReader, use_triton: bool, exited: torch.Tensor | None) -> None:
        slots = token_slots[r]
        run = _running(r, exited)
        present = self.present[slots, layer]
        count = torch.where(present, self.count[slots], 0)  # a missing state is never read
        dense = out[r]  # kept where no correction runs
        source = DecodeSource(self.keys[slots, layer], count, self.mass[slots, layer], self.o_ref[slots, layer],
                              self.c_ref[slots, layer], dense)
        at = torch.where(present & run, positions[r], -1).contiguous()
        k_cache, v_cache, tables, offsets, page_size = read(r)
        out[r] = decode_correction(q[r].contiguous(), k_cache, v_cache, tables, at, offsets, page_size, source,
                                   out=dense, use_triton=use_triton)
        if layer == 0:
            self.fallbacks += (~present & run).sum()


def _running(r: torch.Tensor, exited: torch.Tensor | None) -> torch.Tensor:
    """[n] bool: rows r whose token has not exited."""
    if exited is None:
        return torch.ones(r.shape, dtype=torch.bool, device=r.device)
    return ~exited[r]


KeyReader = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]]
"""Rows r [n] -> (K, V [S, Hkv, D], page tables, each row's table offset [n], page size):
where the keys of rows r sit as they read them (the BF16 pool, or a gather of the packed
planes' reads)."""


def paged_reader(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, table_offsets: torch.Tensor,
                 page_size: int) -> KeyReader:
    """Keys in one layer of the BF16 page pool."""
    return lambda r: (k_cache, v_cache, tables, table_offsets[r].contiguous(), page_size)


def gathered_reader(read_keys: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]], longest: int,
                    page_size: int) -> KeyReader:
    """Keys as each row reads them from INT4 residual planes (exact from the tail or
    reconstructed, by the read rule), gathered into a scratch of `longest` keys per row
    rounded up to whole pages (`read_keys(rows, keys)` -> K, V [n, keys, Hkv, D]); the
    rows' tables are consecutive pages of it. A transient of n x longest keys per layer:
    correct, not fast."""
    keys = -(-max(longest, 1) // page_size) * page_size
    per_row = keys // page_size

    def read(r: torch.Tensor):
        k, v = read_keys(r, keys)
        n = r.numel()
        tables = torch.arange(n * per_row, dtype=torch.long, device=k.device)
        offsets = torch.arange(n, dtype=torch.long, device=k.device) * per_row
        return k.reshape(n * keys, *k.shape[2:]), v.reshape(n * keys, *v.shape[2:]), tables, offsets, page_size
    return read
