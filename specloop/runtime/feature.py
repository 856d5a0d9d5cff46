"""What the core asks of the parts of the engine it does not name: the FlashLoop features.

A `Feature` is one update's entry point (each package's `feature.py`): its size, then its
halves as the composition root (`specloop.engine.build`) asks for them: prompt planning,
a record pool beside the pages, a KV format, a row attention, a forward-batch part, a
device half (`DeviceFeature`, called by the runner around a forward call) and a snapshot
part (`SnapshotPart`).

The snapshot of a request (`specloop.engine.snapshot`) is the union of what its parts
capture: the core's own (KV pages, token slots, the request cell) and each FlashLoop
feature's (`specloop.flashloop.*`), which the composition root (`specloop.engine.build`)
hands the snapshotter. The core names no feature: a part that is off is an `Absent` part,
which keeps its key in the format and refuses a snapshot that carries state for it.

Every part sizes itself from one `Sizing` at start-up (device bytes outside the page pool,
token slots, the forward batch's room for its integers).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from specloop.errors import SnapshotError


class SnapshotPart(Protocol):
    """One owner of a running request's state, carried under `key` of the snapshot's dict."""

    key: str

    def capture(self, req: Any) -> Any:
        """The request's state (plain values and host tensors that own their storage), at a
        legal point: no ticket in flight holds its rows."""

    def check(self, data: dict[str, Any]) -> None:
        """Raise SnapshotError, changing nothing, when this engine cannot restore the part of
        `data` (a snapshot's whole dict, of a running request) that it owns."""

    def restore(self, req: Any, data: dict[str, Any]) -> None:
        """Write the part's state for `req` (its token slots and cell already taken) from `data`."""


class Absent:
    """The part of a feature that is off: it captures nothing and refuses state for it."""

    def __init__(self, key: str, option: str) -> None:
        self.key, self.option = key, option

    def capture(self, req: Any) -> None:
        return None

    def check(self, data: dict[str, Any]) -> None:
        if data.get(self.key) is not None:
            raise SnapshotError(f"the snapshot of {data['request']['request_id']!r} holds {self.key} state and "
                                f"this engine has {self.option} off")

    def restore(self, req: Any, data: dict[str, Any]) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Sizing:
    """What start-up knows when the engine's parts size themselves (`specloop.engine.build`):
    the configuration (`EngineConfig`), the model's (`ModelConfig`), and what was resolved
    from them."""

    config: Any
    model: Any
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    speculation: Any  # the speculation controller (its rows_per_request), None without
    triton: bool  # the attention backend is Triton (its kernels keep a scores scratch)

    @property
    def rows(self) -> int:
        """Rows of one forward call (max_num_batched_tokens)."""
        return self.config.max_num_batched_tokens

    @property
    def rows_per_request(self) -> int:
        """Rows one request may run in one call past its committed tokens (1 without speculation)."""
        return self.speculation.rows_per_request if self.speculation is not None else 1


class DeviceFeature(Protocol):
    """A FlashLoop feature's device half: what the runner calls around one forward call, in
    the order the composition root lists the features. Nothing here may read a device value
    back to the host."""

    def prepare(self, batch: Any) -> None:
        """Before any row is embedded or read (`ForwardBatch`): apply what the plan brings."""

    def start_pass(self, lp: Any, keep: torch.Tensor | None) -> None:
        """Before the backend builds loop pass `lp` (`LoopPass`; `keep`: rows whose token
        exited, adaptive exit): inside a CUDA graph's capture too."""

    def finish(self, batch: Any, final: torch.Tensor) -> torch.Tensor | None:
        """After the last pass, before the heads (`final`: each row's output after its last
        loop, which this may amend). Returns a device tensor the ticket hands the host (a
        packed format's releasable tail pages, `TicketOutput.released`), else None."""

    def stats(self) -> dict[str, int]:
        """The feature's `EngineStats` fields, from host copies (no device read)."""


class Feature(Protocol):
    """One FlashLoop feature as the composition root sees it (`specloop.engine.build`): its
    size, then each of its halves, built in this order once the core has what they need. A
    hook that does not apply returns None (`FeatureDefaults` has every default)."""

    option: str  # its configuration group
    snapshot_key: str | None  # its share of a request snapshot (None: it keeps none of its own)

    def reserved_bytes(self) -> int:
        """Device bytes it holds outside the page pool, taken off the KV budget first."""

    def split(self, budget: int, page_bytes: int) -> int | None:
        """The pages of the page pool when the rest of a byte budget (`budget` bytes) is
        shared with what the feature keeps beside the pages (None: all of it is pages)."""

    def decode_slots(self) -> int:
        """Token slots of the decode sub-pool generated tokens take (0: none)."""

    def keeps_previous(self) -> bool:
        """Whether token slots keep the hidden state before their last loop."""

    def prompts(self) -> Any:
        """Its `PromptPlanning` (`specloop.scheduling.prompts`), or None."""

    def attach_kv(self, kv: Any, num_pages: int, budget: Any) -> None:
        """Size what it keeps beside the KV manager's pages (`KVManager`; `budget()`: the KV
        byte budget)."""

    def kv_format(self, shape: tuple) -> Any:
        """The KV format it stores keys in (`PagedKV(*shape)`'s kind), or None."""

    def row_attention(self) -> Any:
        """Its `RowAttention` (`specloop.runtime.attention`), or None."""

    def batch_part(self, general_slots: int, pad_slot: int) -> Any:
        """Its `BatchPart` (`specloop.runtime.forward_batch`), or None; `general_slots`: the
        token slots outside the decode sub-pool, `pad_slot` the sink slot."""

    def device(self, slots: Any, store: Any) -> DeviceFeature | None:
        """Its device half over the token slots (`SlotStorage`) and the KV format, or None."""

    def snapshot_part(self, kv: Any, store: Any) -> SnapshotPart:
        """Its `SnapshotPart` (keyed `snapshot_key`; asked only when that is set)."""


class FeatureDefaults:
    """Every `Feature` hook's default: nothing reserved, no budget shared, no half."""

    snapshot_key: str | None = None

    def reserved_bytes(self) -> int:
        return 0

    def split(self, budget: int, page_bytes: int) -> int | None:
        return None

    def decode_slots(self) -> int:
        return 0

    def keeps_previous(self) -> bool:
        return False

    def prompts(self) -> Any:
        return None

    def attach_kv(self, kv: Any, num_pages: int, budget: Any) -> None:
        pass

    def kv_format(self, shape: tuple) -> Any:
        return None

    def row_attention(self) -> Any:
        return None

    def batch_part(self, general_slots: int, pad_slot: int) -> Any:
        return None

    def device(self, slots: Any, store: Any) -> DeviceFeature | None:
        return None
