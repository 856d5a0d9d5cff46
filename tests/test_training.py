"""The training pieces: corpus split, tokenizer, batched forward vs the reference, objective,
evaluation."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import torch

from specloop.checkpoint import load_model, load_tokenizer
from specloop.checkpoint.tokenizer import SPECIAL_TOKENS
from specloop.model.exit_gate import exit_distribution
from specloop.model.reference import reference_forward
from specloop.training.corpus import SPLITS, module_paths, split_of
from specloop.training.forward import batched_loops, loop_logits
from specloop.training.objective import exit_log_probs, looped_loss, per_token_ce
from specloop.training.recipe import TINY_TEST_MODEL, TrainConfig, init_model
from specloop.training.token_data import WindowSampler, fixed_windows
from tests.conftest import weights_of


def _batch(vocab: int, b: int, t: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (b, t), generator=gen)


# --- corpus split ---------------------------------------------------------------------

def test_split_is_a_pure_function_of_the_path():
    rel = "json/decoder.py"
    bucket = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") % 1000
    expected = "heldout" if bucket < 50 else "valid" if bucket < 70 else "train"
    assert split_of(rel) == expected
    assert split_of("stat.py") == "heldout"  # pinned: the CI loss-bound files rely on it
    assert split_of("modulefinder.py") == "heldout"


def test_split_proportions():
    paths = [f"pkg{i}/mod{j}.py" for i in range(100) for j in range(100)]
    counts = {s: sum(split_of(p) == s for p in paths) / len(paths) for s in SPLITS}
    assert abs(counts["heldout"] - 0.05) < 0.01
    assert abs(counts["valid"] - 0.02) < 0.01


def test_module_paths_skip_third_party_and_caches(tmp_path):
    for rel in ["a.py", "pkg/b.py", "site-packages/x.py", "pkg/__pycache__/c.py", "pydoc_data/t.py", "d.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert module_paths(tmp_path) == ["a.py", "pkg/b.py"]


# --- tokenizer ------------------------------------------------------------------------

def test_bpe_training_is_deterministic_with_chatml_specials(tmp_path):
    from specloop.training.tokenizer_training import train_bpe, write_tokenizer

    texts = ["def f(x):\n    return x + 1\n" * 20, "import os\nprint(os.getcwd())\n" * 20]
    a, b = train_bpe(texts, vocab_size=300), train_bpe(texts, vocab_size=300)
    assert a.to_str() == b.to_str()
    assert [a.token_to_id(s) for s in SPECIAL_TOKENS] == [0, 1, 2]
    write_tokenizer(a, tmp_path, max_length=64)
    tok = load_tokenizer(tmp_path)
    text = "def g(y):\n\treturn 'é'\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- batched forward == reference -----------------------------------------------------

def test_batched_loops_match_reference_per_loop(any_ckpt):
    model, _ = load_model(any_ckpt, dtype=torch.float64)
    tokens = _batch(model.config.vocab_size, 3, 37, seed=3)
    out = batched_loops(model, tokens)
    logits = loop_logits(model, out)  # [R, B, T, V]
    weights = weights_of(model)
    for i in range(tokens.shape[0]):
        ref = reference_forward(weights, model.config, tokens[i], exit_threshold=1.0)
        torch.testing.assert_close(logits[:, i], ref.loop_logits, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(torch.sigmoid(out.gate_logits[:, i]), ref.lambdas, atol=1e-6, rtol=1e-6)
        assert out.exit_loops[i].tolist() == ref.exit_loops.tolist()


def test_batched_loops_match_reference_fp32(tiny_ckpt):
    model, _ = load_model(tiny_ckpt, dtype=torch.float32)
    tokens = _batch(model.config.vocab_size, 2, 50, seed=4)
    logits = loop_logits(model, batched_loops(model, tokens))
    for i in range(2):
        ref = reference_forward(weights_of(model), model.config, tokens[i], exit_threshold=1.0)
        torch.testing.assert_close(logits[:, i], ref.loop_logits, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threshold", [0.5, 0.8])
def test_batched_adaptive_exit_matches_reference(any_ckpt, threshold):
    """LAST_EXITED in the batched forward: exit loops and exit-loop logits as the reference."""
    model, _ = load_model(any_ckpt, dtype=torch.float64)
    tokens = _batch(model.config.vocab_size, 2, 40, seed=5)
    out = batched_loops(model, tokens, exit_threshold=threshold)
    logits = loop_logits(model, out)
    exit_logits = logits.gather(0, (out.exit_loops - 1)[None, :, :, None].expand(1, *logits.shape[1:]))[0]
    seen = set()
    for i in range(2):
        ref = reference_forward(weights_of(model), model.config, tokens[i], exit_threshold=threshold)
        assert out.exit_loops[i].tolist() == ref.exit_loops.tolist()
        torch.testing.assert_close(exit_logits[i], ref.logits, atol=1e-10, rtol=1e-10)
        seen.update(ref.exit_loops.tolist())
    assert len(seen) >= 2, "the case must exercise early exit"


def test_fresh_model_state_dict_has_checkpoint_names():
    from specloop.checkpoint.loader import expected_shapes

    model = init_model(TINY_TEST_MODEL, seed=0)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == expected_shapes(TINY_TEST_MODEL)


# --- objective ------------------------------------------------------------------------

def test_exit_log_probs_match_exit_distribution():
    z = torch.randn(4, 50, dtype=torch.float32) * 3
    log_p = exit_log_probs(z)
    torch.testing.assert_close(log_p.exp(), exit_distribution(torch.sigmoid(z)), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(log_p.exp().sum(0), torch.ones(50), atol=1e-6, rtol=0)


def test_gate_term_does_not_reweight_the_language_loss():
    ce = torch.rand(4, 30, requires_grad=True)
    z = torch.randn(4, 30, requires_grad=True)
    looped_loss(ce, z, beta=0.1).total.backward()
    torch.testing.assert_close(ce.grad, torch.full_like(ce, 1 / (4 * 30)))
    assert z.grad.abs().sum() > 0


def test_gate_optimum_prefers_the_cheapest_loop():
    """Minimising the gate term alone moves exit mass to the loop with the lowest loss."""
    ce = torch.tensor([[3.0], [2.0], [0.5], [0.6]])
    z = torch.zeros(4, 1, requires_grad=True)
    opt = torch.optim.SGD([z], lr=3.0)
    for _ in range(100):
        opt.zero_grad()
        looped_loss(ce, z, beta=0.05).total.backward()  # ce is constant: only the gate term moves
        opt.step()
    p = exit_log_probs(z.detach()).exp()[:, 0]
    assert int(p.argmax()) == 2


# --- evaluation -----------------------------------------------------------------------

def test_evaluation_numbers_equal_the_reference(tiny_ckpt):
    """Per-loop CE, top-1 agreement and adaptive-exit depth as computed from the reference's
    per-loop logits of each window; samples are the reference's greedy continuation."""
    from specloop.model.reference import reference_greedy
    from specloop.training.evaluate import greedy_samples, score_windows

    model, _ = load_model(tiny_ckpt, dtype=torch.float64)
    windows = _batch(model.config.vocab_size, 3, 29, seed=6)
    got = score_windows(model, windows, thresholds=(0.6,), batch=2)
    weights = weights_of(model)
    ce, agree, depth = torch.zeros(4, dtype=torch.float64), torch.zeros(4), 0.0
    for w in windows:
        ref = reference_forward(weights, model.config, w, exit_threshold=1.0)
        logits = ref.loop_logits[:, :-1]
        ce += torch.stack([per_token_ce(logits[r], w[1:]).double().sum() for r in range(4)])
        agree += (logits.argmax(-1) == logits[-1].argmax(-1)).sum(-1)
        depth += float(reference_forward(weights, model.config, w, exit_threshold=0.6).exit_loops[:-1].sum())
    count = windows[:, 1:].numel()
    assert got["tokens_scored"] == count
    for r, row in enumerate(got["loops"]):
        assert row["ce"] == pytest.approx(float(ce[r]) / count, rel=1e-9)
        assert row["top1_agree_with_loop4"] == pytest.approx(float(agree[r]) / count, rel=1e-12)
    assert got["adaptive_exit"][0]["mean_exit_loop"] == pytest.approx(depth / count, rel=1e-12)
    assert 1.0 < depth / count < 4.0, "the case must exercise early exit"

    tok = load_tokenizer(tiny_ckpt)
    [sample] = greedy_samples(model, tok, ["def f(x):"], 6)
    ids = reference_greedy(weights, model.config, tok.encode("def f(x):", add_special_tokens=False), 6, 1.0)
    ids = ids[: ids.index(0)] if 0 in ids else ids
    assert sample == {"prompt": "def f(x):", "continuation": tok.decode(ids)}


