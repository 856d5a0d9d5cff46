"""Plot the default model's loss curve from its training log (runs on the CPU; needs matplotlib).

    python bench/plot_default_model_loss.py bench/results/default_model_train.json \
        bench/results/default_model_loss.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(log_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = json.loads(log_path.read_text())
    fig, (ax, ax_exit) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    train_steps = [r["step"] for r in log["train"]]
    valid_steps = [r["step"] for r in log["valid"]]
    for loop, color in enumerate(colors):
        ax.plot(train_steps, [r["loop_ce"][loop] for r in log["train"]], color=color, alpha=0.35, lw=0.8)
        ax.plot(valid_steps, [r["loop_ce"][loop] for r in log["valid"]], color=color, lw=1.8, marker=".",
                label=f"loop {loop + 1} (validation; faint: train)")
    ax.axvline(log["best_step"], color="grey", ls="--", lw=1, label=f"kept: step {log['best_step']}")
    ax.set_ylim(1.0, 3.5)
    train_cfg = log["train_config"]
    ax.set_xlabel(f"step ({train_cfg['batch_size']} x {train_cfg['seq_len']} tokens)")
    ax.set_ylabel("next-token cross-entropy (nats)")
    ax.set_title(f"default looped model: {log['parameters'] / 1e6:.1f} M params, {log['epochs']:.1f} epochs, "
                 f"{log['train_seconds']:.0f} s on {log['device']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax_exit.plot(train_steps, [r["mean_exit"] for r in log["train"]], color="black")
    ax_exit.set_xlabel("step")
    ax_exit.set_ylabel("expected exit loop under the gate")
    ax_exit.set_ylim(1, 4)
    ax_exit.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


if __name__ == "__main__":
    plot(Path(sys.argv[1]), Path(sys.argv[2]))
