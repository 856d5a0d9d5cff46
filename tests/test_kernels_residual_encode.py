"""The residual encoding kernel (`specloop.kernels.residual_encode`) against the torch path
it replaces (`PackedResiduals.encode`), byte for byte.

Three `PackedResiduals` run the same passes in lockstep (random nested rows over 4 planes
and two cells, a wavefront of chunks, every group of every plane a candidate in every pass,
some held back by `valid` or by the committed length): one encodes with the torch path, one
with the kernel (`PackedResiduals.encode`'s launch of every plane at once, or a launch per
plane), and one with the module's torch reference, plane by plane. Every record
starts as random bytes (NaN and inf scales included). After each pass: every byte of every
pool but the sink equals the torch path's (which sends its not-ready candidates to the
sink); the kernel's pools equal the reference's everywhere, sink included, and the sink
and the records of candidates that were not ready are unchanged; `reconstruct` reads the
same bits at every depth. The runs must hold groups that encode in the same call as the
plane-(p - 1) group their residual reads, constant groups and scales clamped at 2^-24.

Runs natively on CUDA and under Triton's interpreter on CPU (tests/conftest.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from specloop.kernels.int4_groups import GROUP
from specloop.kernels.packed_rows import NEVER
from specloop.kernels.residual_encode import encode_groups
from specloop.flashloop.kv_residual.planes import EncodePlan, PackedResiduals
from tests.test_kv_residual import _schedule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16
LAYERS, PLANES = 2, 4
POOLS = ("k_codes", "k_scale", "k_lo", "v_codes", "v_scale", "v_lo")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that comparisons see NaN payloads and -0.0."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    differ = _bits(got) != _bits(want)
    assert not differ.any(), f"{what}: {int(differ.sum())} of {got.numel()} differ"


def _pool(store: PackedResiduals, name: str, sink: bool) -> torch.Tensor:
    """A pool tensor, every layer, with (sink=False) or without (True: only) the sink's rows."""
    t = getattr(store, name)
    per = GROUP if name.startswith("v_") else 1
    return t[:, store.sink * per:] if sink else t[:, : store.sink * per]


def _rows(t: int, keep: tuple[float, ...], gen: torch.Generator) -> torch.Tensor:
    """[P, T] bool: plane 0 all tokens, plane p a random subset of plane p - 1 (nested, as
    the runtime's rows are), or of all tokens when keep[0] < 0 (not nested: a row may skip
    planes, which the reconstruction must then skip too)."""
    has = torch.ones(PLANES, t, dtype=torch.bool)
    for p in range(1, PLANES):
        has[p] = (has[p - 1] if keep[0] > 0 else True) & (torch.rand(t, generator=gen) < keep[p])
    return has


