"""The packed INT4 residual planes against the FlashLoop reference's fake quantization.

A sequence of tokens with random nested rows (every token at plane 0; deeper planes drop
tokens at random, as token-sparse prefill and adaptive exit do) runs through
`PackedResiduals` incrementally: passes that each hold chunks of several planes and
several cells (the wavefront), rows appended, candidates planned, every layer encoded.
After every pass, every query of the pass reads each earlier key either exact (from the
tail) or reconstructed, by its seal; that must equal `read_kv` of the reference computed
over the whole sequence (`residual_encode`, `seal_positions`), bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from specloop.model.flashloop_reference import NEVER as REF_NEVER
from specloop.model.flashloop_reference import quantize_rows, read_kv, residual_encode, seal_positions
from specloop.flashloop.kv_residual.planes import NEVER, EncodePlan, PackedResiduals

PAGE = 16
LAYERS, PLANES, HEADS = 2, 4, 2


def _rows(t: int, keep: tuple[float, ...], seed: int) -> torch.Tensor:
    """[P, T] bool, nested: plane 0 all tokens, plane p a random subset of plane p - 1."""
    g = torch.Generator().manual_seed(seed)
    has = torch.ones(PLANES, t, dtype=torch.bool)
    for p in range(1, PLANES):
        has[p] = has[p - 1] & (torch.rand(t, generator=g) < keep[p])
    return has


class _Sequence:
    """One cell's token sequence: exact K/V per plane and layer, the reference's view."""

    def __init__(self, t: int, dim: int, dtype: torch.dtype, keep: tuple[float, ...], tail: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed + 1)
        self.t, self.has = t, _rows(t, keep, seed)
        # exact values as the tail holds them: a token without a row at plane p inherits p - 1
        x = torch.randn(LAYERS, 2, PLANES, t, HEADS, dim, generator=g).to(dtype)
        for p in range(1, PLANES):
            x[:, :, p] = torch.where(self.has[p][None, None, :, None, None], x[:, :, p], x[:, :, p - 1])
        self.exact = x  # [L, K/V, P, T, H, D]
        self.hat = torch.empty_like(x)
        for layer in range(LAYERS):
            for i, kind in enumerate("kv"):
                self.hat[layer, i, 0] = quantize_rows(x[layer, i, 0], kind, 4, 64)
                for p in range(1, PLANES):
                    self.hat[layer, i, p] = residual_encode(self.hat[layer, i, p - 1], x[layer, i, p], self.has[p],
                                                            kind, 4, 64)
        seals = [seal_positions(None, self.has[0], 64, tail)]
        for p in range(1, PLANES):
            seals.append(seal_positions(seals[-1], self.has[p], 64, tail))
        self.seal = torch.stack(seals)  # [P, T]

    def read(self, layer: int, depth: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a query at position q and plane `depth` reads of keys 0..q (the reference)."""
        out = []
        for i in range(2):
            exact, hat = self.exact[layer, i, depth, : q + 1], self.hat[layer, i, depth, : q + 1]
            out.append(read_kv(exact, hat, self.seal[depth, : q + 1], torch.tensor([q]))[0])
        return out[0], out[1]


def _schedule(t: int, rng: random.Random, lengths: tuple[int, ...] = (1, 1, 3, 17, 64, 100, 200)
              ) -> list[list[tuple[int, int, int]]]:
    """Passes of (plane, start, end) chunks: plane p runs positions plane p - 1 finished in an
    earlier pass (the wavefront); chunk lengths drawn from `lengths`, single tokens included.
    tests/test_kernels_residual_encode.py schedules with it too."""
    done = [0] * PLANES
    passes = []
    while done[-1] < t:
        chunks, snapshot = [], list(done)
        for p in range(PLANES):
            limit = t if p == 0 else snapshot[p - 1]
            if done[p] < limit and rng.random() < 0.8:
                end = min(limit, done[p] + rng.choice(lengths))
                chunks.append((p, done[p], end))
                done[p] = end
        if chunks:
            passes.append(chunks)
    return passes


