"""Time loading the tiny random checkpoint into the engine and running one 16-token prefill
plus 8 greedy tokens on CPU (fp32). Usage: python bench/tiny_load.py --out bench/results/tiny_load_cpu.json

The engine gets a 4 MiB KV pool (512 pages of 16 tokens in fp32): enough for this request, and
small enough that allocating the pool does not dominate the time."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from specloop import LLM, SamplingParams
from specloop.checkpoint import load_model
from specloop.checkpoint.random_checkpoint import PRESETS, write_random_checkpoint

KV_BYTES = 4 << 20


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
            llm = LLM(model=tmp, dtype="float32", device="cpu", kv_cache_bytes=KV_BYTES)  # loads model + tokenizer
            out = llm.generate(list(range(3, 19)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            times.append(time.perf_counter() - t0)
            assert len(out[0].token_ids) == 8
    result = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "what": "load tiny checkpoint + tokenizer into the engine (4 MiB KV), prefill 16 tokens, greedy 8 tokens (fp32)",
        "seconds_median": sorted(times)[len(times) // 2],
        "seconds_all": [round(t, 4) for t in times],
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
