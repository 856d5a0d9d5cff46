"""Summary of bench/ab.sh's interleaved A/B: one JSON and a table, old against new.

Usage (bench/ab.sh calls it last; standard library only, imports nothing from specloop):
    python bench/ab_summary.py --runs /tmp/ab/runs.tsv --out $OUT/ab_summary.json [--meta key=value ...]

--runs: one line per run, tab-separated: round, side (old / new), part (baseline /
flashloop), exit status (or `skipped`), wall seconds, its JSON, its log. Metrics:
- baseline (bench/baseline.py): batch-1 decode after 8K (`batch1_decode_after_8k.tokens_per_s`)
  and the 8K prompt's TTFT (`prefill_8k.ttft_s`) first, then its other cases (batch-1 after
  1K, batch-32 aggregate, 128 concurrent) and the 8K prefill's peak CUDA memory;
- flashloop (bench/flashloop_speed.py): per `variant/speculation` and case, decode tok/s
  (`decode_tok_s`), time to the last first token (`ttft_last_s`) and time per output token
  (`tpot_ms`).
Per metric: each side's per-round values (round order), medians, new/old of the medians,
the median of the per-round new/old ratios (`paired`), and a flag: `WORSE` when the new
median is worse than every old value and than the old median by over --tolerance (1%),
`better` likewise the other way, else `~`.
The out JSON holds the meta, the runs (with each log's last lines), the table and every
run's raw JSON; the table is printed and written beside it as ab_table.txt.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

Getter = Callable[[dict[str, Any]], Any]

BASELINE: list[tuple[str, str, str, Getter]] = [  # name, unit, better, value
    ("baseline b1 decode after 8K", "tok/s", "higher", lambda d: d["batch1_decode_after_8k"]["tokens_per_s"]),
    ("baseline 8K TTFT", "s", "lower", lambda d: d["prefill_8k"]["ttft_s"]),
    ("baseline b1 decode after 1K", "tok/s", "higher", lambda d: d["batch1_decode"]["tokens_per_s"]),
    ("baseline b32 decode after 1K", "tok/s", "higher", lambda d: d["batch32_decode"]["aggregate_tokens_per_s"]),
    ("baseline 128 x 1K/128", "tok/s", "higher", lambda d: d["concurrent128"]["output_tokens_per_s"]),
    ("baseline 8K peak CUDA", "GiB", "lower", lambda d: d["prefill_8k"]["peak_cuda_gib"]),
]
FLASHLOOP_FIELDS = [("decode", "decode_tok_s", "tok/s", "higher"), ("TTFT", "ttft_last_s", "s", "lower"),
                    ("TPOT", "tpot_ms", "ms", "lower")]


def read_runs(path: Path) -> list[dict[str, Any]]:
    runs = []
    for line in path.read_text().splitlines() if path.exists() else []:
        r, side, part, rc, wall, js, log = line.split("\t")
        runs.append({"round": int(r), "side": side, "part": part, "rc": rc, "wall_s": float(wall),
                     "json": js, "log": log})
    return runs


def load(path: str) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def tail(path: str, lines: int) -> list[str]:
    try:
        return [s[:200] for s in Path(path).read_text(errors="replace").splitlines()[-lines:]]
    except OSError:
        return []


def number(get: Getter, d: dict[str, Any]) -> float | None:
    try:
        v = float(get(d))
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def metrics(part: str, d: dict[str, Any]) -> list[tuple[str, str, str, float | None]]:
    """(name, unit, better, value) of one run's JSON, in table order."""
    if part == "baseline":
        return [(name, unit, better, number(get, d)) for name, unit, better, get in BASELINE]
    out = []
    for key, res in d.get("results", {}).items():
        for c in res.get("cases", []):
            label = f"{key.removesuffix('/none')} {c.get('requests')}x{c.get('prompt')}"
            for field_name, field, unit, better in FLASHLOOP_FIELDS:
                out.append((f"flashloop {label} {field_name}", unit, better, number(lambda x: x[field], c)))
    return out


def row(name: str, unit: str, better: str, old: dict[int, float], new: dict[int, float],
        tolerance: float) -> dict[str, Any]:
    om = statistics.median(old.values()) if old else None
    nm = statistics.median(new.values()) if new else None
    paired = [new[r] / old[r] for r in sorted(old) if r in new and old[r]]
    flag = ""
    if om and nm is not None:
        worse = min(old.values()) if better == "higher" else max(old.values())
        best = max(old.values()) if better == "higher" else min(old.values())
        sign = 1 if better == "higher" else -1
        change = sign * (nm / om - 1)  # > 0: new is better
        flag = ("WORSE" if sign * (nm - worse) < 0 and change < -tolerance
                else "better" if sign * (nm - best) > 0 and change > tolerance else "~")
    return {"metric": name, "unit": unit, "better": better,
            "old": [old[r] for r in sorted(old)], "new": [new[r] for r in sorted(new)],
            "old_rounds": sorted(old), "new_rounds": sorted(new), "old_median": om, "new_median": nm,
            "ratio": nm / om if om and nm is not None else None, "paired_ratios": paired,
            "paired_median": statistics.median(paired) if paired else None, "flag": flag}


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'metric':40s} {'unit':5s} {'old med':>8s} {'new med':>8s} {'new/old':>7s} {'paired':>7s} "
             f"{'flag':6s} old rounds | new rounds"]
    for r in rows:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        paired = f"{r['paired_median']:.3f}" if r["paired_median"] is not None else "-"
        lines.append(f"{r['metric'][:40]:40s} {r['unit']:5s} {fmt(r['old_median']):>8s} {fmt(r['new_median']):>8s} "
                     f"{ratio:>7s} {paired:>7s} {r['flag']:6s} {' '.join(fmt(v) for v in r['old'])} | "
                     f"{' '.join(fmt(v) for v in r['new'])}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--meta", action="append", default=[], help="key=value, kept in the out JSON")
    p.add_argument("--tolerance", type=float, default=0.01,
                   help="flag: a median moved by less than this fraction is `~` whatever the rounds")
    p.add_argument("--log-lines", type=int, default=12, help="each log's last lines kept")
    args = p.parse_args()
    runs = read_runs(args.runs)
    raw: dict[str, Any] = {}
    values: dict[str, dict[str, Any]] = {}  # metric -> unit, better, side -> round -> value
    for run in runs:
        d = load(run["json"]) if run["rc"] != "skipped" else None
        run["log_tail"] = tail(run["log"], args.log_lines) if run["rc"] != "skipped" else []
        if d is None:
            continue
        raw[Path(run["json"]).name] = d
        for name, unit, better, v in metrics(run["part"], d):
            m = values.setdefault(name, {"unit": unit, "better": better, "old": {}, "new": {}})
            if v is not None:
                m[run["side"]][run["round"]] = v
    rows = [row(name, m["unit"], m["better"], m["old"], m["new"], args.tolerance) for name, m in values.items()]
    primary = [r for r in rows if "after 1K" not in r["metric"] and "128 x" not in r["metric"]
               and "peak" not in r["metric"] and "TPOT" not in r["metric"]]
    rows = primary + [r for r in rows if r not in primary]
    meta = dict(kv.split("=", 1) for kv in args.meta)
    text = table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "runs": runs, "table": rows, "raw": raw}, indent=1))
    (args.out.parent / "ab_table.txt").write_text(text + "\n")
    done = sum(1 for r in runs if r["rc"] == "0")
    print(f"{done} of {len(runs)} runs finished; {args.out}")
    print(text)


if __name__ == "__main__":
    main()