# --- data and a smoke run -------------------------------------------------------------

def test_window_sampler_is_seeded_and_shifted():
    stream = np.arange(1000, dtype=np.uint16)
    a = WindowSampler(stream, 16, 4, seed=1).next_batch()
    b = WindowSampler(stream, 16, 4, seed=1).next_batch()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], a[0] + 1)
    windows = fixed_windows(stream, 100, max_windows=3)
    assert windows.shape == (3, 100) and int(windows[2, 0]) == 200


def test_tiny_training_run_learns_and_writes_a_loadable_checkpoint(tmp_path):
    from specloop.training.export import write_checkpoint
    from specloop.training.tokenizer_training import train_bpe, write_tokenizer
    from specloop.training.train import train

    gen = np.random.default_rng(0)
    pattern = gen.integers(3, 200, size=50).astype(np.uint16)  # a repeated phrase: learnable
    stream = np.tile(pattern, 80)
    streams = {"train": stream, "valid": stream[:400]}
    cfg = TrainConfig(seq_len=32, batch_size=8, lr=3e-3, warmup_steps=5, eval_every=20, eval_windows=4,
                      log_every=10)
    small = dataclasses.replace(TINY_TEST_MODEL, vocab_size=256)
    model, log = train(streams, small, cfg, torch.device("cpu"), steps=40, progress=False)
    first, last = log["train"][0]["loop_ce"], log["train"][-1]["loop_ce"]
    assert last[-1] < first[-1] - 1.0
    assert log["best_step"] in (20, 40)
    write_tokenizer(train_bpe(["x = 1\n" * 10], vocab_size=300), tmp_path / "tok", max_length=64)
    folder = write_checkpoint(model, tmp_path / "ckpt", tmp_path / "tok")
    loaded, _ = load_model(folder, dtype=torch.float32)
    tokens = torch.from_numpy(stream[:33].astype(np.int64))[None]
    want = loop_logits(model.float(), batched_loops(model, tokens))
    got = loop_logits(loaded, batched_loops(loaded, tokens))
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)  # bf16 storage
    assert load_tokenizer(folder).convert_tokens_to_ids("<|im_end|>") == 2
