"""Training and evaluation of the small looped model that specloop ships as its default.

One job per module:

- `corpus`: the offline corpus (the running Python's standard library) and its split;
- `tokenizer_training`: the byte-level BPE trained on the train split;
- `token_data`: tokenised splits on disk and the random windows the trainer draws;
- `forward`: a batched [B, T] forward of `OuroModel` over every loop (SDPA, LAST_EXITED);
- `objective`: per-loop next-token loss plus the exit-gate objective;
- `recipe`: the default model's shape, initialisation and hyper-parameters;
- `prepare` / `train` / `evaluate`: the three command-line steps; `export` writes the folder.
"""
