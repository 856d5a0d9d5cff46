"""Token-sparse prefill as a `Feature`: prompts planned in windows, token slots that keep
their previous hidden state, the windows' share of the forward batch and the device half
that selects. Its snapshot state rides in the core's parts (the slots' previous state and
selection, the request's window progress)."""

from __future__ import annotations

import math
from typing import Any

from specloop.errors import ConfigError
from specloop.flashloop.config import TokenSparsePrefill
from specloop.flashloop.token_sparse_prefill.batch import WINDOW_INFO, WindowBatchPart
from specloop.flashloop.token_sparse_prefill.device import WindowDevice
from specloop.flashloop.token_sparse_prefill.host import WindowedPrompts
from specloop.runtime.feature import FeatureDefaults, Sizing


class TokenSparsePrefillFeature(FeatureDefaults):
    option = "token_sparse_prefill"

    @staticmethod
    def enabled(config: Any) -> bool:
        return config.token_sparse_prefill.active  # (retention 1.0 everywhere takes the dense path)

    def __init__(self, group: TokenSparsePrefill, s: Sizing) -> None:
        self.group, self.s = group, s
        self._prompts = WindowedPrompts(group)

    def keeps_previous(self) -> bool:
        return True  # the change score compares a slot's hidden state before and after a loop

    def prompts(self) -> WindowedPrompts:
        return self._prompts

    def upload_ints(self, num_token_slots: int) -> int:
        """Integers one plan's sparse prefill groups add to the forward batch. A group uploads
        a padded row of `window` token slots and its info; a complete group of a full window
        runs at least its budget, so at most rows / budget of them fit a plan, and each
        request and sparse depth may add a short last window and a window split by the
        budget. Each row the groups run adds three integers, each token they leave out two.
        `num_token_slots`: the general pool (prompt windows take none of the decode slots)."""
        sparse, rows, loops = self.group, self.s.rows, self.s.model.num_loops
        if sparse.window > num_token_slots:
            raise ConfigError(f"token_sparse_prefill.window ({sparse.window}) exceeds the engine's {num_token_slots} "
                              f"token slots: a window's tokens wait for each other before the sparse loops; raise "
                              f"max_num_batched_tokens or use a smaller window")
        least = min(sparse.budget(d, sparse.window) for d in range(2, loops))
        groups = math.ceil(rows / least) + 2 * self.s.config.max_num_seqs * (loops - 2)
        return groups * (3 * sparse.window + WINDOW_INFO) + 3 * rows

    def batch_part(self, general_slots: int, pad_slot: int) -> WindowBatchPart:
        return WindowBatchPart(self.upload_ints(general_slots), pad_slot, self.group.keep_last)

    def device(self, slots: Any, store: Any) -> WindowDevice:
        return WindowDevice(slots, store)
