"""Sparse decode attention's sizing and parts: the decode sub-pool of token slots, the
reference state those slots own, and its snapshot part."""

from __future__ import annotations

from specloop.flashloop.config import SparseDecodeAttention
from specloop.flashloop.sparse_decode.snapshot import ReferencesPart
from specloop.runtime.feature import Sizing
from specloop.flashloop.sparse_decode.references import DecodeReferences


class SparseDecodeFeature:
    option = "sparse_decode_attention"

    def __init__(self, group: SparseDecodeAttention, s: Sizing) -> None:
        self.group, self.s = group, s
        # the Triton kernels' scores scratch, sized by a pass's rows (the torch references need none)
        self.scratch_rows = s.rows if s.triton else 0

    @property
    def decode_slots(self) -> int:
        """Slots of the decode sub-pool (generated tokens'). A request holds a generated
        token's slot for each of its rows in flight (a round's, or a pipeline's live tokens)
        in each ticket in flight and the one being planned."""
        cfg = self.s.config
        return cfg.max_num_seqs * self.s.rows_per_request * (cfg.max_inflight_tickets + 1)

    def _shape(self) -> tuple:
        m, s = self.s.model, self.s
        return (self.decode_slots, m.num_hidden_layers, m.num_attention_heads, m.head_dim, s.max_model_len,
                self.group.key_retention)

    def reserved_bytes(self) -> int:
        """Device bytes of the reference state and the scores scratch, off the KV budget."""
        return DecodeReferences.nbytes(*self._shape(), self.s.dtype, self.scratch_rows)

    def references(self) -> DecodeReferences:
        return DecodeReferences(*self._shape(), self.s.dtype, self.s.device, self.scratch_rows)

    @staticmethod
    def snapshot_part(references: DecodeReferences) -> ReferencesPart:
        return ReferencesPart(references)
