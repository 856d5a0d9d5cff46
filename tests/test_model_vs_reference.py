"""The loop-at-a-time model on a per-depth KV cache against the dense reference."""

from __future__ import annotations

import pytest
import torch

from specloop.checkpoint import load_model
from specloop.model.reference import reference_forward, reference_greedy
from specloop.model.stepper import LoopStepper
from tests.conftest import weights_of

FP32_ATOL, FP32_RTOL = 2e-5, 1e-5
# bf16: the runtime's error against the fp32 reference may exceed the bf16 reference's own
# error against it by at most 25% (+1e-3), and runtime and bf16 reference agree to 2e-2.
BF16_EXCESS, BF16_VS_REF16 = 1.25, 2e-2


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def _stepper_logits(model, prompt, chunk, threshold=None):
    stepper = LoopStepper(model, max_seqs=1, max_len=len(prompt), exit_threshold=threshold)
    seq = stepper.add_sequence(prompt)
    stepper.run_to_completion(seq, chunk_size=chunk)
    return stepper, seq


@pytest.mark.parametrize("length", [1, 2, 7, 33, 64, 200])
@pytest.mark.parametrize("chunk", [None, 16])
def test_prefill_logits_match_reference_fp32(any_ckpt, length, chunk):
    model, _ = load_model(any_ckpt, dtype=torch.float32)
    prompt = _prompt(length, model.config.vocab_size, seed=length)
    stepper, seq = _stepper_logits(model, prompt, chunk)
    ref = reference_forward(weights_of(model), model.config, torch.tensor(prompt))
    torch.testing.assert_close(stepper.logits(seq), ref.logits, atol=FP32_ATOL, rtol=FP32_RTOL)
    assert stepper.seqs[seq].exit_loops == [model.config.num_loops] * length


@pytest.mark.parametrize("threshold", [0.5, 0.8, 0.95])
@pytest.mark.parametrize("chunk", [None, 5])
def test_adaptive_exit_matches_reference(any_ckpt, threshold, chunk):
    model, _ = load_model(any_ckpt, dtype=torch.float64)
    prompt = _prompt(60, model.config.vocab_size, seed=7)
    stepper, seq = _stepper_logits(model, prompt, chunk, threshold)
    ref = reference_forward(weights_of(model), model.config, torch.tensor(prompt), threshold)
    exits = stepper.seqs[seq].exit_loops
    assert exits == ref.exit_loops.tolist()
    assert len(set(exits)) >= 2, "the case must exercise early exit and LAST_EXITED reads"
    torch.testing.assert_close(stepper.logits(seq), ref.logits, atol=1e-9, rtol=1e-9)


def test_adaptive_exit_changes_results():
    """Guard against a reference that ignores LAST_EXITED: exits must change later logits."""
    from tests.conftest import TINY, make_checkpoint
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model, _ = load_model(make_checkpoint(tmp, TINY, seed=3), dtype=torch.float64)
    prompt = _prompt(40, model.config.vocab_size, seed=3)
    w = weights_of(model)
    full = reference_forward(w, model.config, torch.tensor(prompt), 1.0)
    early = reference_forward(w, model.config, torch.tensor(prompt), 0.5)
    full_exit = early.exit_loops == model.config.num_loops
    assert (~full_exit).any() and full_exit.any()
    # Tokens that ran every loop still differ: they read exited tokens' shallower K/V.
    assert not torch.allclose(full.logits[full_exit], early.logits[full_exit])


def test_per_loop_logits_are_head_of_each_loop(tiny_model_fp32):
    model = tiny_model_fp32
    prompt = _prompt(12, model.config.vocab_size, seed=5)
    ref = reference_forward(weights_of(model), model.config, torch.tensor(prompt))
    assert ref.loop_logits.shape == (4, 12, model.config.vocab_size)
    torch.testing.assert_close(ref.loop_logits[-1], ref.logits)
    torch.testing.assert_close(model.head(ref.loop_hidden[1]), ref.loop_logits[1])
    assert not torch.allclose(ref.loop_logits[0], ref.loop_logits[3])


