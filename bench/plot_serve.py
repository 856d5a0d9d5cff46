"""Plot output tok/s and TPOT against concurrency from `bench/serve.py` JSONs (issue 39 item 4).

    python bench/plot_serve.py docs/serve_concurrency.png bench/results/serve_sweep_*.json

Each JSON is one run of bench/serve.py; runs are grouped into lines by their label with the
concurrency taken off ("..., concurrency 64" -> "..."), one point per concurrency. Runs on
the CPU; needs matplotlib (not a dependency of the package).
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path


def series(paths: list[Path]) -> dict[str, list[tuple[int, float, float]]]:
    """label -> [(concurrency, output tok/s, TPOT p50 ms)] sorted by concurrency."""
    out: dict[str, list[tuple[int, float, float]]] = collections.defaultdict(list)
    for path in paths:
        run = json.loads(path.read_text())
        concurrency = run["config"]["concurrency"]
        label = re.sub(r",?\s*concurrency \d+", "", run.get("label") or path.stem).strip() or path.stem
        out[label].append((concurrency, run["output_token_throughput_tps"], run["tpot_ms"]["p50"]))
    return {k: sorted(v) for k, v in sorted(out.items())}


def plot(png: Path, paths: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.2))
    ticks = set()
    for label, points in series(paths).items():
        ticks.update(p[0] for p in points)
        c = [p[0] for p in points]
        ax_tps.plot(c, [p[1] for p in points], marker="o", label=label)
        ax_tpot.plot(c, [p[2] for p in points], marker="o", label=label)
    for ax, title in ((ax_tps, "output tokens/s"), (ax_tpot, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_tps.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    plot(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
