"""Sparse decode attention as a `Feature`: the decode sub-pool of token slots, the reference
state those slots own (sized off the KV budget), its row attention in the backends, its
forward-batch part, its device half and its snapshot part."""

from __future__ import annotations

from typing import Any

from specloop.flashloop.config import SparseDecodeAttention
from specloop.flashloop.sparse_decode.attention import SparseDecodeStep
from specloop.flashloop.sparse_decode.batch import SparseDecodeBatch
from specloop.flashloop.sparse_decode.device import ReferencesDevice
from specloop.flashloop.sparse_decode.references import DecodeReferences
from specloop.flashloop.sparse_decode.snapshot import ReferencesPart
from specloop.runtime.feature import FeatureDefaults, Sizing


class SparseDecodeFeature(FeatureDefaults):
    option = "sparse_decode_attention"
    snapshot_key = ReferencesPart.key

    @staticmethod
    def enabled(config: Any) -> bool:
        return config.sparse_decode_attention.enabled

    def __init__(self, group: SparseDecodeAttention, s: Sizing) -> None:
        self.group, self.s = group, s
        # the Triton kernels' scores scratch, sized by a pass's rows (the torch references need none)
        self.scratch_rows = s.rows if s.triton else 0
        self._references: DecodeReferences | None = None

    def decode_slots(self) -> int:
        """Slots of the decode sub-pool (generated tokens'). A request holds a generated
        token's slot for each of its rows in flight (a round's, or a pipeline's live tokens)
        in each ticket in flight and the one being planned."""
        cfg = self.s.config
        return cfg.max_num_seqs * self.s.rows_per_request * (cfg.max_inflight_tickets + 1)

    def _shape(self) -> tuple:
        m, s = self.s.model, self.s
        return (self.decode_slots(), m.num_hidden_layers, m.num_attention_heads, m.head_dim, s.max_model_len,
                self.group.key_retention)

    def reserved_bytes(self) -> int:
        """Device bytes of the reference state and the scores scratch, off the KV budget."""
        return DecodeReferences.nbytes(*self._shape(), self.s.dtype, self.scratch_rows)

    @property
    def references(self) -> DecodeReferences:
        """The decode slots' reference state (allocated on first use)."""
        if self._references is None:
            self._references = DecodeReferences(*self._shape(), self.s.dtype, self.s.device, self.scratch_rows)
        return self._references

    def row_attention(self) -> SparseDecodeStep:
        return SparseDecodeStep(self.references)

    def batch_part(self, general_slots: int, pad_slot: int) -> SparseDecodeBatch:
        return SparseDecodeBatch(self.s.rows, self.s.model.num_loops)

    def device(self, slots: Any, store: Any) -> ReferencesDevice:
        return ReferencesDevice(self.references)

    def snapshot_part(self, kv: Any, store: Any) -> ReferencesPart:
        return ReferencesPart(self.references)
