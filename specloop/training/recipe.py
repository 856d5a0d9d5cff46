"""The default model's shape, its initialisation and the training hyper-parameters.

Sizing: the whole shipped folder must stay under 16 MB, so the model has about 7.2 M
parameters (14.4 MB in bf16): vocabulary 4096, hidden 256, 6 physical layers applied 4
times (24 layer applications per token), 4 heads of 64, SwiGLU width 768, untied lm_head.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from specloop.config import ModelConfig
from specloop.model.ouro import OuroModel

DEFAULT_MODEL = ModelConfig(
    vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=4, head_dim=64, total_ut_steps=4,
    rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=4096,
    early_exit_threshold=1.0, eos_token_ids=(0,), bos_token_id=None,
)

TINY_TEST_MODEL = dataclasses.replace(
    DEFAULT_MODEL, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run besides the corpus."""

    seed: int = 0
    seq_len: int = 4096  # the trained context: long enough for FlashLoop's prompt windows
    batch_size: int = 8  # 32K tokens a step, as at the first recipe's 32 x 1024
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    gate_beta: float = 0.1  # entropy weight of the exit-gate objective
    max_epochs: float = 16.0  # passes over the train stream
    max_steps: int = 100_000
    time_budget_s: float = 420.0  # the step count is fitted to this after a timed warm-up
    eval_every: int = 100
    eval_windows: int = 128
    log_every: int = 20


def init_model(cfg: ModelConfig, seed: int) -> OuroModel:
    """A freshly initialised fp32 model.

    Projections and lm_head N(0, 0.02); embedding N(0, 1) (sandwich norms rescale every
    branch to unit RMS, so the embedding is kept at the same scale); norm weights 1; the
    exit gate starts at weight 0, bias 0 (lambda = 1/2 everywhere).
    """
    torch.manual_seed(seed)
    model = OuroModel(cfg)
    for name, param in model.named_parameters():
        if name == "model.embed_tokens.weight":
            nn.init.normal_(param, std=1.0)
        elif name.startswith("model.early_exit_gate"):
            nn.init.zeros_(param)
        elif param.ndim == 2:
            nn.init.normal_(param, std=0.02)
        else:
            nn.init.ones_(param)
    return model


def param_groups(model: OuroModel, weight_decay: float) -> list[dict]:
    """Weight decay on the projection matrices and lm_head only (not embedding, norms, gate)."""
    def decays(name: str) -> bool:
        return name.endswith("proj.weight") or name == "lm_head.weight"

    decay = [p for n, p in model.named_parameters() if decays(n)]
    no_decay = [p for n, p in model.named_parameters() if not decays(n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio * lr` at `total`."""
    import math

    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
