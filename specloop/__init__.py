"""specloop: a serving runtime for looped (recurrent-depth) language models."""

from specloop.config import ModelConfig
from specloop.errors import CheckpointError, ConfigError, SpecloopError

__version__ = "0.1.0"

__all__ = ["CheckpointError", "ConfigError", "ModelConfig", "SpecloopError", "__version__"]
