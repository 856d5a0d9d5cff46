"""The INT4 residual pool split a byte budget gets, and what it holds: arithmetic, no device.

For a model preset (no weights are built) and an engine configuration, prints the pages and
records `KVResidualFeature.split` derives, and how many requests of a given length fit at
once in each region against BF16 pages alone in the same bytes (records: all their groups;
pages: one prompt's working set plus a decode tail per other request). A planning aid for
`bench/kv_residual.py --parts capacity`, which measures it.

    python bench/kv_split.py --preset ouro-1.4b --budget-gib 100 --length 8448 \\
        --max-model-len 8448,33024,65536 --max-num-seqs 64,128
"""

from __future__ import annotations

import argparse

import torch

from specloop.checkpoint.random_checkpoint import PRESETS
from specloop.engine.config import EngineConfig
from specloop.flashloop.kv_residual.feature import KVResidualFeature
from specloop.flashloop.kv_residual.records import ResidualRecords
from specloop.runtime.feature import Sizing
from specloop.runtime.kv_format import PagedKV
from specloop.scheduling.kv_manager import span_pages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="ouro-1.4b", choices=sorted(PRESETS))
    p.add_argument("--budget-gib", type=float, default=100.0)
    p.add_argument("--length", type=int, default=8448, help="tokens a request holds (prompt + output)")
    p.add_argument("--max-model-len", default="8448,33024,65536")
    p.add_argument("--max-num-seqs", default="64,128")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    m, dtype, bs = PRESETS[args.preset], getattr(torch, args.dtype), args.block_size
    budget, length = int(args.budget_gib * (1 << 30)), args.length
    page = PagedKV.page_bytes(m.num_hidden_layers, bs, m.num_key_value_heads, m.head_dim, dtype)
    bf16 = budget // page // (m.num_loops * -(-length // bs))
    print(f"{args.preset}, {args.budget_gib:g} GiB, requests of {length} tokens: BF16 pages hold {bf16}")
    for mml in (int(x) for x in args.max_model_len.split(",")):
        for seqs in (int(x) for x in args.max_num_seqs.split(",")):
            cfg = EngineConfig.from_kwargs("-", max_num_seqs=seqs, max_model_len=mml, block_size=bs,
                                           max_num_batched_tokens=args.max_num_batched_tokens,
                                           kv_residual_quantization={})
            sizing = Sizing(cfg, m, mml, dtype, torch.device("cpu"), None, False)
            feature = KVResidualFeature(cfg.kv_residual_quantization, cfg.token_sparse_prefill, sizing)
            pages = feature.split(budget, page)
            records = ResidualRecords(m.num_loops, 0, 0).records_for(None, length, length)
            tails = span_pages(feature.spans(1), length, bs)
            by_records = feature.num_records // records
            by_pages = (pages - feature.prompt_pages) // tails + 1
            print(f"  max_model_len {mml:6d}, max_num_seqs {seqs:4d}: {pages} pages ({pages * page / 2**30:.1f} GiB), "
                  f"{feature.num_records} records: INT4 holds {min(by_records, by_pages, seqs)} "
                  f"(records {by_records}, pages {by_pages}), {min(by_records, by_pages, seqs) / max(bf16, 1):.2f}x")


if __name__ == "__main__":
    main()
