"""specloop: a serving runtime for looped (recurrent-depth) language models.

The public names load lazily, so importing a torch-free module such as
`specloop.scheduling.kv_manager` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from specloop.config import ModelConfig
from specloop.errors import CheckpointError, ConfigError, InvalidRequestError, SpecloopError

__version__ = "0.1.0"

_LAZY = {
    "AsyncEngine": "specloop.engine.async_engine",
    "EngineConfig": "specloop.engine.config",
    "SamplingParams": "specloop.sampling_params",
    "LLM": "specloop.llm",
}

__all__ = ["AsyncEngine", "CheckpointError", "ConfigError", "EngineConfig", "InvalidRequestError", "LLM",
           "ModelConfig", "SamplingParams", "SpecloopError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specloop' has no attribute {name!r}")
