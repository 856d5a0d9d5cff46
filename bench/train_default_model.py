"""Train the default model (thin wrapper over `python -m specloop.training.train`).

Full pipeline, as recorded in bench/results/default_model_train.json and docs/default-model.md:

    python -m specloop.training.prepare --tokenizer-out specloop/assets/default_model \
        --streams out/stdlib_tokens.npz                        # CPU, ~30 s
    python bench/train_default_model.py --streams out/stdlib_tokens.npz \
        --out OUT/default_model --log OUT/default_model_train.json   # one H200, ~6 min
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specloop.training.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
