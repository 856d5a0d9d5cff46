"""Model files shipped inside the package: the default trained looped model.

`default_model_path()` is the checkpoint folder `specloop generate` and `specloop serve`
use when no `--model` is given. It is ordinary package data (see pyproject.toml), so a
plain `pip install` carries it; `docs/default-model.md` says how it was trained.
"""

from __future__ import annotations

from pathlib import Path

from specloop.errors import CheckpointError

DEFAULT_MODEL_DIR = "default_model"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model_path() -> Path:
    """The folder of the shipped default model; a clear error if the install lacks it."""
    folder = Path(__file__).resolve().parent / DEFAULT_MODEL_DIR
    missing = [name for name in _REQUIRED if not (folder / name).is_file()]
    if missing:
        raise CheckpointError(f"the default model is not installed ({folder} lacks {', '.join(missing)}); "
                              "reinstall specloop or pass --model")
    return folder
