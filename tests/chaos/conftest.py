"""The solo runs' engines and results, shared by every chaos run of one configuration."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.chaos.oracle import SoloRuns


@pytest.fixture(scope="session")
def solo_runs() -> Callable[[str, dict[str, Any], int], SoloRuns]:
    """`solo_runs(model, options, longest_greedy)`: one `SoloRuns` per model and configuration."""
    cache: dict[tuple, SoloRuns] = {}

    def get(model: str, options: dict[str, Any], longest_greedy: int) -> SoloRuns:
        alone = {k: v for k, v in options.items() if k != "preemption_mode"}  # nothing is preempted alone
        key = (model, tuple(sorted(alone.items())), longest_greedy)
        if key not in cache:
            cache[key] = SoloRuns(model, alone, longest_greedy)
        return cache[key]

    return get
