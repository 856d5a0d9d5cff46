"""Sparse decode attention's part of a request snapshot (`references`): the loop-2 reference
state of the request's live generated tokens (kept keys cut to the largest count, count, m,
O_ref, C_ref, which layers hold it), in position order; it restores into decode slots."""

from __future__ import annotations

from typing import Any

import torch

from specloop.errors import SnapshotError
from specloop.flashloop.sparse_decode.references import DecodeReferences
from specloop.scheduling.request import Request


def _generated(req: Request) -> list[int]:
    """The live positions of generated tokens (they hold decode slots), ascending."""
    return [p for p in sorted(req.token_slots) if p >= len(req.prompt_ids)]


class ReferencesPart:
    key = "references"

    def __init__(self, references: DecodeReferences) -> None:
        self.references = references

    def capture(self, req: Request) -> dict[str, Any]:
        refs = self.references
        positions = _generated(req)
        index = torch.tensor([req.token_slots[p] for p in positions], dtype=torch.long, device=refs.keys.device)
        width = int(refs.count[index].max()) if positions else 0
        return refs.capture(index, width)

    def check(self, data: dict[str, Any]) -> None:
        refs, rid = data.get("references"), data["request"]["request_id"]
        if refs is None:
            raise SnapshotError(f"the snapshot of {rid!r} lacks the reference state and this engine has "
                                f"sparse_decode_attention on")
        if refs["keys"].shape[-1] > self.references.capacity:
            raise SnapshotError(f"restoring {rid!r} needs {refs['keys'].shape[-1]} kept keys per head; this "
                                f"engine's max_model_len keeps at most {self.references.capacity}")

    def restore(self, req: Request, data: dict[str, Any]) -> None:
        """Write the generated tokens' state into their new decode slots (keys padded with -1
        to this engine's capacity)."""
        slots = [req.token_slots[p] for p in _generated(req)]
        if slots:
            store = self.references
            store.restore(torch.tensor(slots, dtype=torch.long, device=store.keys.device), data["references"])
