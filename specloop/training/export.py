"""Writing a trained model as an ordinary Ouro checkpoint folder.

The folder is exactly what `specloop.checkpoint.load_model` / `load_tokenizer` read:
config.json from `ModelConfig.to_hf_dict`, one `model.safetensors` (bf16 by default)
holding the state dict under the Hugging Face Ouro names, and the tokenizer files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from specloop.checkpoint.loader import expected_shapes
from specloop.model.ouro import OuroModel

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def checkpoint_tensors(model: OuroModel, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The state dict cast to `dtype`, checked name for name against the loader's list."""
    state = {name: t.detach().to("cpu", dtype).contiguous() for name, t in model.state_dict().items()}
    expected = expected_shapes(model.config)
    if set(state) != set(expected):
        raise RuntimeError(f"state dict names differ from the checkpoint layout: "
                           f"{sorted(set(state) ^ set(expected))[:4]}")
    return state


def write_checkpoint(
    model: OuroModel, folder: Path, tokenizer_from: Path | None, dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """config.json + model.safetensors (+ the tokenizer files copied from `tokenizer_from`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(model, dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = model.config.to_hf_dict()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if tokenizer_from is not None and Path(tokenizer_from).resolve() != folder.resolve():
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(tokenizer_from) / name, folder / name)
    return folder


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).iterdir() if p.is_file())
