"""Batch-1 decode cost per forward call on CUDA: a quick A/B probe for eager overhead.

    python bench/decode_forward.py /tmp/ouro14 LABEL

One request at a time (64-token prompt, 64 greedy output tokens, bf16), three runs after
a warm-up; prints wall milliseconds per forward call for each run and their median.
Forward calls at this size are launch-bound, so the number tracks host-side op count.
"""

from __future__ import annotations

import sys
import time

import torch

from specloop.engine.config import EngineConfig
from specloop.engine.core import EngineCore
from specloop.sampling_params import SamplingParams


def main() -> None:
    model, label = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
    engine = EngineCore(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_num_seqs=4,
                                     kv_cache_bytes=2 << 30))
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompt = list(range(10, 74))
    engine.add_request("warm-up", prompt, params)
    engine.drain()
    runs = []
    for r in range(3):
        torch.cuda.synchronize()
        start, calls = time.perf_counter(), engine.executor.num_submitted
        engine.add_request(f"r{r}", prompt, params)
        engine.drain()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - start) * 1e3 / (engine.executor.num_submitted - calls))
    print(label, "ms/forward runs:", " ".join(f"{x:.2f}" for x in runs), "median", f"{sorted(runs)[1]:.2f}")


if __name__ == "__main__":
    main()
