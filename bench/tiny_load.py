"""Time loading the tiny random checkpoint and running one 16-token prefill plus 8 decode
tokens on CPU (fp32). Usage: python bench/tiny_load.py --out bench/results/tiny_load_cpu.json"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from specloop.checkpoint import load_model, load_tokenizer
from specloop.checkpoint.random_checkpoint import PRESETS, write_random_checkpoint
from specloop.model.stepper import LoopStepper


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, PRESETS["tiny"], seed=0)
        load_model(tmp)  # warm imports and the page cache
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            model, _ = load_model(tmp)
            load_tokenizer(tmp)
            stepper = LoopStepper(model, max_seqs=1, max_len=32)
            seq = stepper.add_sequence(list(range(3, 19)))
            stepper.greedy(seq, 8)
            times.append(time.perf_counter() - t0)
    result = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "what": "load tiny checkpoint + tokenizer, prefill 16 tokens, greedy 8 tokens (fp32)",
        "seconds_median": sorted(times)[len(times) // 2],
        "seconds_all": [round(t, 4) for t in times],
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
