"""specloop: a serving runtime for looped (recurrent-depth) language models."""

from specloop.config import ModelConfig
from specloop.engine.async_engine import AsyncEngine
from specloop.engine.config import EngineConfig
from specloop.engine.sampling_params import SamplingParams
from specloop.errors import CheckpointError, ConfigError, InvalidRequestError, SpecloopError
from specloop.llm import LLM

__version__ = "0.1.0"

__all__ = ["AsyncEngine", "CheckpointError", "ConfigError", "EngineConfig", "InvalidRequestError", "LLM",
           "ModelConfig", "SamplingParams", "SpecloopError", "__version__"]
