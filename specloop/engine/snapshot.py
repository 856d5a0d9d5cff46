"""Snapshot and restore of one request, for preemption by swap and for moving a request.

A snapshot is taken at a legal point: no ticket in flight holds the request's rows (the
engine commits its tickets in flight first, `EngineCore.snapshot`). It holds everything
the request's future depends on, in a versioned, self-describing dict of plain values
and CPU tensors (`RequestSnapshot.to_bytes` / `from_bytes`, loaded with torch's
weights-only unpickler, so a snapshot file cannot run code):

- `config`: the effective engine configuration a restore must match (model shape and
  dtype, KV format and page size, loops, exit threshold, speculation, engine seed, the
  FlashLoop groups); the
  full engine summary rides along for diagnostics;
- `request`: the host state (ids, sampling parameters, arrival, which keys the sampling
  draws, incarnation, scheduling counters, committed outputs, replay, a prompt window's
  rows planned so far when token-sparse prefill split it) and the speculation
  controller's state (a round or a pipeline mid-flight), with token slots by position;
- `kv`: every page the request holds, per plane, in its stored format, with the frontiers
  and how many leading pages each plane gave back (INT4 residuals: those positions read
  their packed groups, so neither the snapshot nor the restore holds a page for them);
- `residual` (kv_residual_quantization): its cell's compact row maps, row and encoded
  counts per plane, its records' contents (codes, FP16 parameters, row positions, seals)
  in group order;
- `slots`: the contents of its live token slots (hidden, exit state, depth, candidate,
  and for token-sparse prefill the previous hidden state and the selection mark),
  by position, and how many slots its round holds for rows not drafted yet;
- `references` (sparse_decode_attention): the loop-2 reference state of its live
  generated tokens (kept keys cut to the largest count, count, m, O_ref, C_ref, which
  layers hold it), by position; they restore into decode slots;
- `cell`: its request cell's next token and, with speculation, its draft buffer;
- `detokenizer`: the incremental detokenizer's state.

A restore checks the format, version and configuration and that the engine has room
(pages, token slots, a cell) before it changes anything, so a refused restore leaves no
trace; device storage is then written at fresh page, slot and cell indices.
"""

from __future__ import annotations

import dataclasses
import io
from typing import TYPE_CHECKING, Any

import torch

from specloop.engine.detokenizer import IncrementalDetokenizer
from specloop.errors import SpecloopError
from specloop.flashloop.config import summary as group_summary
from specloop.pipeline.rounds import Round
from specloop.pipeline.token_pipeline import LiveToken, PipelineState
from specloop.runtime.forward_batch import ResidualUpdate
from specloop.runtime.slot_storage import SlotStorage
from specloop.sampling_params import SamplingParams
from specloop.scheduling.request import Request, Status, new_incarnation
from specloop.scheduling.residual_records import GROUP as RECORD_ROWS

if TYPE_CHECKING:
    from specloop.engine.core import EngineCore
    from specloop.runtime.kv_residual import PackedResiduals
    from specloop.scheduling.residual_records import ResidualRecords

FORMAT = "specloop.request-snapshot"
VERSION = 6  # 2: token-sparse prefill state (slots' previous hidden and selection, window rows);
# 3: INT4 residual planes (records, compact row maps, counters, released tail pages);
# 4: residual records counted per plane (token-sparse planes hold fewer);
# 5: `kv` holds only the pages not given back, per plane (a list), and how many were
# 6: sparse decode attention's reference state of the live generated tokens (`references`)
SLOT_FIELDS = SlotStorage.CARRIED


class SnapshotError(SpecloopError):
    """A snapshot that cannot be taken or restored here (unknown format or version, another
    configuration, no room); nothing was changed."""


