"""Sparse decode attention's device half of a forward call (`DeviceFeature`): a token
entering loop 1 in a decode slot has no reference state until its loop 2 writes it; after
the passes the fallback count's host copy is refreshed behind the call's work. (The
attention step itself runs in the backend: `DecodeReferences.attend`.)"""

from __future__ import annotations

import torch

from specloop.runtime.forward_batch import ForwardBatch, LoopPass
from specloop.flashloop.sparse_decode.references import DecodeReferences


class ReferencesDevice:
    def __init__(self, references: DecodeReferences) -> None:
        self.references = references

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.enter_rows is not None:
            self.references.enter(batch.token_slots[batch.enter_rows])

    def start_pass(self, lp: LoopPass, keep: torch.Tensor | None) -> None:
        pass

    def finish(self, batch: ForwardBatch, final: torch.Tensor) -> None:
        self.references.publish()  # before the heads record the ticket's event

    def stats(self) -> dict[str, int]:
        """Corrections that ran dense (as of the last completed call) and the state's bytes."""
        refs = self.references
        return {"sparse_decode_fallbacks": int(refs.fallbacks_host),
                "sparse_decode_reference_bytes": refs.nbytes_held}
