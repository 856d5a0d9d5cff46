"""The FlashLoop reference: the RFC's worked examples, equality with the dense reference
when every feature is off (or keeps everything), and each feature's rules checked against
brute-force recomputation written per key and head here."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors.torch import load_file

from specloop.checkpoint.random_checkpoint import write_random_checkpoint
from specloop.checkpoint.safetensors_files import SINGLE_FILE
from specloop.config import ModelConfig
from specloop.errors import ConfigError
from specloop.model.flashloop_reference import (
    DENSE,
    NEVER,
    DecodeReference,
    FlashLoopFeatures,
    KVResidual,
    SparseDecode,
    SparsePrefill,
    change_score,
    corrected_attention,
    decode_budget,
    decode_reference,
    dequantize,
    fake_quantize_group,
    flashloop_forward,
    flashloop_greedy,
    prefill_budget,
    quantize,
    quantize_rows,
    read_kv,
    residual_encode,
    seal_positions,
    select_active,
    top_positions,
    window_bounds,
)
from specloop.model.reference import reference_forward, reference_greedy
from tests.conftest import TINY, TINY_MHA

Weights = dict[str, torch.Tensor]


def _weights(tmp_path_factory, cfg: ModelConfig, seed: int) -> tuple[Weights, ModelConfig]:
    folder = write_random_checkpoint(tmp_path_factory.mktemp("flashloop"), cfg, seed=seed, dtype=torch.float64)
    return load_file(str(folder / SINGLE_FILE)), cfg


@pytest.fixture(scope="module")
def gqa(tmp_path_factory) -> tuple[Weights, ModelConfig]:
    return _weights(tmp_path_factory, TINY, seed=1)  # 4 query heads over 2 KV heads


@pytest.fixture(scope="module")
def mha(tmp_path_factory) -> tuple[Weights, ModelConfig]:
    return _weights(tmp_path_factory, TINY_MHA, seed=2)


@pytest.fixture(params=["gqa", "mha"])
def model(request, gqa, mha) -> tuple[Weights, ModelConfig]:
    return gqa if request.param == "gqa" else mha


def _ids(n: int, cfg: ModelConfig, seed: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=atol)


# --- brute force: one query, one loop, written per key and head ------------------------

def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean() + eps))


def _rotate(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """x [heads, D] rotated at absolute position pos, pair by pair (frequencies held in
    fp32, as the checkpoint's rotary convention does)."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        angle = pos * float(torch.tensor(1.0 / theta ** (2 * i / d), dtype=torch.float32))
        c, s = math.cos(angle), math.sin(angle)
        out[:, i] = x[:, i] * c - x[:, i + d // 2] * s
        out[:, i + d // 2] = x[:, i + d // 2] * c + x[:, i] * s
    return out


def _brute_force_loop(w: Weights, cfg: ModelConfig, h_in: torch.Tensor, pos: int, keys: torch.Tensor,
                      values: torch.Tensor, refs: dict[int, DecodeReference] | None = None) -> torch.Tensor:
    """The end-of-loop state of the token at `pos` from its input state h_in [H], reading
    the other tokens' K/V from keys / values [L, T, Hkv, D] (its own are recomputed and
    checked); refs: per layer, a loop-2 reference to correct against (sparse decode)."""
    eps, d = cfg.rms_norm_eps, cfg.head_dim
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    x = h_in.clone()
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        a = _norm(x, w[p + "input_layernorm.weight"], eps)
        q = _rotate((w[p + "self_attn.q_proj.weight"] @ a).view(-1, d), pos, cfg.rope_theta)
        k = _rotate((w[p + "self_attn.k_proj.weight"] @ a).view(-1, d), pos, cfg.rope_theta)
        v = (w[p + "self_attn.v_proj.weight"] @ a).view(-1, d)
        _close(k, keys[layer, pos])
        _close(v, values[layer, pos])
        heads = []
        for h in range(cfg.num_attention_heads):
            ks = [keys[layer, j, h // group] for j in range(pos)] + [k[h // group]]
            vs = [values[layer, j, h // group] for j in range(pos)] + [v[h // group]]
            if refs is None:
                probs = torch.stack([q[h] @ kj for kj in ks]).div(math.sqrt(d)).softmax(0)
                heads.append(sum(pj * vj for pj, vj in zip(probs, vs)))
            else:
                ref, chosen = refs[layer], refs[layer].keys[h].tolist()
                local = torch.stack([q[h] @ ks[j] for j in chosen]).div(math.sqrt(d)).softmax(0)
                new = sum(pj * vs[j] for pj, j in zip(local, chosen))
                heads.append(ref.o_ref[h] - ref.c_ref[h] + ref.mass[h] * new)
        o = w[p + "self_attn.o_proj.weight"] @ torch.cat(heads)
        x = x + _norm(o, w[p + "input_layernorm_2.weight"], eps)
        m = _norm(x, w[p + "post_attention_layernorm.weight"], eps)
        m = w[p + "mlp.down_proj.weight"] @ (torch.nn.functional.silu(w[p + "mlp.gate_proj.weight"] @ m)
                                             * (w[p + "mlp.up_proj.weight"] @ m))
        x = x + _norm(m, w[p + "post_attention_layernorm_2.weight"], eps)
    return _norm(x, w["model.norm.weight"], eps)


# --- the RFC's worked examples --------------------------------------------------------

def test_rfc_eight_token_window_example():
    # Retention (1, 1, 0.5, 0.25) on 8 tokens: budgets 4 and 2; t2, t4, t6, t8 then t4, t8.
    assert prefill_budget(8, 0.5) == 4 and prefill_budget(8, 0.25) == 2
    loop3 = select_active(torch.tensor([.1, .9, .2, .8, .3, .7, .0, .6]), torch.ones(8, dtype=torch.bool), 4)
    assert loop3.tolist() == [1, 3, 5, 7]
    eligible = torch.zeros(8, dtype=torch.bool)
    eligible[loop3] = True
    # t1 scores highest at loop 4 but is not eligible: the sets are nested.
    loop4 = select_active(torch.tensor([.99, .1, .5, .6, .5, .2, .4, .9]), eligible, 2)
    assert loop4.tolist() == [3, 7]


def test_rfc_scalar_attention_example():
    probs = torch.tensor([[0.1, 0.3, 0.6]], dtype=torch.float64)
    values = torch.tensor([[[10.0], [20.0], [30.0]]], dtype=torch.float64)
    ref = decode_reference(probs, values, budget=2)
    assert sorted(ref.keys[0].tolist()) == [1, 2]
    _close(ref.mass, torch.tensor([0.9], dtype=torch.float64))
    _close(ref.o_ref, torch.tensor([[25.0]], dtype=torch.float64))
    _close(ref.c_ref, torch.tensor([[24.0]], dtype=torch.float64))
    scores = torch.tensor([[0.75, 0.25]], dtype=torch.float64).log()  # softmax -> [0.75, 0.25]
    out = corrected_attention(ref.o_ref, ref.c_ref, ref.mass, scores, torch.tensor([[[20.0], [40.0]]],
                                                                                     dtype=torch.float64))
    _close(out, torch.tensor([[23.5]], dtype=torch.float64))


def test_rfc_residual_against_reconstructed_predecessor():
    # One K group of 16 rows (one channel): min 10, scale 0.1; 10.03 reconstructs as 10.00.
    x1 = (10.0 + 0.1 * torch.arange(16.0)).view(16, 1, 1)
    x1[1] = 10.03
    hat1 = quantize_rows(x1, "k", bits=4, group_size=16)
    assert hat1[1].item() == 10.0
    x2 = hat1.clone()
    x2[1] = 10.08  # every other row repeats its reconstruction: residual 0
    hat2 = residual_encode(hat1, x2, torch.ones(16, dtype=torch.bool), "k", bits=4, group_size=16)
    # The residual is 0.08 (against 10.00, not 0.05 against 10.03), so X^2 lands on 10.08.
    assert abs(hat2[1].item() - 10.08) < 1e-4
    assert abs(hat2[1].item() - 10.05) > 0.02


# --- equality with the dense reference ------------------------------------------------

@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_features_off_equal_dense_reference(model, threshold):
    w, cfg = model
    ids = _ids(40, cfg, seed=3)
    ref = reference_forward(w, cfg, ids, threshold)
    out = flashloop_forward(w, cfg, ids, 28, DENSE, threshold)
    assert torch.equal(out.exit_loops, ref.exit_loops)
    assert torch.equal(out.last_loops, ref.exit_loops)
    _close(out.logits, ref.logits, atol=1e-12)
    _close(out.loop_hidden, ref.loop_hidden, atol=1e-12)
    if threshold == 1.0:
        assert torch.equal(out.logits, ref.logits) and out.active.all()
    else:
        assert (ref.exit_loops < cfg.num_loops).any()
        for loop in range(1, cfg.num_loops + 1):
            assert torch.equal(out.active[loop - 1], ref.exit_loops >= loop)


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_full_retention_is_dense(gqa, threshold):
    w, cfg = gqa
    ids = _ids(36, cfg, seed=4)
    features = FlashLoopFeatures(token_sparse_prefill=SparsePrefill(window=5, retention=(1.0,) * 4))
    out = flashloop_forward(w, cfg, ids, 30, features, threshold)
    base = flashloop_forward(w, cfg, ids, 30, DENSE, threshold)
    assert out.audit.prefill_active == {}  # retention 1.0 does no selection
    assert torch.equal(out.logits, base.logits) and torch.equal(out.exit_loops, base.exit_loops)
    ref = reference_forward(w, cfg, ids, threshold)
    _close(out.logits, ref.logits, atol=1e-12)


@pytest.mark.parametrize("threshold", [1.0, 0.5])
def test_full_key_retention_is_dense(model, threshold):
    w, cfg = model
    ids, prompt_len = _ids(30, cfg, seed=5), 12
    out = flashloop_forward(w, cfg, ids, prompt_len, FlashLoopFeatures(sparse_decode=SparseDecode(1.0)), threshold)
    ref = reference_forward(w, cfg, ids, threshold)
    _close(out.logits, ref.logits)
    _close(out.loop_hidden, ref.loop_hidden)
    assert torch.equal(out.exit_loops, ref.exit_loops)
    for (pos, layer), dref in out.audit.decode.items():
        assert pos >= prompt_len and dref.keys.shape == (cfg.num_attention_heads, pos + 1)
        _close(dref.mass, torch.ones_like(dref.mass))
    assert len(out.audit.decode) == cfg.num_hidden_layers * int((out.active[1, prompt_len:]).sum())


def test_greedy_without_features_matches_reference_greedy(gqa):
    w, cfg = gqa
    prompt = _ids(10, cfg, seed=6).tolist()
    assert flashloop_greedy(w, cfg, prompt, 4) == reference_greedy(w, cfg, prompt, 4)


def test_feature_validation():
    for bad in [dict(retention=(0.5, 1.0, 0.25, 0.1)), dict(retention=(1.0, 1.0, 0.1, 0.25)),
                dict(retention=(1.0, 1.0, 0.0, 0.0)), dict(retention=(1.0, 1.0, 1.5, 0.1)), dict(window=0),
                dict(eps=0.0)]:
        with pytest.raises(ConfigError):
            SparsePrefill(**bad)
    with pytest.raises(ConfigError):
        SparseDecode(0.0)
    with pytest.raises(ConfigError):
        KVResidual(bits=0)
    with pytest.raises(ConfigError):
        KVResidual(group_size=0)
    with pytest.raises(ConfigError, match="serial or execution"):
        KVResidual(policy="eager")
    with pytest.raises(ConfigError):
        KVResidual(policy="execution", chunk=0)
    # the execution policy's safe points: prompt chunk starts, then every position
    kvr = KVResidual(policy="execution", chunk=64)
    assert [kvr.safe_point(x, 150) for x in (0, 1, 64, 100, 129, 149, 150, 151)] == [0, 64, 64, 128, 150, 150, 150, 151]
    assert KVResidual().safe_point(100, 150) == 100
    cfg = dataclasses.replace(TINY, total_ut_steps=3)
    with pytest.raises(ConfigError, match="3 loops"):
        flashloop_forward({}, cfg, torch.zeros(4, dtype=torch.long), 4,
                          FlashLoopFeatures(token_sparse_prefill=SparsePrefill()))


# --- token-sparse prefill ---------------------------------------------------------------

def test_budgets_use_exact_ceilings():
    assert prefill_budget(10, 0.25) == 3 and prefill_budget(10, 0.10) == 1
    assert prefill_budget(3, 0.10) == 1 and prefill_budget(7, 1.0) == 7
    assert prefill_budget(100, 0.07) == 7  # floats: 100 * 0.07 = 7.000000000000001
    assert decode_budget(5, 0.1) == 1 and decode_budget(20, 0.1) == 2 and decode_budget(21, 0.1) == 3
    assert decode_budget(1, 0.1) == 1 and decode_budget(9, 1.0) == 9
    assert window_bounds(23, 10) == [(0, 10), (10, 20), (20, 23)]
    assert window_bounds(23, None) == [(0, 23)] and window_bounds(0, 8) == []


def test_ties_broken_by_lower_position():
    scores = torch.tensor([1.0, 2.0, 2.0, 0.0, 2.0])
    everyone = torch.ones(5, dtype=torch.bool)
    assert select_active(scores, everyone, 2).tolist() == [1, 2]
    assert select_active(scores, torch.tensor([True, False, True, True, True]), 2).tolist() == [2, 4]
    assert select_active(scores, torch.tensor([True, False, False, True, False]), 5).tolist() == [0, 3]
    assert top_positions(torch.tensor([[0.5, 0.5, 0.5], [0.1, 0.3, 0.3]]), 2).tolist() == [[0, 1], [1, 2]]


def test_change_score_is_relative_fp32():
    prev = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    prev2 = torch.tensor([[0.0, 4.0], [1e-9, 0.0]], dtype=torch.float64)
    score = change_score(prev, prev2, eps=1e-6)
    assert score.dtype == torch.float32
    _close(score, torch.tensor([3.0 / 5.0, 1e-9 / 1e-6], dtype=torch.float32), atol=1e-7)


def _expected_selection(out, prompt_len: int, sp: SparsePrefill, loop: int) -> dict[int, list[int]]:
    """Per window, the top-budget eligible tokens by the score, written with plain sorting."""
    h = out.loop_hidden
    chosen = {}
    for index, (s, e) in enumerate(window_bounds(prompt_len, sp.window)):
        score = change_score(h[loop - 2, s:e], h[loop - 3, s:e], sp.eps).tolist()
        eligible = [i for i in range(s, e) if out.active[loop - 2, i] and out.exit_loops[i] >= loop]
        ranked = sorted(eligible, key=lambda i: (-score[i - s], i))
        chosen[index] = sorted(ranked[: prefill_budget(e - s, sp.retention[loop - 1])])
    return chosen


@pytest.mark.parametrize("threshold", [1.0, 0.7])
def test_sparse_prefill_selection_rules(gqa, threshold):
    w, cfg = gqa
    prompt_len, sp = 23, SparsePrefill(window=10, retention=(1.0, 1.0, 0.25, 0.10))
    ids = _ids(30, cfg, seed=7)
    out = flashloop_forward(w, cfg, ids, prompt_len, FlashLoopFeatures(token_sparse_prefill=sp), threshold)
    exited_before = lambda loop: out.exit_loops < loop  # noqa: E731
    assert out.active[0].all() and torch.equal(out.active[1], ~exited_before(2))
    for loop in (3, 4):
        # Nested, exited tokens never run, generated tokens always run unless exited.
        assert not (out.active[loop - 1] & ~out.active[loop - 2]).any()
        assert not (out.active[loop - 1] & exited_before(loop)).any()
        assert torch.equal(out.active[loop - 1, prompt_len:], ~exited_before(loop)[prompt_len:])
        want = _expected_selection(out, prompt_len, sp, loop)
        for index in range(3):
            picked = out.audit.prefill_active[(loop, index)]
            assert picked.tolist() == want[index]
            assert torch.equal(out.active[loop - 1, :prompt_len].nonzero().flatten(),
                               torch.cat([out.audit.prefill_active[(loop, j)] for j in range(3)]))
    if threshold == 1.0:  # budgets from the window's own length: 10, 10, 3 tokens
        assert [len(out.audit.prefill_active[(3, i)]) for i in range(3)] == [3, 3, 1]
        assert [len(out.audit.prefill_active[(4, i)]) for i in range(3)] == [1, 1, 1]
    # Inactive tokens keep their state and every layer's K/V; their final state is the last loop run.
    for loop in (3, 4):
        idle = ~out.active[loop - 1]
        assert torch.equal(out.loop_hidden[loop - 1, idle], out.loop_hidden[loop - 2, idle])
        assert torch.equal(out.audit.loop_keys[loop - 1][:, idle], out.audit.loop_keys[loop - 2][:, idle])
        assert torch.equal(out.audit.loop_values[loop - 1][:, idle], out.audit.loop_values[loop - 2][:, idle])
    ran = out.active.long().sum(0)
    assert torch.equal(out.last_loops, ran)
    # The gate of a token left out is not evaluated again: it reports no early exit.
    left_out = out.last_loops < out.exit_loops
    assert (out.exit_loops[left_out] == cfg.num_loops).all()
    final = out.loop_hidden[out.last_loops - 1, torch.arange(30)]
    _close(out.logits, final @ w["lm_head.weight"].T, atol=1e-12)


def test_active_query_reads_inherited_kv_at_absolute_positions(gqa):
    w, cfg = gqa
    prompt_len = 24
    sp = SparsePrefill(window=8, retention=(1.0, 1.0, 0.25, 0.25))
    out = flashloop_forward(w, cfg, _ids(prompt_len, cfg, seed=8), prompt_len, FlashLoopFeatures(sp))
    active3 = out.active[2].nonzero().flatten().tolist()
    query = max(active3)
    assert len([j for j in range(query) if j not in active3]) > 0  # nonconsecutive positions
    for j in range(query):
        if j not in active3:  # the logical loop-3 sequence holds their loop-2 K/V
            assert torch.equal(out.audit.loop_keys[2][:, j], out.audit.loop_keys[1][:, j])
    got = _brute_force_loop(w, cfg, out.loop_hidden[1, query], query, out.audit.loop_keys[2], out.audit.loop_values[2])
    _close(got, out.loop_hidden[2, query])


def test_last_tokens_may_be_left_out(gqa):
    # No reserved slot: find a prompt in which neither the first window's last token nor the
    # prompt's last token is chosen at loop 3; both keep their loop-2 state.
    w, cfg = gqa
    prompt_len = 16
    features = FlashLoopFeatures(token_sparse_prefill=SparsePrefill(window=8))
    for seed in range(20):
        prompt = _ids(prompt_len, cfg, seed=100 + seed)
        out = flashloop_forward(w, cfg, prompt, prompt_len, features)
        if not out.active[2, 7] and not out.active[2, prompt_len - 1]:
            break
    else:
        pytest.fail("no prompt left both last tokens out")
    for pos in (7, prompt_len - 1):
        assert out.last_loops[pos] == 2
        assert torch.equal(out.loop_hidden[3, pos], out.loop_hidden[1, pos])
    head = out.loop_hidden[1, prompt_len - 1] @ w["lm_head.weight"].T
    _close(out.logits[prompt_len - 1], head, atol=1e-12)
    first = flashloop_greedy(w, cfg, prompt.tolist(), 1, features)
    assert first == [int(head.argmax())]


def test_windowed_selection_differs_from_global(gqa):
    w, cfg = gqa
    prompt_len, ids = 24, _ids(24, cfg, seed=9)
    windowed = flashloop_forward(w, cfg, ids, prompt_len, FlashLoopFeatures(SparsePrefill(window=8)))
    whole = flashloop_forward(w, cfg, ids, prompt_len, FlashLoopFeatures(SparsePrefill(window=None)))
    assert whole.audit.windows == [(0, 24)] and len(windowed.audit.windows) == 3
    assert int(whole.active[2].sum()) == int(windowed.active[2].sum()) == 6  # ceil(24/4) vs 3 x ceil(8/4)
    assert not torch.equal(whole.active, windowed.active)
    assert not torch.equal(whole.logits, windowed.logits)


# --- sparse decode attention -------------------------------------------------------------

def test_sparse_decode_selection_and_correction(model):
    w, cfg = model
    ids, prompt_len = _ids(44, cfg, seed=10), 10
    features = FlashLoopFeatures(sparse_decode=SparseDecode(0.1))
    out = flashloop_forward(w, cfg, ids, prompt_len, features)
    dense = flashloop_forward(w, cfg, ids, prompt_len, DENSE)
    # Prompt queries stay dense.
    assert torch.equal(out.loop_hidden[:, :prompt_len], dense.loop_hidden[:, :prompt_len])
    assert not torch.allclose(out.logits[prompt_len:], dense.logits[prompt_len:])
    includes_current, heads_differ = False, False
    for (pos, layer), ref in out.audit.decode.items():
        assert ref.keys.shape == (cfg.num_attention_heads, decode_budget(pos + 1, 0.1))
        assert (ref.keys <= pos).all()
        includes_current |= bool((ref.keys == pos).any())
        heads_differ |= len({tuple(sorted(k)) for k in ref.keys.tolist()}) > 1
    assert includes_current and heads_differ
    # Loop-2 statistics from the loop-2 probabilities (layer 0 by hand), then loops 3 and 4
    # of one generated query recomputed per key and head with the correction.
    pos, group = 40, cfg.num_attention_heads // cfg.num_key_value_heads
    a = _norm(out.loop_hidden[0, pos], w["model.layers.0.input_layernorm.weight"], cfg.rms_norm_eps)
    q = _rotate((w["model.layers.0.self_attn.q_proj.weight"] @ a).view(-1, cfg.head_dim), pos, cfg.rope_theta)
    keys, values = out.audit.loop_keys[1, 0, : pos + 1], out.audit.loop_values[1, 0, : pos + 1]
    ref = out.audit.decode[(pos, 0)]
    for h in range(cfg.num_attention_heads):
        probs = (keys[:, h // group] @ q[h] / math.sqrt(cfg.head_dim)).softmax(0)
        ranked = sorted(range(pos + 1), key=lambda j: (-probs[j].item(), j))[: ref.keys.shape[1]]
        assert ref.keys[h].tolist() == ranked
        _close(ref.mass[h], probs[ranked].sum())
        _close(ref.c_ref[h], (probs[ranked, None] * values[ranked, h // group]).sum(0))
        _close(ref.o_ref[h], (probs[:, None] * values[:, h // group]).sum(0))
    refs = {layer: out.audit.decode[(pos, layer)] for layer in range(cfg.num_hidden_layers)}
    for loop in (3, 4):
        got = _brute_force_loop(w, cfg, out.loop_hidden[loop - 2, pos], pos, out.audit.loop_keys[loop - 1],
                                out.audit.loop_values[loop - 1], refs)
        _close(got, out.loop_hidden[loop - 1, pos])


def test_sparse_decode_skips_tokens_that_exit_early(gqa):
    w, cfg = gqa
    ids, prompt_len = _ids(40, cfg, seed=11), 8
    out = flashloop_forward(w, cfg, ids, prompt_len, FlashLoopFeatures(sparse_decode=SparseDecode(0.2)), 0.5)
    generated = range(prompt_len, 40)
    assert any(out.exit_loops[p] == 1 for p in generated)
    for p in generated:  # exited at loop 1: no loop-2 reference at all
        assert ((p, 0) in out.audit.decode) == bool(out.exit_loops[p] >= 2)


# --- KV residuals -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value", [0.0, -1.5, 300.5, 2.0**-20, 61440.0])
def test_constant_group_of_an_fp16_value_reconstructs_exactly(dtype, value):
    """Scale 1, codes 0, lo the value: no division by zero, and the value back exactly
    (0.0: residuals a loop left unchanged; 2^-20: an fp16 subnormal)."""
    x = torch.full((16,), value, dtype=dtype)
    groups = quantize(x, 0, bits=4)
    assert groups.constant.all() and groups.scale.item() == 1.0 and (groups.codes == 0).all()
    assert torch.equal(fake_quantize_group(x), x) and fake_quantize_group(x).dtype == dtype


@pytest.mark.parametrize("dtype, value", [(torch.float32, 0.1234567), (torch.bfloat16, 1e-6), (torch.float64, 1 + 1e-12)])
def test_constant_group_of_another_value_rounds_to_fp16(dtype, value):
    """A value fp16 cannot hold decodes to its fp16 rounding, as every group's minimum
    does: the format stores FP16 parameters and nothing wider."""
    x = torch.full((16,), value, dtype=dtype)
    got = fake_quantize_group(x)
    assert not torch.equal(got, x)
    assert torch.equal(got, x.half().to(dtype))


def test_metadata_is_fp16_and_codes_use_rounded_metadata():
    x = torch.randn(64, generator=torch.Generator().manual_seed(12)) * 3 + 0.3
    groups = quantize(x, 0, bits=4)
    assert groups.scale.dtype == groups.lo.dtype == torch.float16 and groups.codes.dtype == torch.uint8
    assert torch.equal(groups.lo.float(), x.min().half().float().view(1))
    assert torch.equal(groups.scale.float(), ((x.max() - x.min()) / 15).half().float().view(1))
    codes = ((x - groups.lo.float()) / groups.scale.float()).round().clamp(0, 15)
    assert torch.equal(groups.codes.float(), codes) and int(groups.codes.max()) <= 15
    assert torch.equal(dequantize(groups), groups.lo.float() + groups.scale.float() * groups.codes.float())


def test_error_per_encode_step_is_bounded():
    gen = torch.Generator().manual_seed(13)
    # fp16-exact min and scale: at most scale / 2 from each element.
    grid = 0.5 + 0.25 * torch.randint(0, 16, (200,), generator=gen).float()
    grid[0], grid[1] = 0.5, 4.25
    x = (grid + (torch.rand(200, generator=gen) - 0.5) * 0.25).clamp(0.5, 4.25)
    x[0], x[1] = 0.5, 4.25  # min 0.5, scale (4.25 - 0.5) / 15 = 0.25
    assert (fake_quantize_group(x) - x).abs().max() <= 0.25 / 2 + 1e-6
    # In general the fp16 rounding of min and scale adds to the half step.
    for _ in range(20):
        x = torch.randn(64, generator=gen) * 5
        lo, scale = x.min(), (x.max() - x.min()) / 15
        lo16, scale16 = lo.half().float(), scale.half().float()
        bound = scale16 / 2 + (lo - lo16).abs() + 15 * (scale - scale16).abs() + 1e-6
        assert (fake_quantize_group(x) - x).abs().max() <= bound


def test_short_groups_use_valid_elements_only():
    gen = torch.Generator().manual_seed(14)
    k = torch.randn(10, 2, 12, generator=gen)
    got = quantize_rows(k, "k", bits=4, group_size=8)
    assert torch.equal(got[8:], quantize_rows(k[8:], "k", bits=4, group_size=8))  # 2-row group
    padded = torch.cat([k[8:], torch.zeros(6, 2, 12)])
    assert not torch.equal(got[8:], quantize_rows(padded, "k", bits=4, group_size=8)[:2])
    # V: per row and head over 8 channels, then a 4-channel group.
    v = torch.randn(3, 2, 12, generator=gen)
    got = quantize_rows(v, "v", bits=4, group_size=8)
    assert torch.equal(got[1, 0, 8:], fake_quantize_group(v[1, 0, 8:]))
    assert torch.equal(got[2, 1, :8], fake_quantize_group(v[2, 1, :8]))
    assert torch.equal(quantize_rows(v, "v", bits=4, group_size=64)[0, 1], fake_quantize_group(v[0, 1]))


def test_absent_residual_means_inherited_not_code_zero():
    gen = torch.Generator().manual_seed(15)
    prev = torch.randn(6, 1, 4, generator=gen)
    x = prev + 0.5 + 0.5 * torch.rand(6, 1, 4, generator=gen)  # deltas in [0.5, 1]: min far from 0
    has_row = torch.tensor([True, False, True, True, False, True])
    got = residual_encode(prev, x, has_row, "k", bits=4, group_size=2)
    assert torch.equal(got[~has_row], prev[~has_row])
    rows = has_row.nonzero().flatten()
    assert torch.equal(got[rows], prev[rows] + quantize_rows(x[rows] - prev[rows], "k", 4, 2))  # compact groups
    # Code 0 of such a group decodes to its minimum, which is not "no change".
    groups = quantize((x - prev)[rows[:2]], 0, bits=4)
    assert (groups.lo >= 0.49).all()


def test_seal_positions_and_reads():
    seal = seal_positions(None, torch.ones(18, dtype=torch.bool), group_size=4, tail=4)
    assert seal[:4].tolist() == [7] * 4 and seal[12:16].tolist() == [19] * 4
    assert (seal[16:] == NEVER).all()  # a short group never seals
    # Residual plane: compact rows 0, 2, 3, 4 | 6, 7, 8, 9 | 10, 12; predecessors bound the seal.
    has_row = torch.tensor([i not in (1, 5, 11, 13, 14, 15, 16, 17) for i in range(18)])
    seal2 = seal_positions(seal, has_row, group_size=4, tail=4)
    assert seal2[[0, 2, 3, 4]].tolist() == [11] * 4  # max(4 + 4, seal of row 4 = 11)
    assert seal2[[6, 7, 8, 9]].tolist() == [15] * 4  # max(9 + 4, seal of rows 8, 9 = 15)
    assert (seal2[[10, 12]] == NEVER).all()
    assert torch.equal(seal2[~has_row], seal[~has_row])
    exact, hat = torch.zeros(18, 2), torch.ones(18, 2)
    read = read_kv(exact, hat, seal2, torch.tensor([10, 11, 17]))
    assert read[0, 0].tolist() == [0, 0] and read[1, 0].tolist() == [1, 1]  # token 0 seals at 11
    assert read[2, 6].tolist() == [1, 1] and read[2, 10].tolist() == [0, 0] and read[2, 1].tolist() == [1, 1]


def test_kv_residual_serial_visibility(gqa):
    w, cfg = gqa
    ids, prompt_len = _ids(40, cfg, seed=16), 30
    kvr = KVResidual(bits=4, group_size=8, tail=8)
    out = flashloop_forward(w, cfg, ids, prompt_len, FlashLoopFeatures(kv_residual=kvr))
    dense = flashloop_forward(w, cfg, ids, prompt_len, DENSE)
    # The first group (positions 0-7) seals for queries at 7 + 8 = 15: earlier ones read exact values.
    assert out.audit.seal[:, :8].eq(15).all()
    _close(out.loop_hidden[:, :15], dense.loop_hidden[:, :15], atol=1e-12)
    _close(out.logits[:15], dense.logits[:15], atol=1e-12)
    assert (out.loop_hidden[0, 15] - dense.loop_hidden[0, 15]).abs().max() > 1e-6
    # X^1 = D(Q(X1)) over all tokens; every plane's error is recorded over its stored rows.
    _close(out.audit.loop_keys_hat[0, 1], quantize_rows(out.audit.loop_keys[0, 1], "k", 4, 8), atol=0)
    assert set(out.audit.reconstruction_error) == {(i, r, kind) for i in range(2) for r in range(1, 5)
                                                 for kind in "kv"}


def test_kv_residual_default_tail(gqa):
    # group 64, tail 64: the first group seals at 63 + 64 = 127.
    w, cfg = gqa
    ids = _ids(132, cfg, seed=17)
    out = flashloop_forward(w, cfg, ids, 100, FlashLoopFeatures(kv_residual=KVResidual()))
    dense = flashloop_forward(w, cfg, ids, 100, DENSE)
    seal = out.audit.seal[0]
    assert seal[:64].eq(127).all() and seal[64:128].eq(191).all() and seal[128:].eq(NEVER).all()
    _close(out.logits[:127], dense.logits[:127], atol=1e-12)
    assert (out.logits[127:] - dense.logits[127:]).abs().max() > 1e-6


def test_kv_residual_with_sparse_prefill_inherits_and_bounds_errors(gqa):
    w, cfg = gqa
    ids, prompt_len = _ids(48, cfg, seed=18), 40
    features = FlashLoopFeatures(SparsePrefill(window=8), None, KVResidual(bits=4, group_size=4, tail=4))
    out = flashloop_forward(w, cfg, ids, prompt_len, features, exit_threshold=0.8)
    a = out.audit
    for loop in range(2, cfg.num_loops + 1):
        ran = out.active[loop - 1]
        assert torch.equal(a.loop_keys_hat[loop - 1][:, ~ran], a.loop_keys_hat[loop - 2][:, ~ran])
        assert torch.equal(a.loop_values_hat[loop - 1][:, ~ran], a.loop_values_hat[loop - 2][:, ~ran])
        assert torch.equal(a.seal[loop - 1, ~ran], a.seal[loop - 2, ~ran])
        for layer in range(cfg.num_hidden_layers if ran.any() else 0):
            for kind, exact, hat in (("k", a.loop_keys, a.loop_keys_hat), ("v", a.loop_values, a.loop_values_hat)):
                delta = exact[loop - 1, layer, ran] - hat[loop - 2, layer, ran]
                err = (hat[loop - 1, layer, ran] - exact[loop - 1, layer, ran]).abs().max()
                assert a.reconstruction_error[(layer, loop, kind)] == pytest.approx(float(err), abs=1e-12)
                # Each element is within half a step of its group (whose range is within the plane's).
                span = float(delta.max() - delta.min())
                assert float(err) <= span / 30 * 1.01 + float(delta.abs().max()) * 2**-9 + 1e-9
    assert (out.active[2:, :prompt_len] == False).any()  # noqa: E712  some rows were absent


# --- all together -------------------------------------------------------------------------

def test_all_features_together(model):
    w, cfg = model
    ids, prompt_len = _ids(48, cfg, seed=19), 32
    dense = flashloop_forward(w, cfg, ids, prompt_len, DENSE)
    mild = FlashLoopFeatures(SparsePrefill(window=16, retention=(1.0, 1.0, 0.75, 0.5)), SparseDecode(0.5),
                             KVResidual(bits=8, group_size=8, tail=8))
    out = flashloop_forward(w, cfg, ids, prompt_len, mild, exit_threshold=0.9)
    assert torch.isfinite(out.logits).all()
    rel = float((out.logits - dense.logits).norm() / dense.logits.norm())
    assert 0.0 < rel < 1.0
    default = FlashLoopFeatures(SparsePrefill(window=16), SparseDecode(), KVResidual(group_size=8, tail=8))
    out = flashloop_forward(w, cfg, ids, prompt_len, default)
    assert torch.isfinite(out.logits).all() and not torch.equal(out.logits, dense.logits)
    assert len(flashloop_greedy(w, cfg, ids[:prompt_len].tolist(), 2, default)) == 2