@dataclasses.dataclass
class RequestSnapshot:
    data: dict[str, Any]

    @property
    def request_id(self) -> str:
        return self.data["request"]["request_id"]

    @property
    def num_bytes(self) -> int:
        """Bytes of its tensors (KV, slots, draft buffer): what a swap keeps in host memory."""
        return sum(t.numel() * t.element_size() for t in _tensors(self.data))

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save(self.data, buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "RequestSnapshot":
        try:
            data = torch.load(io.BytesIO(raw), weights_only=True)
        except Exception as exc:
            raise SnapshotError(f"not a request snapshot: {type(exc).__name__}: {exc}") from exc
        return cls(data)


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def engine_fingerprint(core: "EngineCore") -> dict[str, Any]:
    """What a restoring engine must share with the snapshotting one for exact resumption."""
    cfg, mcfg = core.config, core.model.config
    spec = cfg.speculation
    return {
        "model": mcfg.to_hf_dict(),
        "dtype": str(core.model.dtype),
        "kv_format": core.executor.runner.backend.kv.name,
        "block_size": cfg.block_size,
        "exit_threshold": core.executor.runner.threshold,
        "speculation": spec,
        "draft_loops": cfg.draft_loops if spec != "none" else None,
        "num_speculative_tokens": cfg.num_speculative_tokens if spec == "block" else None,
        "seed": cfg.seed,
        "token_sparse_prefill": group_summary(cfg.token_sparse_prefill),
        "kv_residual_quantization": group_summary(cfg.kv_residual_quantization),
        "sparse_decode_attention": group_summary(cfg.sparse_decode_attention),
    }


# ---- capture ---------------------------------------------------------------------------
def capture(core: "EngineCore", req: Request) -> RequestSnapshot:
    """The snapshot of a request at a legal point: no ticket in flight holds its rows (the
    caller's promise: `EngineCore.snapshot` commits every ticket first, a swap-out waits for
    the request's last ticket)."""
    if req.swapped is not None:  # swapped out: its KV lives only in the swap-out snapshot, and
        return req.swapped  # nothing about it has changed since (no ticket holds it)
    residual = None
    if req.status in (Status.RUNNING, Status.SWAPPING):
        if core.executor.runner.residuals is not None:
            residual = _capture_residual(core, req)
        kv, slots, cell = _capture_kv(core, req), _capture_slots(core, req), _capture_cell(core, req)
        references = _capture_references(core, req)
    else:  # waiting (new or preempted by recompute): nothing on the device yet
        kv, slots, cell, references = None, None, None, None
    data = {
        "format": FORMAT,
        "version": VERSION,
        "config": engine_fingerprint(core),
        "engine": core.config.summary(),
        "request": _capture_request(req),
        "kv": kv,
        "slots": slots,
        "cell": cell,
        "residual": residual,
        "references": references,
        "detokenizer": core._detok[req.request_id].state(),
    }
    return RequestSnapshot(data)


def _capture_request(req: Request) -> dict[str, Any]:
    return {
        "request_id": req.request_id,
        "prompt_ids": list(req.prompt_ids),
        "params": dataclasses.asdict(req.params),
        "arrival": req.arrival,
        "stop_ids": sorted(req.stop_ids),
        "status": req.status.value,
        "num_tokens": req.num_tokens,
        "produced": req.produced,
        "speculating": req.speculating,
        "round": _capture_round(req.round),
        "live_positions": sorted(req.token_slots),
        "replay": list(req.replay),
        "window_rows": {str(d): n for d, n in req.window_rows.items()},
        "resume_token": req.resume_token,
        "num_preemptions": req.num_preemptions,
        "output_ids": list(req.output_ids),
        "usage": [req.num_drafts, req.num_draft_tokens, req.num_accepted_tokens],
    }


def _capture_round(state: Any) -> dict[str, Any] | None:
    if state is None:
        return None
    if isinstance(state, Round):
        fields = dataclasses.asdict(state)
        fields["slots"] = None if state.slots is None else len(state.slots)  # held for rows not drafted yet
        return {"kind": "round", **fields}
    if isinstance(state, PipelineState):
        return {"kind": "pipeline", "limit": state.limit, "live": [dataclasses.asdict(t) for t in state.live]}
    raise SnapshotError(f"unknown controller state {type(state).__name__}")


def _capture_kv(core: "EngineCore", req: Request) -> dict[str, Any]:
    store, kvm = core.executor.runner.backend.kv, core.kv
    planes = range(kvm.num_planes)
    released = [kvm.released(req.kv_key, p) for p in planes]
    rows = [_page_rows(kvm.page_table(req.kv_key, p)[r:], store.page_size, store.k.device)
            for p, r in zip(planes, released)]
    return {
        "frontiers": [kvm.frontier(req.kv_key, p) for p in planes],
        "pages_per_plane": len(kvm.page_table(req.kv_key, 0)),
        "released": released,
        "k": [store.k[:, r].cpu() for r in rows],  # per plane [layers, (pages - released) * page_size, Hkv, D]
        "v": [store.v[:, r].cpu() for r in rows],
    }


RECORD_FIELDS = ("k_codes", "k_scale", "k_lo")  # indexed by record
ROW_FIELDS = ("v_codes", "v_scale", "v_lo")  # indexed by record * 64 + row


def _record_rows(ids: torch.Tensor) -> torch.Tensor:
    return (ids[:, None] * RECORD_ROWS + torch.arange(RECORD_ROWS, device=ids.device)).flatten()


def _capture_residual(core: "EngineCore", req: Request) -> dict[str, Any]:
    """The request's INT4 residual planes: its cell's maps and counters over the positions
    its pages cover, and its records' contents in (plane, group) order."""
    store, kvm = core.executor.runner.residuals, core.kv
    key, cell = req.kv_key, req.cell
    _flush_records(store, kvm.records, key, cell)
    tables = kvm.records.tables(key)
    ids = torch.tensor([r for t in tables for r in t], dtype=torch.long, device=store.seal.device)
    rows = _record_rows(ids)
    covered = kvm.coverage(key)
    out = {name: getattr(store, name)[:, ids].cpu() for name in RECORD_FIELDS}
    out |= {name: getattr(store, name)[:, rows].cpu() for name in ROW_FIELDS}
    out |= {"groups_per_plane": [len(t) for t in tables], "covered": covered, "seal": store.seal[ids].cpu(),
            "row_pos": store.row_pos[ids].cpu(), "row_maps": store.row_maps[cell, :, :covered].cpu(),
            "rows": store.rows[cell].cpu(), "encoded": store.encoded[cell].cpu()}
    return out


def _flush_records(store: "PackedResiduals", records: "ResidualRecords", key: str, cell: int) -> None:
    """Apply to the device now what the request's next plan would bring its planes (a reset,
    a rollback's truncate, new records): a snapshot reads the device."""
    fresh, first, tables, truncate = records.pending(key)
    device = store.seal.device
    assign = [[cell, plane, first[plane] + i, r] for plane, ids in enumerate(tables) for i, r in enumerate(ids)]
    store.apply(ResidualUpdate(torch.tensor([cell] if fresh else [], dtype=torch.long, device=device),
                               torch.tensor(assign, dtype=torch.long, device=device).view(-1, 4),
                               torch.tensor([] if truncate is None else [cell, truncate], dtype=torch.long,
                                            device=device).view(-1, 2)))


def _capture_slots(core: "EngineCore", req: Request) -> dict[str, Any]:
    storage = core.executor.runner.slots
    index = torch.tensor([req.token_slots[p] for p in sorted(req.token_slots)], dtype=torch.long,
                         device=storage.hidden.device)
    return {name: getattr(storage, name)[index].cpu() for name in SLOT_FIELDS}


def _generated(req: Request, positions: list[int]) -> list[int]:
    """The live positions of generated tokens (they hold decode slots)."""
    return [p for p in positions if p >= len(req.prompt_ids)]


def _capture_references(core: "EngineCore", req: Request) -> dict[str, Any] | None:
    """Sparse decode attention's state of the live generated tokens, in position order (None:
    the feature is off); keys cut to the largest count."""
    refs = core.executor.runner.slots.references
    if refs is None:
        return None
    positions = _generated(req, sorted(req.token_slots))
    index = torch.tensor([req.token_slots[p] for p in positions], dtype=torch.long, device=refs.keys.device)
    width = int(refs.count[index].max()) if positions else 0
    return refs.capture(index, width)


def _capture_cell(core: "EngineCore", req: Request) -> dict[str, Any]:
    runner = core.executor.runner
    cell: dict[str, Any] = {"next_token": _copy(runner.next_token[req.cell])}
    heads = core.speculation_heads
    if heads is not None:
        cell["draft_tokens"] = _copy(heads.draft_tokens[req.cell])
        cell["draft_probs"] = _copy(heads.draft_probs[req.cell])
    return cell


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy that owns its storage (`.cpu()` of a CPU view would share it, and the cell
    is rewritten once the request leaves it)."""
    return t.to("cpu", copy=True)


def _page_rows(pages: list[int], page_size: int, device: torch.device) -> torch.Tensor:
    """The flat KV rows of `pages`, in table order."""
    base = torch.tensor(pages, dtype=torch.long) * page_size
    return (base[:, None] + torch.arange(page_size)).flatten().to(device)


# ---- restore ---------------------------------------------------------------------------
def check(core: "EngineCore", snap: RequestSnapshot, replacing: Request | None = None) -> None:
    """Refuse, before any change, a snapshot this engine cannot resume exactly (`replacing`:
    the swapped-out request the snapshot is of, which holds its ID meanwhile)."""
    data = snap.data
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SnapshotError("not a request snapshot (no specloop.request-snapshot format tag)")
    if data.get("version") != VERSION:
        raise SnapshotError(f"snapshot format version {data.get('version')!r} is not supported "
                            f"(this engine reads version {VERSION})")
    ours = engine_fingerprint(core)
    for key, value in data["config"].items():
        if ours.get(key) != value:
            raise SnapshotError(f"the snapshot was taken with {key}={value!r}, this engine has {ours.get(key)!r}")
    rid = snap.request_id
    if core.id_in_use(rid) and (replacing is None or core.requests.get(rid) is not replacing):
        raise SnapshotError(f"request_id {rid!r} is already in use")
    if data["kv"] is None:
        return
    sched, kvm = core.scheduler, core.kv
    pages = sum(data["kv"]["pages_per_plane"] - r for r in data["kv"]["released"])
    held = data["request"]["round"] or {}
    spare = (held.get("slots") or 0) if held.get("kind") == "round" else 0
    live = data["request"]["live_positions"]
    generated = sum(p >= len(data["request"]["prompt_ids"]) for p in live) + spare  # drafts too
    if pages > kvm.num_available_pages:
        raise SnapshotError(f"restoring {rid!r} needs {pages} KV pages; {kvm.num_available_pages} are free")
    pool = sched.token_slots
    if pool.decode_size:
        need = [(len(live) + spare - generated, pool.free_for(False), ""),
                (generated, pool.free_for(True), " for generated tokens")]
    else:
        need = [(len(live) + spare, pool.num_free, "")]
    for n, free, kind in need:
        if n > free:
            raise SnapshotError(f"restoring {rid!r} needs {n} token slots{kind}; {free} are free")
    refs = data.get("references")
    ours = core.executor.runner.slots.references
    if refs is not None and refs["keys"].shape[-1] > ours.capacity:
        raise SnapshotError(f"restoring {rid!r} needs {refs['keys'].shape[-1]} kept keys per head; this "
                            f"engine's max_model_len keeps at most {ours.capacity}")
    res = data.get("residual")
    if (res is None) != (kvm.records is None):
        raise SnapshotError(f"the snapshot of {rid!r} {'lacks' if res is None else 'holds'} INT4 residual planes "
                            f"and this engine has kv_residual_quantization {'on' if res is None else 'off'}")
    if res is not None:
        need = kvm.records.records_for(None, data["kv"]["pages_per_plane"] * kvm.block_size,
                                       len(data["request"]["prompt_ids"]))
        if need > kvm.records.num_free:
            raise SnapshotError(f"restoring {rid!r} needs {need} INT4 residual records; "
                                f"{kvm.records.num_free} are free")
        if res["covered"] > core.executor.runner.residuals.max_len:
            raise SnapshotError(f"restoring {rid!r} needs {res['covered']} positions; this engine's "
                                f"max_model_len is {core.executor.runner.residuals.max_len}")
    if not sched.cells.num_free:
        raise SnapshotError(f"restoring {rid!r} needs a request cell; all {sched.cells.size} are in use "
                            f"(max_num_seqs)")


def install(core: "EngineCore", snap: RequestSnapshot) -> Request:
    """Rebuild the request in this engine (after `check`): running where it was running,
    waiting otherwise. Returns it, registered with the engine and its scheduler."""
    data = snap.data
    r = data["request"]
    params = SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in r["params"].items()})
    req = Request(r["request_id"], list(r["prompt_ids"]), params, arrival=r["arrival"],
                  stop_ids=frozenset(r["stop_ids"]))
    req.num_tokens, req.produced, req.speculating = r["num_tokens"], r["produced"], r["speculating"]
    req.replay, req.resume_token, req.num_preemptions = list(r["replay"]), r["resume_token"], r["num_preemptions"]
    req.window_rows = {int(d): n for d, n in r["window_rows"].items()}
    req.output_ids = list(r["output_ids"])
    req.num_drafts, req.num_draft_tokens, req.num_accepted_tokens = r["usage"]
    req.incarnation = new_incarnation()
    sched = core.scheduler
    if data["kv"] is None:
        req.round = _restore_round(r["round"], None)
        sched.waiting.appendleft(req)
    else:
        held = r["round"].get("slots") if r["round"] and r["round"]["kind"] == "round" else None
        positions = r["live_positions"]
        generated = _generated(req, positions)
        prompt = sched.token_slots.take(len(positions) - len(generated))
        decode = sched.token_slots.take(len(generated) + (held or 0), decode=True)
        assert prompt is not None and decode is not None, "`check` counted the free token slots"
        live, spare = prompt + decode[:len(generated)], decode[len(generated):]
        req.token_slots = dict(zip(positions, live))
        req.round = _restore_round(r["round"], spare if held is not None else None)
        req.cell = sched.cells.take()
        _restore_kv(core, req, data["kv"])
        if data["residual"] is not None:
            _restore_residual(core, req, data["residual"])
        _restore_slots(core, req, live, data["slots"])
        if data["references"] is not None:
            _restore_references(core, [req.token_slots[p] for p in generated], data["references"])
        _restore_cell(core, req, data["cell"])
        req.status = Status.RUNNING
        sched.running.append(req)
    core.requests[req.request_id] = req
    core._detok[req.request_id] = IncrementalDetokenizer.from_state(core.tokenizer, data["detokenizer"])
    return req


def _restore_round(state: dict[str, Any] | None, spare: list[int] | None) -> Any:
    if state is None:
        return None
    fields = {k: v for k, v in state.items() if k != "kind"}
    if state["kind"] == "round":
        fields["slots"] = spare
        return Round(**fields)
    return PipelineState([LiveToken(**t) for t in fields["live"]], fields["limit"])


def _restore_kv(core: "EngineCore", req: Request, kv: dict[str, Any]) -> None:
    store, kvm = core.executor.runner.backend.kv, core.kv
    kvm.add_restored(req.kv_key, kv["pages_per_plane"], kv["released"], prompt_len=len(req.prompt_ids))
    for plane, frontier in enumerate(kv["frontiers"]):
        kvm.advance(req.kv_key, plane, frontier)
        rows = _page_rows(kvm.page_table(req.kv_key, plane)[kv["released"][plane]:], store.page_size, store.k.device)
        store.k[:, rows] = kv["k"][plane].to(store.k.device)
        store.v[:, rows] = kv["v"][plane].to(store.v.device)


def _restore_residual(core: "EngineCore", req: Request, res: dict[str, Any]) -> None:
    """Write the INT4 residual planes into the records `_restore_kv` took and the request's
    cell (its given-back tail pages were never taken)."""
    store, kvm = core.executor.runner.residuals, core.kv
    key, device = req.kv_key, store.seal.device
    tables = kvm.records.tables(key)
    assert [len(t) for t in tables] == res["groups_per_plane"], "the same coverage takes the same records"
    ids = torch.tensor([r for t in tables for r in t], dtype=torch.long, device=device)
    cell = torch.tensor([req.cell], device=device)
    store.reset(cell)
    for plane, records in enumerate(tables):
        store.group_tables[req.cell, plane, : len(records)] = torch.tensor(records, dtype=torch.int32, device=device)
    for name in RECORD_FIELDS:
        getattr(store, name)[:, ids] = res[name].to(device)
    rows = _record_rows(ids)
    for name in ROW_FIELDS:
        getattr(store, name)[:, rows] = res[name].to(device)
    store.seal[ids] = res["seal"].to(device)
    store.row_pos[ids] = res["row_pos"].to(device)
    store.row_maps[req.cell, :, : res["covered"]] = res["row_maps"].to(device)
    store.rows[req.cell] = res["rows"].to(device)
    store.encoded[req.cell] = res["encoded"].to(device)
    core.executor.runner.batches.forget_backlog(req.cell)  # it may hold full groups not encoded yet
    kvm.records.adopt(key)


def _restore_slots(core: "EngineCore", req: Request, live: list[int], slots: dict[str, torch.Tensor]) -> None:
    storage = core.executor.runner.slots
    if not live:
        return
    index = torch.tensor(live, dtype=torch.long, device=storage.hidden.device)
    for name in SLOT_FIELDS:
        getattr(storage, name)[index] = slots[name].to(storage.hidden.device)
    storage.incarnation[index] = req.incarnation


def _restore_references(core: "EngineCore", slots: list[int], refs: dict[str, torch.Tensor]) -> None:
    """Write the generated tokens' reference state into their new decode slots (keys padded
    with -1 to this engine's capacity)."""
    store = core.executor.runner.slots.references
    if slots:
        store.restore(torch.tensor(slots, dtype=torch.long, device=store.keys.device), refs)


def _restore_cell(core: "EngineCore", req: Request, cell: dict[str, Any]) -> None:
    runner = core.executor.runner
    runner.next_token[req.cell] = cell["next_token"].to(runner.next_token.device)
    heads = core.speculation_heads
    if heads is not None:
        heads.draft_tokens[req.cell] = cell["draft_tokens"].to(heads.draft_tokens.device)
        heads.draft_probs[req.cell] = cell["draft_probs"].to(heads.draft_probs.device)
