"""Evaluate a looped checkpoint on the held-out split (thin wrapper over
`python -m specloop.training.evaluate`); with no --model it scores the shipped default.

    python bench/eval_default_model.py --streams out/stdlib_tokens.npz \
        --out bench/results/default_model_eval.json [--device cuda] [--max-windows N]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specloop.training.evaluate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
