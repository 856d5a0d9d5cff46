"""Model configuration: the Ouro shape read from a checkpoint's `config.json`.

`ModelConfig` is immutable and validated once; everything below it (layers, cache,
reference) reads shapes from here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from specloop.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("ouro",)
SUPPORTED_ACTIVATIONS = ("silu",)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of an Ouro-style looped transformer.

    `num_hidden_layers` is the physical stack (L); `total_ut_steps` is the number of
    loops (R) the stack is applied. `early_exit_threshold` is the Q-exit threshold q;
    q >= 1.0 means every token runs every loop.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    total_ut_steps: int = 4
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 65536
    early_exit_threshold: float = 1.0
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "total_ut_steps",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not 0.0 <= self.early_exit_threshold <= 1.0:
            raise ConfigError(
                f"early_exit_threshold must lie in [0, 1], got {self.early_exit_threshold}"
            )
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings=true is not supported (Ouro unties lm_head)")

    @property
    def num_loops(self) -> int:
        """R: how many times the layer stack is applied."""
        return self.total_ut_steps

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """K and V of one token over every (loop, layer) plane."""
        per_layer = 2 * self.num_key_value_heads * self.head_dim * bytes_per_element
        return per_layer * self.num_hidden_layers * self.num_loops

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` content of an Ouro checkpoint with this shape."""
        eos: Any = list(self.eos_token_ids)
        if len(eos) == 1:
            eos = eos[0]
        return {
            "architectures": ["OuroForCausalLM"],
            "model_type": "ouro",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "total_ut_steps": self.total_ut_steps,
            "early_exit_threshold": self.early_exit_threshold,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": "bfloat16",
        }

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Validate a Hugging Face Ouro config dict; one clear error for anything unsupported."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}: specloop serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if raw.get("rope_scaling") not in (None, {}):
            raise ConfigError(f"rope_scaling is not supported, got {raw['rope_scaling']!r}")
        if _uses_sliding_window(raw):
            raise ConfigError("sliding-window attention is not supported")
        act = raw.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"hidden_act {act!r} is not supported (only silu)")
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ConfigError("attention or MLP biases are not supported by the Ouro architecture")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ConfigError(f"config.json lacks required field(s): {', '.join(missing)}")
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or _divide(raw["hidden_size"], heads, "hidden_size", "num_attention_heads")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            total_ut_steps=raw.get("total_ut_steps", 4),
            rope_theta=float(raw.get("rope_theta", 1_000_000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings", 65536),
            early_exit_threshold=float(raw.get("early_exit_threshold", 1.0)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_hf_dict(raw)


def _uses_sliding_window(raw: dict[str, Any]) -> bool:
    if "use_sliding_window" in raw:
        return bool(raw["use_sliding_window"])
    if any(t != "full_attention" for t in raw.get("layer_types") or []):
        return True
    return raw.get("sliding_window") is not None


def _divide(a: Any, b: Any, a_name: str, b_name: str) -> int:
    if not isinstance(a, int) or not isinstance(b, int) or b < 1 or a % b:
        raise ConfigError(f"{a_name} ({a!r}) must be a multiple of {b_name} ({b!r})")
    return a // b
