"""Step 2 of building the default model (GPU, minutes): train and write the checkpoint.

    python -m specloop.training.train --streams out/stdlib_tokens.npz \
        --out OUTDIR/default_model --log OUTDIR/default_model_train.json

AdamW with warm-up and cosine decay, bf16 autocast on CUDA (fp32 master weights), a
fixed seed for initialisation and batch order. The step count is the smaller of
`max_epochs` passes over the train stream and what fits the time budget, measured on the
first steps (pass `--steps` to fix it). The validation split is scored every
`eval_every` steps; the state with the lowest mean validation loss over the four loops is
the one written. The log JSON holds the command, the corpus manifest, the loss curve
(train and validation, per loop) and the timings.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specloop.model.ouro import OuroModel
from specloop.training.export import folder_bytes, write_checkpoint
from specloop.training.forward import batched_loops
from specloop.training.objective import looped_loss, per_token_ce
from specloop.training.recipe import DEFAULT_MODEL, TINY_TEST_MODEL, TrainConfig, init_model, lr_at, param_groups
from specloop.training.token_data import WindowSampler, fixed_windows, load_streams

DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "default_model"
CALIBRATION_STEPS = (10, 40)  # time steps 10..40 to fit the step count to the budget


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def validation_loss(model: OuroModel, windows: torch.Tensor, device: torch.device, batch: int = 16) -> list[float]:
    """Mean next-token CE of each loop over fixed windows [N, T] (full depth)."""
    model.eval()
    total = torch.zeros(model.config.num_loops, dtype=torch.float64, device=device)
    count = 0
    attn = torch.bfloat16 if device.type == "cuda" else None
    for start in range(0, windows.shape[0], batch):
        chunk = windows[start:start + batch].to(device)
        with _autocast(device):
            out = batched_loops(model, chunk[:, :-1], attention_dtype=attn)
            for r, h in enumerate(out.hidden):
                total[r] += per_token_ce(model.head(h), chunk[:, 1:]).double().sum()
        count += chunk[:, 1:].numel()
    model.train()
    return (total / count).tolist()


def train(
    streams: dict[str, Any], model_cfg: Any, cfg: TrainConfig, device: torch.device,
    steps: int | None = None, progress: bool = True,
) -> tuple[OuroModel, dict[str, Any]]:
    """Train from scratch; returns the best-validation model (fp32, on `device`) and the log."""
    model = init_model(model_cfg, cfg.seed).to(device)
    model.train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                                  fused=fused)
    sampler = WindowSampler(streams["train"], cfg.seq_len, cfg.batch_size, cfg.seed)
    valid = fixed_windows(streams["valid"], cfg.seq_len + 1, cfg.eval_windows)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    epoch_steps = math.ceil(cfg.max_epochs * streams["train"].size / tokens_per_step)
    total = steps if steps is not None else min(cfg.max_steps, epoch_steps)
    fitted = steps is not None
    attn = torch.bfloat16 if device.type == "cuda" else None
    log: dict[str, Any] = {"train": [], "valid": [], "planned_steps": total}
    best: dict[str, Any] = {"loss": float("inf"), "step": -1, "state": None}
    running = torch.zeros(model_cfg.num_loops + 3, dtype=torch.float64, device=device)
    running_n = 0
    start = time.perf_counter()
    calib_t0 = 0.0
    step = 0

    def evaluate(at: int) -> None:
        loop_ce = validation_loss(model, valid, device)
        mean = sum(loop_ce) / len(loop_ce)
        log["valid"].append({"step": at, "loop_ce": loop_ce, "mean_ce": mean,
                             "elapsed_s": time.perf_counter() - start})
        if mean < best["loss"]:
            best.update(loss=mean, step=at, state=copy.deepcopy(model.state_dict()))
        if progress:
            print(f"  valid @ {at}: loop CE " + " ".join(f"{x:.3f}" for x in loop_ce), flush=True)

    while step < total:
        if not fitted and step == CALIBRATION_STEPS[0]:
            _sync(device)
            calib_t0 = time.perf_counter()
        if not fitted and step == CALIBRATION_STEPS[1]:
            _sync(device)
            per_step = (time.perf_counter() - calib_t0) / (CALIBRATION_STEPS[1] - CALIBRATION_STEPS[0])
            per_step *= 1.0 + 0.05  # validation passes and the final export
            remaining = cfg.time_budget_s - (time.perf_counter() - start)
            total = max(step + 1, min(total, step + int(remaining / per_step)))
            fitted = True
            log.update(calibrated_step_s=per_step, planned_steps=total)
            if progress:
                print(f"  {per_step * 1e3:.1f} ms/step -> {total} steps "
                      f"({total * tokens_per_step / streams['train'].size:.1f} epochs)", flush=True)
        lr = lr_at(step, total, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = sampler.next_batch()
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with _autocast(device):
            out = batched_loops(model, inputs, attention_dtype=attn)
            ce = torch.stack([per_token_ce(model.head(h), targets) for h in out.hidden])
        parts = looped_loss(ce, out.gate_logits, cfg.gate_beta)
        optimizer.zero_grad(set_to_none=True)
        parts.total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        running += torch.cat([parts.total.detach()[None], parts.loop_ce, parts.gate[None],
                              parts.mean_exit[None]]).double()
        running_n += 1
        step += 1
        if step % cfg.log_every == 0 or step == total:
            values = (running / running_n).tolist()
            rec = {"step": step, "lr": lr, "loss": values[0], "loop_ce": values[1:-2], "gate": values[-2],
                   "mean_exit": values[-1], "tokens": step * tokens_per_step,
                   "elapsed_s": time.perf_counter() - start}
            log["train"].append(rec)
            running.zero_()
            running_n = 0
            if progress:
                print(f"step {step}/{total} lr {lr:.2e} loss {rec['loss']:.3f} loop CE "
                      + " ".join(f"{x:.3f}" for x in rec["loop_ce"])
                      + f" exit {rec['mean_exit']:.2f} {rec['elapsed_s']:.0f}s", flush=True)
        if step % cfg.eval_every == 0 or step == total:
            evaluate(step)
    _sync(device)
    seconds = time.perf_counter() - start
    model.load_state_dict(best["state"])
    log.update(steps=step, best_step=best["step"], best_valid_mean_ce=best["loss"], train_seconds=seconds,
               tokens=step * tokens_per_step, tokens_per_s=step * tokens_per_step / seconds,
               epochs=step * tokens_per_step / streams["train"].size)
    return model, log


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specloop.training.train", description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=Path, default=None,
                   help="tokenised splits from specloop.training.prepare (default: tokenise the running stdlib)")
    p.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="folder with tokenizer.json")
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    p.add_argument("--log", type=Path, required=True, help="training log JSON to write")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=None, help="fix the step count (no time fitting)")
    p.add_argument("--tiny", action="store_true", help="a tiny model, for smoke tests on the CPU")
    for field in dataclasses.fields(TrainConfig):
        if field.name == "betas":
            continue
        kind = type(field.default)
        p.add_argument("--" + field.name.replace("_", "-"), type=kind, default=field.default)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if f.name != "betas"})
    device = torch.device(args.device)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.streams is not None:
        streams, manifest = load_streams(args.streams)
    else:
        from tokenizers import Tokenizer

        from specloop.training.token_data import build_streams

        streams, manifest = build_streams(Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")))
    model_cfg = TINY_TEST_MODEL if args.tiny else DEFAULT_MODEL
    print(f"corpus: Python {manifest['python']} stdlib, " + ", ".join(
        f"{k} {v['files']} files / {v['tokens']} tokens" for k, v in manifest["splits"].items()), flush=True)
    print(f"model: {model_cfg.num_hidden_layers} layers x {model_cfg.num_loops} loops, "
          f"hidden {model_cfg.hidden_size}, vocab {model_cfg.vocab_size}; device {device}", flush=True)
    model, log = train(streams, model_cfg, cfg, device, steps=args.steps)
    write_checkpoint(model, args.out, args.tokenizer)
    log.update(
        command="python -m specloop.training.train " + " ".join(argv if argv is not None else sys.argv[1:]),
        train_config=dataclasses.asdict(cfg), model_config=model_cfg.to_hf_dict(), corpus=manifest,
        parameters=sum(p.numel() for p in model.parameters()), checkpoint_bytes=folder_bytes(args.out),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, python=platform.python_version(),
    )
    args.log.parent.mkdir(parents=True, exist_ok=True)
    args.log.write_text(json.dumps(log, indent=1) + "\n")
    print(f"done: {log['steps']} steps in {log['train_seconds']:.0f}s ({log['tokens_per_s']:.0f} tokens/s, "
          f"{log['epochs']:.1f} epochs); best valid mean CE {log['best_valid_mean_ce']:.3f} at step "
          f"{log['best_step']}; checkpoint {log['checkpoint_bytes'] / 1e6:.2f} MB -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