def _exact(t: int, heads: int, dim: int, dtype: torch.dtype, has: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[L, K/V, P, T, H, D]: random values, a token without a row at plane p inheriting p - 1;
    K channel 1 constant over the tokens (constant groups, residual 0 after plane 0), K
    channel 2 a spread under 2^-24 * 15 (the scale clamp), V head 0 of every 5th token
    one value (constant V groups)."""
    x = torch.randn(LAYERS, 2, PLANES, t, heads, dim, generator=gen)
    x[:, 0, :, :, :, 1] = 0.75
    x[:, 0, :, :, :, 2] = 1e-7 * torch.randn(LAYERS, PLANES, t, heads, generator=gen)
    x[:, 1, :, ::5, 0] = x[:, 1, :, ::5, 0, :1]
    x = x.to(dtype)
    for p in range(1, PLANES):
        x[:, :, p] = torch.where(has[p][None, None, :, None, None], x[:, :, p], x[:, :, p - 1])
    return x


def _kernel_encode(store: PackedResiduals, layer: int, plan: EncodePlan, k_tail: torch.Tensor, v_tail: torch.Tensor,
                   tables: torch.Tensor, use_triton: bool) -> None:
    """A launch per plane, in plane order (`encode_groups`: Triton, or the torch reference)."""
    for p in range(len(plan.cells)):
        if plan.cells[p].numel():
            encode_groups(k_tail, v_tail, tables, PAGE, p, plan.cells[p], plan.positions[p], plan.records[p],
                          plan.ready[p], plan.table_offsets[p], *(getattr(store, n)[layer] for n in POOLS),
                          store.group_tables, store.row_maps, use_triton=use_triton)


def _run(dim: int, heads: int, dtype: torch.dtype, keeps: list[tuple[float, ...]], t: int, seed: int,
         one_launch: bool = True, policy: str = "serial") -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cells = len(keeps)
    has = [_rows(t, keep, gen) for keep in keeps]
    exact = [_exact(t, heads, dim, dtype, h, gen) for h in has]
    groups = -(-t // GROUP)
    stores = [PackedResiduals(LAYERS, cells * PLANES * groups + 2, cells + 1, PLANES, t, heads, dim, 64, dtype,
                              torch.device(DEVICE), policy) for _ in range(3)]
    torch_path, kernel, reference = stores
    # the kernel store plans and encodes with its Triton launches (on CPU too: the interpreter);
    # the others plan with the torch path (what the Triton plan must match), and encode with the
    # torch path and with the module's reference
    torch_path.encode_triton, kernel.encode_triton, reference.encode_triton = False, True, False
    cell_ids = [c + 1 for c in range(cells)]  # cell 0 stays unused
    records = list(range(torch_path.sink))
    rng.shuffle(records)
    assignment = {(c, p): torch.tensor([records.pop() for _ in range(groups)]) for c in cell_ids for p in range(PLANES)}
    for name in POOLS:  # every record, the sink included, starts as random bytes
        poison = torch.randint(0, 256, _bits(getattr(torch_path, name)).shape, generator=gen, dtype=torch.int32)
        for store in stores:
            _bits(getattr(store, name)).copy_(poison.to(_bits(getattr(store, name)).dtype))
    sink_before = [_pool(kernel, name, True).clone() for name in POOLS]
    for store in stores:
        store.reset(torch.tensor(cell_ids, device=DEVICE))
        for (c, p), recs in assignment.items():
            store.assign(c, p, torch.arange(recs.numel(), device=DEVICE), recs.to(DEVICE))
    pages_per = t // PAGE
    tables = torch.arange((cells + 1) * PLANES * pages_per, device=DEVICE)
    tail = torch.full((LAYERS, 2, tables.numel() * PAGE, heads, dim), float("nan"), dtype=dtype, device=DEVICE)

    def offset(c: int, p: int) -> int:
        return (c * PLANES + p) * pages_per

    done0 = 0  # positions with a plane-0 row
    encoded_per_plane, chained, written = [0] * PLANES, 0, []
    for chunks in _schedule(t, rng, (1, 3, 17, 64, 100, 200)):
        call = [(c, p, s, e) for c in cell_ids for (p, s, e) in chunks]
        rng.shuffle(call)
        cols: list[list] = [[], [], [], []]
        for c, p, s, e in call:
            span = torch.arange(s, e)
            tail[:, :, offset(c, p) * PAGE + span] = exact[c - 1][:, :, p, s:e].to(DEVICE)
            cols[0] += [c] * (e - s)
            cols[1] += [p] * (e - s)
            cols[2].append(span)
            cols[3].append(has[c - 1][p, s:e])
            done0 = max(done0, e) if p == 0 else done0
        row_args = (torch.tensor(cols[0]), torch.tensor(cols[1]), torch.cat(cols[2]), torch.cat(cols[3]))
        # candidates per plane and cell: the last encoded group (not ready again), the next
        # two and a random one, shuffled; some held back (valid), a committed length short of t at times
        cand = []
        for p in range(PLANES):
            pairs = [(c, g) for c in cell_ids
                     for g in sorted({*range(max(0, int(kernel.encoded[c, p]) - 1),
                                             min(groups, int(kernel.encoded[c, p]) + 2)), rng.randrange(groups)})]
            rng.shuffle(pairs)
            cand.append(torch.tensor(pairs).view(-1, 2))
        valid = [torch.rand(len(c), generator=gen) < 0.85 for c in cand]
        committed = torch.tensor([t] + [rng.choice([t, t, rng.randrange(t)]) for _ in cell_ids])
        # the execution policy's first query per (cell, plane): NEVER (no query) or anywhere up to t + 64
        first = torch.tensor([[rng.choice([NEVER, rng.randrange(t + 64), t + 64, t + 64]) for _ in range(PLANES)]
                              for _ in range(cells + 2)]) if policy == "execution" else None
        plans = []
        for store in stores:
            store.append(*(a.to(DEVICE) for a in row_args))
            plan = EncodePlan(
                cells=[c[:, 0].contiguous().to(DEVICE) for c in cand],
                groups=[c[:, 1].contiguous().to(DEVICE) for c in cand],
                table_offsets=[torch.tensor([offset(int(c), p) for c in cand[p][:, 0]], device=DEVICE)
                               for p in range(PLANES)],
                valid=[v.to(DEVICE) for v in valid])
            plans.append(store.plan_encode(plan, committed.to(DEVICE), None if first is None else first.to(DEVICE)))
        for p in range(PLANES):  # the Triton plan decides what the torch path decides
            for field in ("ready", "records", "positions"):
                _same(getattr(plans[1], field)[p], getattr(plans[0], field)[p], f"plan {field}, plane {p}")
        _same(kernel.seal, torch_path.seal, "seals after the plan")
        _same(kernel.encoded, torch_path.encoded, "encoded groups after the plan")
        before = [getattr(kernel, name).clone() for name in POOLS]
        for layer in range(LAYERS):
            torch_path.encode(layer, plans[0], tail[layer, 0], tail[layer, 1], tables, PAGE)
            if one_launch:  # the engine's path: every plane in one launch, plane p's programs waiting for p - 1's
                kernel.encode(layer, plans[1], tail[layer, 0], tail[layer, 1], tables, PAGE)
            else:
                _kernel_encode(kernel, layer, plans[1], tail[layer, 0], tail[layer, 1], tables, use_triton=True)
            _kernel_encode(reference, layer, plans[2], tail[layer, 0], tail[layer, 1], tables, use_triton=False)
        plan = plans[1]
        for name in POOLS:
            _same(_pool(torch_path, name, False), _pool(kernel, name, False), f"{name} against the torch path")
            _same(getattr(kernel, name), getattr(reference, name), f"{name} against the reference")
        for name, old_sink in zip(POOLS, sink_before):
            _same(_pool(kernel, name, True), old_sink, f"{name}: the sink")
        for p in range(PLANES):  # the records of candidates that were not ready are untouched
            ready = plan.ready[p].cpu()
            encoded_per_plane[p] += int(ready.sum())
            written.append(plan.records[p][plan.ready[p]])
            idle = kernel.group_tables[plan.cells[p], p, plan.groups[p]].long().cpu()[~ready]
            for name, old in zip(POOLS, before):
                per = GROUP if name.startswith("v_") else 1
                rows = (idle[:, None] * per + torch.arange(per)).flatten().to(DEVICE)
                _same(getattr(kernel, name)[:, rows], old[:, rows], f"{name} of a candidate that was not ready")
            if p > 0:  # ready groups whose residual reads a plane-(p - 1) group encoded in this call
                cell, rec = plan.cells[p][plan.ready[p]], plan.records[p][plan.ready[p]]
                last = kernel.row_pos[rec, GROUP - 1].long()
                pred_row = kernel.row_maps[cell, p - 1, last].long()
                pred = kernel.group_tables[cell, p - 1, pred_row // GROUP].long()
                fresh = plan.records[p - 1][plan.ready[p - 1]]
                chained += int(torch.isin(pred, fresh).sum())
        positions = torch.arange(done0, device=DEVICE)[None].expand(cells, -1)
        for depth in range(PLANES):
            for layer in range(LAYERS):
                got = kernel.reconstruct(layer, torch.tensor(cell_ids, device=DEVICE), depth, positions)
                want = torch_path.reconstruct(layer, torch.tensor(cell_ids, device=DEVICE), depth, positions)
                _same(got[0], want[0], f"K read at depth {depth}")
                _same(got[1], want[1], f"V read at depth {depth}")
    assert all(n > 0 for n in encoded_per_plane), encoded_per_plane
    assert chained > 0, "no group encoded in the same call as the plane-(p - 1) group it reads"
    written = torch.cat(written)
    k_scale, v_scale = kernel.k_scale[:, written], kernel.v_scale[:, (written[:, None] * GROUP + torch.arange(
        GROUP, device=DEVICE)).flatten()]
    assert (k_scale == 1).any() and (v_scale == 1).any(), "no constant group"
    assert (k_scale == 2.0**-24).any(), "no scale clamped at 2^-24"


@pytest.mark.parametrize("dim, heads, dtype", [
    (16, 1, torch.float32),
    (16, 2, torch.bfloat16),
    (128, 2, torch.float32),
    (128, 1, torch.bfloat16),
    (96, 1, torch.bfloat16),
])
def test_kernel_encodes_what_the_torch_path_encodes(dim, heads, dtype):
    """Head dims 16 (one V group of 16 channels), 128 (two) and 96 (a full V group and a
    half one: masked lanes inside a tile), one and two KV heads; two cells, one dense and
    one sparse at deeper planes."""
    _run(dim, heads, dtype, [(1, 1, 1, 1), (1, 0.8, 0.6, 0.5)], t=256, seed=dim + heads)


def test_fp16_and_rows_that_skip_planes():
    """fp16; a cell whose rows are not nested (a row at plane p without one at p - 1)."""
    _run(16, 2, torch.float16, [(1, 0.5, 0.5, 0.5), (-1, 0.8, 0.7, 0.9)], t=256, seed=7)


def test_the_execution_policy():
    """Groups seal at the pass's first query (`first`), committed or not: the Triton plan
    decides what the torch path decides, and the encoder writes the same bytes."""
    _run(16, 2, torch.bfloat16, [(1, 1, 1, 1), (1, 0.8, 0.6, 0.5)], t=256, seed=5, policy="execution")


def test_a_launch_per_plane():
    """The one-plane launch (`encode_groups_triton`: every candidate at one plane, nothing
    to wait for), plane by plane, encodes the same bytes."""
    _run(16, 2, torch.bfloat16, [(1, 1, 1, 1), (1, 0.8, 0.6, 0.5)], t=256, seed=18, one_launch=False)