def test_wavefront_mixed_depth_calls_match_reference(any_ckpt):
    """Chunks of one request sit at different depths in one call (wavefront prefill)."""
    model, _ = load_model(any_ckpt, dtype=torch.float32)
    prompt = _prompt(40, model.config.vocab_size, seed=11)
    stepper = LoopStepper(model, max_seqs=1, max_len=len(prompt))
    seq = stepper.add_sequence(prompt)
    chunks = [list(range(i, min(i + 8, 40))) for i in range(0, 40, 8)]
    num_loops = model.config.num_loops
    mixed_calls = 0
    for step in range(len(chunks) + num_loops - 1):
        rows, depths = [], set()
        for c, chunk in enumerate(chunks):
            depth = step - c  # chunk c enters depth 0 at step c
            if 0 <= depth < num_loops:
                rows += [(seq, p) for p in chunk]
                depths.add(depth)
        mixed_calls += len(depths) > 1
        stepper.step(rows)
    assert mixed_calls >= 3
    ref = reference_forward(weights_of(model), model.config, torch.tensor(prompt))
    torch.testing.assert_close(stepper.logits(seq), ref.logits, atol=FP32_ATOL, rtol=FP32_RTOL)


def test_readiness_is_enforced(tiny_model_fp32):
    stepper = LoopStepper(tiny_model_fp32, max_seqs=1, max_len=8)
    seq = stepper.add_sequence([5, 6, 7])
    with pytest.raises(ValueError, match="not ready"):
        stepper.step([(seq, 1)])  # position 0 has not finished depth 0


def test_two_sequences_in_one_call(tiny_model_fp32):
    model = tiny_model_fp32
    a, b = _prompt(9, model.config.vocab_size, 1), _prompt(14, model.config.vocab_size, 2)
    stepper = LoopStepper(model, max_seqs=2, max_len=16)
    sa, sb = stepper.add_sequence(a), stepper.add_sequence(b)
    for _ in range(model.config.num_loops):
        stepper.step([(sa, p) for p in range(9)] + [(sb, p) for p in range(14)])
    w = weights_of(model)
    for seq, prompt in ((sa, a), (sb, b)):
        ref = reference_forward(w, model.config, torch.tensor(prompt))
        torch.testing.assert_close(stepper.logits(seq), ref.logits, atol=FP32_ATOL, rtol=FP32_RTOL)


@pytest.mark.parametrize("threshold", [1.0, 0.6])
def test_greedy_decode_matches_reference(any_ckpt, threshold):
    model, _ = load_model(any_ckpt, dtype=torch.float64)
    prompt = _prompt(10, model.config.vocab_size, seed=4)
    stepper = LoopStepper(model, max_seqs=1, max_len=40, exit_threshold=threshold)
    seq = stepper.add_sequence(prompt)
    got = stepper.greedy(seq, 12, chunk_size=4)
    assert got == reference_greedy(weights_of(model), model.config, prompt, 12, threshold)


def test_bf16_within_declared_tolerance(any_ckpt):
    model16, _ = load_model(any_ckpt, dtype=torch.bfloat16)
    model32, _ = load_model(any_ckpt, dtype=torch.float32)
    prompt = _prompt(50, model16.config.vocab_size, seed=9)
    stepper, seq = _stepper_logits(model16, prompt, 16)
    ref32 = reference_forward(weights_of(model32), model32.config, torch.tensor(prompt)).logits
    ref16 = reference_forward(weights_of(model16), model16.config, torch.tensor(prompt)).logits
    got = stepper.logits(seq)

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    assert rel(got, ref32) <= BF16_EXCESS * rel(ref16, ref32) + 1e-3
    assert rel(got, ref16) < BF16_VS_REF16
    assert (got.argmax(-1) == ref32.argmax(-1)).float().mean() > 0.9
