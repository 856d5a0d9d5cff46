"""Greedy tokens of the serving engine on CUDA against the dense reference (fp64, CPU).

Usage: python bench/engine_gpu_check.py --out bench/results/engine_gpu_check.json
Runs the tiny random checkpoint in fp32 on the GPU (with adaptive exit on and off, several
requests in one batch, chunked prefill) and checks every token against the reference.
Then the same with block speculation and token pipelines (adaptive exit off), on the tiny
checkpoint (drafts mostly rejected: rollbacks) and on the shipped model (mostly accepted).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from specloop.checkpoint import load_model
from specloop.checkpoint.random_checkpoint import PRESETS, write_random_checkpoint
from specloop.sampling_params import SamplingParams
from specloop.llm import LLM, default_model
from specloop.model.reference import reference_greedy


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a dry run of the script


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results = []
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (1, 7, 30, 65, 130)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    speculation = [{"speculation": "block", "draft_loops": 1, "num_speculative_tokens": 4},
                   {"speculation": "block", "draft_loops": 2, "num_speculative_tokens": 2},
                   {"speculation": "pipeline", "draft_loops": 1}, {"speculation": "pipeline", "draft_loops": 3}]
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(tmp, PRESETS["tiny"], seed=1, dtype=torch.float32)
        for name, path in (("tiny", tmp), ("shipped", str(default_model()))):
            ref_model, _ = load_model(path, dtype=torch.float64)
            weights = {n: t for n, t in ref_model.named_parameters()}
            refs = {}
            cases = [({"exit_threshold": t}, t) for t in (1.0, 0.7)] if name == "tiny" else []
            cases += [({"exit_threshold": 1.0, **spec}, 1.0) for spec in speculation]
            for options, threshold in cases:
                llm = LLM(path, device=DEVICE, dtype="float32", max_num_batched_tokens=32, **options)
                outs = llm.generate(prompts, params)
                for prompt, out in zip(prompts, outs):
                    key = (threshold, len(prompt))
                    if key not in refs:
                        refs[key] = reference_greedy(weights, ref_model.config, prompt, 16, threshold)
                    results.append({"model": name, **options, "prompt_len": len(prompt),
                                    "equal": out.token_ids == refs[key]})
                print(name, options, all(r["equal"] for r in results[-len(prompts):]), flush=True)
    summary = {"command": " ".join(["python"] + sys.argv), "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
               "cases": results, "all_equal": all(r["equal"] for r in results)}
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