def _run(dim: int, dtype: torch.dtype, keeps: list[tuple[float, ...]], t: int, tail: int, seed: int) -> None:
    rng = random.Random(seed)
    cells = len(keeps)
    seqs = [_Sequence(t, dim, dtype, keep, tail, seed + 10 * c) for c, keep in enumerate(keeps)]
    groups = -(-t // 64)
    store = PackedResiduals(LAYERS, cells * PLANES * groups + 3, cells + 1, PLANES, t, HEADS, dim, tail, dtype,
                            torch.device("cpu"))
    cell_ids = [c + 1 for c in range(cells)]  # cell 0 stays unused: indices must not assume 0-based requests
    store.reset(torch.tensor(cell_ids))
    records = list(range(store.sink))
    rng.shuffle(records)  # records in any order
    for c in cell_ids:
        for p in range(PLANES):
            store.assign(c, p, torch.arange(groups), torch.tensor([records.pop() for _ in range(groups)]))
    # the tail: plane p of cell c at pages [(c * P + p) * t / PAGE, ...)
    pages_per = t // PAGE
    tables = torch.arange((cells + 1) * PLANES * pages_per)
    tail = torch.full((LAYERS, 2, tables.numel() * PAGE, HEADS, dim), float("nan"), dtype=dtype)

    def offset(c: int, p: int) -> int:
        return (c * PLANES + p) * pages_per

    committed = torch.full((cells + 1,), t)
    for chunks in _schedule(t, rng):
        call = [(c, p, s, e) for c in cell_ids for (p, s, e) in chunks]
        rng.shuffle(call)  # rows of a pass in any order
        cell_col, depth_col, pos_col, act_col = [], [], [], []
        for c, p, s, e in call:
            seq = seqs[c - 1]
            span = torch.arange(s, e)
            slot = offset(c, p) * PAGE + span
            tail[:, :, slot] = seq.exact[:, :, p, s:e]  # the pass's K/V writes (inherited rows: the copy)
            cell_col += [c] * (e - s)
            depth_col += [p] * (e - s)
            pos_col.append(span)
            act_col.append(seq.has[p, s:e])
        store.append(torch.tensor(cell_col), torch.tensor(depth_col), torch.cat(pos_col), torch.cat(act_col))
        plan = EncodePlan(
            cells=[torch.tensor(cell_ids).repeat_interleave(groups) for _ in range(PLANES)],
            groups=[torch.arange(groups).repeat(cells) for _ in range(PLANES)],
            table_offsets=[torch.tensor([offset(c, p) for c in cell_ids]).repeat_interleave(groups)
                           for p in range(PLANES)])
        store.plan_encode(plan, committed)
        for layer in range(LAYERS):
            store.encode(layer, plan, tail[layer, 0], tail[layer, 1], tables, PAGE)
        for c, p, s, e in call:  # every query of the pass reads what the reference reads
            seq = seqs[c - 1]
            for q in sorted({s, e - 1, rng.randrange(s, e)}):
                keys = torch.arange(q + 1)
                seal = store.seals(torch.tensor([c]), p, keys[None])[0]
                for layer in range(LAYERS):
                    k_hat, v_hat = store.reconstruct(layer, torch.tensor([c]), p, keys[None])
                    sealed = (q >= seal)[:, None, None]
                    slots = offset(c, p) * PAGE + keys
                    k = torch.where(sealed, k_hat[0], tail[layer, 0, slots])
                    v = torch.where(sealed, v_hat[0], tail[layer, 1, slots])
                    want_k, want_v = seq.read(layer, p, q)
                    assert torch.equal(k, want_k), (c, p, q, layer, "K")
                    assert torch.equal(v, want_v), (c, p, q, layer, "V")
    for c in cell_ids:  # every finite reference seal is the store's (all of it was queried past)
        seq = seqs[c - 1]
        for p in range(PLANES):
            got = store.seals(torch.tensor([c]), p, torch.arange(t)[None])[0]
            want = seq.seal[p]
            sealed = want <= t - 1
            assert torch.equal(got[sealed], want[sealed])
            assert (got[~sealed] >= t).all()
            assert ((want == REF_NEVER) <= (got == NEVER)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_planes_match_the_reference(dtype):
    _run(16, dtype, [(1, 1, 1, 1)], t=320, tail=64, seed=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_planes_and_two_cells_match_the_reference(dtype):
    """Token-sparse prefill's retention and exits: rows absent at deeper planes (inherited),
    groups over compact rows whose seals wait for the plane before; two cells per pass."""
    _run(16, dtype, [(1, 1, 0.25, 0.1), (1, 0.7, 0.6, 0.5)], t=640, tail=64, seed=1)


def test_head_dim_128_and_other_tails():
    """Two V groups per head; a tail shorter and one longer than a group."""
    _run(128, torch.bfloat16, [(1, 1, 0.5, 0.5)], t=320, tail=3, seed=2)
    _run(16, torch.float32, [(1, 0.9, 0.9, 0.9)], t=320, tail=130, seed=3)


def test_uncommitted_rows_never_seal():
    """A group whose last row is at or past the committed length stays exact (NEVER) even
    when full; it encodes once the length passes it."""
    store = PackedResiduals(1, 4, 1, 1, 128, 1, 16, 64, torch.float32, torch.device("cpu"))
    store.reset(torch.tensor([0]))
    store.assign(0, 0, torch.arange(2), torch.tensor([2, 0]))
    store.append(torch.zeros(128, dtype=torch.long), torch.zeros(128, dtype=torch.long), torch.arange(128),
                 torch.ones(128, dtype=torch.bool))
    plan = EncodePlan([torch.tensor([0, 0])], [torch.tensor([0, 1])], [torch.tensor([0, 0])])
    store.plan_encode(plan, torch.tensor([100]))
    assert plan.ready[0].tolist() == [True, False] and store.encoded[0, 0].item() == 1
    assert store.seal[2].item() == 63 + 64 and store.seal[0].item() == NEVER
    store.plan_encode(plan, torch.tensor([128]))
    assert plan.ready[0].tolist() == [False, True] and store.seal[0].item() == 127 + 64


def test_costs():
    # ouro-1.4b: 24 layers, 16 KV heads, head dim 128
    per_record = PackedResiduals.record_bytes(24, 16, 128)
    bf16_row = 2 * 24 * 16 * 128 * 2  # one token of one plane in BF16 pages
    assert per_record == 24 * (32 * 16 * 128 * 2 + 4 * 16 * 128 + 64 * 16 * 2 * 4) + 260
    assert 3.5 < 64 * bf16_row / per_record < 3.6  # 4.5 bits an element against 16


# --- configuration ---------------------------------------------------------------------

def test_configuration_parses_and_defaults():
    from specloop.flashloop.config import KVResidualQuantization, summary
    assert not KVResidualQuantization.parse(None).enabled
    on = KVResidualQuantization.parse("{}")
    assert on.enabled and (on.bits, on.group_size, on.tail, on.policy) == (4, 64, 64, "serial")
    assert summary(KVResidualQuantization.parse({"tail": 32, "policy": "execution"})) == {
        "enabled": True, "bits": 4, "group_size": 64, "tail": 32, "policy": "execution", "tail_share": None}
    assert KVResidualQuantization.parse({"tail_share": 0.25}).tail_share == 0.25  # null: derived from the workload


@pytest.mark.parametrize("value, message", [
    ({"bits": 8}, "bits must be 4"),
    ({"group_size": 32}, "group_size must be 64"),
    ({"tail": 0}, "tail must be a positive integer"),
    ({"policy": "eager"}, "policy must be one of serial, execution"),
    ({"tail_share": 1.0}, r"tail_share must lie in \(0, 1\)"),
    ({"tail_share": True}, r"tail_share must lie in \(0, 1\)"),
    ({"enabled": "yes"}, "enabled must be true or false"),
    ({"window": 3}, "has no option 'window'"),
    ("[1]", "must be a JSON object"),
])
def test_configuration_errors_are_one_line(value, message):
    from specloop.errors import ConfigError
    from specloop.flashloop.config import KVResidualQuantization
    with pytest.raises(ConfigError, match=message) as info:
        KVResidualQuantization.parse(value)
    assert "\n" not in str(info.value)


# --- the execution policy --------------------------------------------------------------

def _exec_store(t: int, planes: int = 2, dim: int = 16) -> tuple[PackedResiduals, torch.Tensor, torch.Tensor]:
    """An execution-policy store of one cell (0) with records for t rows in every plane, its
    tail [L, K/V, planes * t, H, D] (plane p's positions at slots p * t + position) and page
    tables (identity, plane p's at offset p * t / PAGE)."""
    groups = -(-t // 64)
    store = PackedResiduals(LAYERS, planes * groups, 1, planes, t, HEADS, dim, 64, torch.float32,
                            torch.device("cpu"), policy="execution")
    store.reset(torch.tensor([0]))
    for p in range(planes):
        store.assign(0, p, torch.arange(groups), torch.arange(groups) + p * groups)
    tail = torch.full((LAYERS, 2, planes * t, HEADS, dim), float("nan"))
    return store, tail, torch.arange(planes * t // PAGE)


def _exec_pass(store: PackedResiduals, tail: torch.Tensor, tables: torch.Tensor, t: int,
               rows: list[tuple[int, torch.Tensor, torch.Tensor]], first: list[int]) -> EncodePlan:
    """One pass: rows (plane, positions, has-row) with their exact values written at
    `values[plane][..]`, every group a candidate, the pass's first query per plane."""
    cells, depths, positions, active = [], [], [], []
    for p, pos, has in rows:
        cells.append(torch.zeros_like(pos))
        depths.append(torch.full_like(pos, p))
        positions.append(pos)
        active.append(has)
    store.append(torch.cat(cells), torch.cat(depths), torch.cat(positions), torch.cat(active))
    groups = -(-t // 64)
    plan = EncodePlan(cells=[torch.zeros(groups, dtype=torch.long) for _ in range(store.num_planes)],
                      groups=[torch.arange(groups) for _ in range(store.num_planes)],
                      table_offsets=[torch.full((groups,), p * t // PAGE) for p in range(store.num_planes)])
    store.plan_encode(plan, torch.tensor([2**62]), torch.tensor([first]))
    for layer in range(LAYERS):
        store.encode(layer, plan, tail[layer, 0], tail[layer, 1], tables, PAGE)
    return plan


def test_execution_policy_seals_at_the_pass_first_query():
    """A chunk's own groups stay exact for all its queries (serial would seal group 0 at
    127 inside the chunk); the next pass's first query, 64 past group 0, seals it there."""
    t = 256
    store, tail, tables = _exec_store(t, planes=1)
    tail[:, :, :t] = torch.randn(LAYERS, 2, t, HEADS, 16)
    plan = _exec_pass(store, tail, tables, t, [(0, torch.arange(130), torch.ones(130, dtype=torch.bool))], [0])
    assert not plan.ready[0].any() and store.encoded[0, 0].item() == 0
    plan = _exec_pass(store, tail, tables, t, [(0, torch.tensor([130]), torch.ones(1, dtype=torch.bool))], [130])
    assert plan.ready[0].tolist() == [True, False, False, False]  # group 1 (last 127) waits for 191
    assert store.seal[0].item() == 130 and store.seal[1].item() == NEVER
    # a pass without queries of the plane seals nothing (NEVER is no safe point)
    plan = _exec_pass(store, tail, tables, t, [(0, torch.arange(131, 200), torch.ones(69, dtype=torch.bool))],
                      [NEVER])
    assert not plan.ready[0].any()


def test_execution_rollback_unseals_and_re_encodes_the_accepted_rows():
    """Groups sealed over candidates: a rollback to 127 unseals plane 0's group 1 (it loses
    row 127) and plane 1's group 0 (all its rows kept, but its residual was encoded against
    plane 0's group 1). Their seals lie past the committed length, so their tails stay.
    Re-running position 127 with
    the accepted value re-encodes both to the bytes a store that never saw the rejected
    value holds."""
    t, dim = 256, 16
    g = torch.Generator().manual_seed(4)
    exact = torch.randn(LAYERS, 2, 2, t, HEADS, dim, generator=g)  # [L, K/V, plane, T, H, D]
    rejected = exact.clone()
    rejected[:, :, :, 127] = 40 * torch.randn(LAYERS, 2, 2, HEADS, dim, generator=g)  # widens its groups
    has1 = torch.arange(t) % 2 == 0  # plane 1: even positions (group 0 ends at 126, in plane 0's group 1)

    def run(values: torch.Tensor, rollback: bool):
        store, tail, tables = _exec_store(t)
        for p in range(2):
            tail[:, :, p * t: (p + 1) * t] = values[:, :, p]
        pos = torch.arange(200)
        _exec_pass(store, tail, tables, t, [(0, pos, torch.ones(200, dtype=torch.bool)), (1, pos, has1[:200])], [0, 0])
        _exec_pass(store, tail, tables, t, [(0, torch.tensor([200]), torch.ones(1, dtype=torch.bool)),
                                            (1, torch.tensor([200]), has1[200:201])], [200, 200])
        assert store.encoded[0].tolist() == [2, 1]  # plane 0's groups 0, 1; plane 1's group 0
        if rollback:
            cell = torch.tensor([0])
            # a tail page goes back once its seals are <= the committed length (127 here): those of
            # plane 0's group 1 and of plane 1's group 0 lie past it (each seal is past its rows
            # and its predecessor's seal), so their tails stay for the rollback
            seal = store.seals(cell, 1, torch.arange(128)[None])[0]
            assert (seal[has1[:128]] > 127).all() and (seal[64:] > 127).all()
            store.truncate(cell, torch.tensor([127]))
            assert store.encoded[0].tolist() == [1, 0] and store.rows[0].tolist() == [127, 64]
            assert store.seal[1].item() == NEVER and store.seal[4].item() == NEVER  # records of those groups
            for p in range(2):  # the accepted value at 127, and what follows
                tail[:, :, p * t + 127: (p + 1) * t] = exact[:, :, p, 127:]
            pos = torch.arange(127, 201)  # the re-run: its first query (127) seals nothing again
            plan = _exec_pass(store, tail, tables, t, [(0, pos, torch.ones(74, dtype=torch.bool)),
                                                       (1, pos, has1[127:201])], [127, 127])
            assert not any(r.any() for r in plan.ready)
        _exec_pass(store, tail, tables, t, [(0, torch.tensor([201]), torch.ones(1, dtype=torch.bool)),
                                            (1, torch.tensor([201]), has1[201:202])], [201, 201])
        return store

    got, want = run(rejected, rollback=True), run(exact, rollback=False)
    assert got.encoded[0].tolist() == want.encoded[0].tolist() == [2, 1]
    for name in ("k_codes", "k_scale", "k_lo", "v_codes", "v_scale", "v_lo"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    keys = torch.arange(202)[None]
    for p in range(2):
        for layer in range(LAYERS):
            for a, b in zip(got.reconstruct(layer, torch.tensor([0]), p, keys),
                            want.reconstruct(layer, torch.tensor([0]), p, keys)):
                assert torch.equal(a, b)
