"""Loading an Ouro checkpoint from a Hugging Face folder, strictly and frugally.

The model is built on the meta device and every tensor is read from safetensors straight
into its final dtype and device, one at a time: a bf16 model never has an fp32 copy in
memory. Names, shapes and dtypes are checked against the config before anything loads.
No checkpoint code is ever executed.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
from safetensors import safe_open

from specloop.checkpoint.safetensors_files import FLOAT_DTYPES, read_header, weight_files
from specloop.config import ModelConfig
from specloop.errors import CheckpointError
from specloop.model.layers import Rotary
from specloop.model.ouro import OuroModel

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float64": torch.float64}  # float64: for exact comparisons in tests


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on CUDA and fp32 on CPU (CPU bf16 matmuls are slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an Ouro checkpoint of this shape must hold, and nothing else."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "model.early_exit_gate.weight": (1, h),
        "model.early_exit_gate.bias": (1,),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "input_layernorm_2.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "post_attention_layernorm_2.weight": (h,),
        })
    return shapes


def check_tensors(folder: Path, cfg: ModelConfig) -> dict[str, Path]:
    """Strict name/shape/dtype check of the folder's tensors against the config."""
    files = weight_files(folder)
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(files))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]}{more}")
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"checkpoint has unexpected tensor {unexpected[0]}{more}")
    for path in sorted(set(files.values())):
        for name, info in read_header(path).items():
            if name not in expected:
                raise CheckpointError(f"{path.name} holds unexpected tensor {name}")
            if files[name] != path:
                raise CheckpointError(f"tensor {name} is in {path.name} but the index names {files[name].name}")
            if tuple(info["shape"]) != expected[name]:
                raise CheckpointError(f"tensor {name} has shape {tuple(info['shape'])}, "
                                      f"expected {expected[name]} from config.json")
            if info["dtype"] not in FLOAT_DTYPES:
                raise CheckpointError(f"tensor {name} has dtype {info['dtype']}, expected one of "
                                      f"{', '.join(FLOAT_DTYPES)}")
    return files


@dataclasses.dataclass(frozen=True)
class LoadReport:
    seconds: float
    bytes_loaded: int
    num_tensors: int


def load_config(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    if not folder.is_dir():
        if folder.exists():
            raise CheckpointError(f"{folder} is not a checkpoint folder: give the folder that holds config.json "
                                  "and the safetensors weights")
        raise CheckpointError(f"model folder {folder} does not exist")
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder} has no config.json")
    return ModelConfig.from_file(config_path)


def load_model(
    folder: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
    config: ModelConfig | None = None,
) -> tuple[OuroModel, LoadReport]:
    """Build the model from a checkpoint folder; returns the model in eval mode and a report."""
    start = time.perf_counter()
    folder = Path(folder)
    cfg = config or load_config(folder)
    device = torch.device(device)
    target = resolve_dtype(dtype, device)
    files = check_tensors(folder, cfg)
    with torch.device("meta"):
        model = OuroModel(cfg)
    loaded = 0
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in sorted(by_file.items()):
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in names:
                    tensor = f.get_tensor(name).to(target)
                    _assign(model, name, tensor)
                    loaded += tensor.numel() * tensor.element_size()
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {path.name}: {exc}") from None
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta).to(device)
    model.eval()
    report = LoadReport(seconds=time.perf_counter() - start, bytes_loaded=loaded, num_tensors=len(files))
    return model, report


def _assign(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    owner._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
