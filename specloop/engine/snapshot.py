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
- `residual` (kv_residual_quantization, `specloop.flashloop.kv_residual`): its cell's
  compact row maps, row and encoded counts per plane, its records' contents (codes, FP16
  parameters, row positions, seals) in group order;
- `slots`: the contents of its live token slots (hidden, exit state, depth, candidate,
  and for token-sparse prefill the previous hidden state and the selection mark),
  by position, and how many slots its round holds for rows not drafted yet;
- `references` (sparse_decode_attention, `specloop.flashloop.sparse_decode`): the loop-2
  reference state of its live generated tokens (kept keys cut to the largest count, count,
  m, O_ref, C_ref, which layers hold it), by position; they restore into decode slots;
- `cell`: its request cell's next token and, with speculation, its draft buffer;
- `detokenizer`: the incremental detokenizer's state.

`kv`, `slots`, `cell` and each feature's entry are `SnapshotPart`s
(`specloop.runtime.feature`): the composition root (`specloop.engine.build`) hands the
`Snapshotter` the parts of this engine, a feature that is off as an `Absent` part, so this
module names no feature and never reaches into the runner.

A restore checks the format, version and configuration and that the engine has room
(pages, token slots, a cell, each part's own) before it changes anything, so a refused
restore leaves no trace; device storage is then written at fresh page, slot and cell
indices.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from typing import Any

import torch

from specloop.errors import SnapshotError
from specloop.pipeline.rounds import Round
from specloop.pipeline.token_pipeline import LiveToken, PipelineState
from specloop.runtime.feature import SnapshotPart
from specloop.runtime.kv_format import PagedKV
from specloop.runtime.slot_storage import SlotStorage
from specloop.sampling_params import SamplingParams
from specloop.scheduling.kv_manager import KVManager
from specloop.scheduling.request import Request, Status, new_incarnation
from specloop.scheduling.scheduler import Scheduler

__all__ = ["FORMAT", "VERSION", "RequestSnapshot", "SnapshotError", "Snapshotter"]

FORMAT = "specloop.request-snapshot"
VERSION = 6  # 2: token-sparse prefill state (slots' previous hidden and selection, window rows);
# 3: INT4 residual planes (records, compact row maps, counters, released tail pages);
# 4: residual records counted per plane (token-sparse planes hold fewer);
# 5: `kv` holds only the pages not given back, per plane (a list), and how many were
# 6: sparse decode attention's reference state of the live generated tokens (`references`)
SLOT_FIELDS = SlotStorage.CARRIED


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


class Snapshotter:
    """Takes and restores request snapshots for one engine.

    `fingerprint`: what a restoring engine must share with this one for exact resumption
    (model shape and dtype, KV format, page size, exit threshold, speculation, seed, the
    FlashLoop groups); `summary`: the full configuration, carried for diagnostics; `parts`:
    the owners of a running request's state, captured and restored in this order."""

    def __init__(self, fingerprint: dict[str, Any], summary: dict[str, Any], scheduler: Scheduler,
                 parts: Sequence[SnapshotPart]) -> None:
        self.fingerprint = fingerprint
        self.summary = summary
        self.scheduler = scheduler
        self.parts = list(parts)

    def capture(self, req: Request, detokenizer: dict[str, Any]) -> RequestSnapshot:
        """The snapshot of a request at a legal point: no ticket in flight holds its rows (the
        caller's promise: `EngineCore.snapshot` commits every ticket first, a swap-out waits for
        the request's last ticket). `detokenizer`: its incremental detokenizer's state."""
        if req.swapped is not None:  # swapped out: its KV lives only in the swap-out snapshot, and
            return req.swapped  # nothing about it has changed since (no ticket holds it)
        on_device = req.status in (Status.RUNNING, Status.SWAPPING)  # waiting: nothing on the device yet
        data = {"format": FORMAT, "version": VERSION, "config": self.fingerprint, "engine": self.summary,
                "request": _capture_request(req)}
        for part in self.parts:
            data[part.key] = part.capture(req) if on_device else None
        data["detokenizer"] = detokenizer
        return RequestSnapshot(data)

    def check(self, snap: RequestSnapshot, id_in_use: bool) -> None:
        """Refuse, before any change, a snapshot this engine cannot resume exactly (`id_in_use`:
        another request holds its ID)."""
        data = snap.data
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise SnapshotError("not a request snapshot (no specloop.request-snapshot format tag)")
        if data.get("version") != VERSION:
            raise SnapshotError(f"snapshot format version {data.get('version')!r} is not supported "
                                f"(this engine reads version {VERSION})")
        for key, value in data["config"].items():
            mine = self.fingerprint.get(key)
            if key == "kv_residual_quantization" and isinstance(value, dict):  # older snapshots carried
                value = {k: v for k, v in value.items() if k != "tail_share"}  # its pool sizing too
            if key == "token_sparse_prefill" and isinstance(value, dict) and "keep_last" not in value:
                value = {**value, "keep_last": False}  # (older snapshots predate the option: it was off)
            if mine != value and not _both_off(value, mine):
                raise SnapshotError(f"the snapshot was taken with {key}={value!r}, this engine has {mine!r}")
        rid = snap.request_id
        if id_in_use:
            raise SnapshotError(f"request_id {rid!r} is already in use")
        if data["kv"] is None:
            return
        for part in self.parts:
            part.check(data)
        sched = self.scheduler
        held = data["request"]["round"] or {}
        spare = (held.get("slots") or 0) if held.get("kind") == "round" else 0
        live = data["request"]["live_positions"]
        generated = sum(p >= len(data["request"]["prompt_ids"]) for p in live) + spare  # drafts too
        pool = sched.token_slots
        if pool.decode_size:
            need = [(len(live) + spare - generated, pool.free_for(False), ""),
                    (generated, pool.free_for(True), " for generated tokens")]
        else:
            need = [(len(live) + spare, pool.num_free, "")]
        for n, free, kind in need:
            if n > free:
                raise SnapshotError(f"restoring {rid!r} needs {n} token slots{kind}; {free} are free")
        if not sched.cells.num_free:
            raise SnapshotError(f"restoring {rid!r} needs a request cell; all {sched.cells.size} are in use "
                                f"(max_num_seqs)")

    def install(self, snap: RequestSnapshot) -> Request:
        """Rebuild the request (after `check`): running where it was running, waiting
        otherwise, and registered with the scheduler. The caller registers it with the engine."""
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
        sched = self.scheduler
        if data["kv"] is None:
            req.round = _restore_round(r["round"], None)
            sched.waiting.appendleft(req)
            return req
        held = r["round"].get("slots") if r["round"] and r["round"]["kind"] == "round" else None
        positions = r["live_positions"]
        generated = generated_positions(req, positions)
        prompt = sched.token_slots.take(len(positions) - len(generated))
        decode = sched.token_slots.take(len(generated) + (held or 0), decode=True)
        assert prompt is not None and decode is not None, "`check` counted the free token slots"
        live, spare = prompt + decode[:len(generated)], decode[len(generated):]
        req.token_slots = dict(zip(positions, live))
        req.round = _restore_round(r["round"], spare if held is not None else None)
        req.cell = sched.cells.take()
        for part in self.parts:
            part.restore(req, data)
        req.status = Status.RUNNING
        sched.running.append(req)
        sched.restored(req)
        return req


def generated_positions(req: Request, positions: list[int]) -> list[int]:
    """The live positions of generated tokens (they hold decode slots)."""
    return [p for p in positions if p >= len(req.prompt_ids)]


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


def _restore_round(state: dict[str, Any] | None, spare: list[int] | None) -> Any:
    if state is None:
        return None
    fields = {k: v for k, v in state.items() if k != "kind"}
    if state["kind"] == "round":
        fields["slots"] = spare
        return Round(**fields)
    return PipelineState([LiveToken(**t) for t in fields["live"]], fields["limit"])


# ---- the core's parts ------------------------------------------------------------------
def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy that owns its storage (`.cpu()` of a CPU view would share it, and the
    engine rewrites that storage while the snapshot waits)."""
    return t.to("cpu", copy=True)


def page_rows(pages: list[int], page_size: int, device: torch.device) -> torch.Tensor:
    """The flat KV rows of `pages`, in table order."""
    base = torch.tensor(pages, dtype=torch.long) * page_size
    return (base[:, None] + torch.arange(page_size)).flatten().to(device)


class KVPagesPart:
    """`kv`: every page the request holds, per plane, in its stored format, with the
    frontiers and how many leading pages each plane gave back."""

    key = "kv"

    def __init__(self, kv: KVManager, store: PagedKV) -> None:
        self.kv, self.store = kv, store

    def capture(self, req: Request) -> dict[str, Any]:
        store, kvm = self.store, self.kv
        planes = range(kvm.num_planes)
        released = [kvm.released(req.kv_key, p) for p in planes]
        rows = [page_rows(kvm.page_table(req.kv_key, p)[r:], store.page_size, store.k.device)
                for p, r in zip(planes, released)]
        return {
            "frontiers": [kvm.frontier(req.kv_key, p) for p in planes],
            "pages_per_plane": len(kvm.page_table(req.kv_key, 0)),
            "released": released,
            "k": [store.k[:, r].cpu() for r in rows],  # per plane [layers, (pages - released) * page_size, Hkv, D]
            "v": [store.v[:, r].cpu() for r in rows],
        }

    def check(self, data: dict[str, Any]) -> None:
        kv, kvm = data["kv"], self.kv
        pages = sum(kv["pages_per_plane"] - r for r in kv["released"])
        if not kvm.can_take(pages):  # (free pages, or idle prefix-cache pages it may evict)
            raise SnapshotError(f"restoring {data['request']['request_id']!r} needs {pages} KV pages; "
                                f"{kvm.num_available_pages} are free")

    def restore(self, req: Request, data: dict[str, Any]) -> None:
        store, kvm, kv = self.store, self.kv, data["kv"]
        kvm.add_restored(req.kv_key, kv["pages_per_plane"], kv["released"], prompt_len=len(req.prompt_ids))
        for plane, frontier in enumerate(kv["frontiers"]):
            kvm.advance(req.kv_key, plane, frontier)
            rows = page_rows(kvm.page_table(req.kv_key, plane)[kv["released"][plane]:], store.page_size,
                             store.k.device)
            store.k[:, rows] = kv["k"][plane].to(store.k.device)
            store.v[:, rows] = kv["v"][plane].to(store.v.device)


class SlotsPart:
    """`slots`: the contents of the request's live token slots, by position."""

    key = "slots"

    def __init__(self, storage: SlotStorage) -> None:
        self.storage = storage

    def capture(self, req: Request) -> dict[str, torch.Tensor]:
        storage = self.storage
        index = torch.tensor([req.token_slots[p] for p in sorted(req.token_slots)], dtype=torch.long,
                             device=storage.hidden.device)
        return {name: getattr(storage, name)[index].cpu() for name in SLOT_FIELDS}

    def check(self, data: dict[str, Any]) -> None:
        pass  # the token slots are the scheduler's, counted by `Snapshotter.check`

    def restore(self, req: Request, data: dict[str, Any]) -> None:
        storage, slots = self.storage, data["slots"]
        live = [req.token_slots[p] for p in sorted(req.token_slots)]
        if not live:
            return
        index = torch.tensor(live, dtype=torch.long, device=storage.hidden.device)
        for name in SLOT_FIELDS:
            getattr(storage, name)[index] = slots[name].to(storage.hidden.device)
        storage.incarnation[index] = req.incarnation


class CellPart:
    """`cell`: the request cell's next token and, with speculation, its draft buffer
    (`draft` = (draft tokens, draft probabilities), per cell)."""

    key = "cell"

    def __init__(self, next_token: torch.Tensor, draft: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.next_token, self.draft = next_token, draft

    def capture(self, req: Request) -> dict[str, Any]:
        cell: dict[str, Any] = {"next_token": host_copy(self.next_token[req.cell])}
        if self.draft is not None:
            cell["draft_tokens"] = host_copy(self.draft[0][req.cell])
            cell["draft_probs"] = host_copy(self.draft[1][req.cell])
        return cell

    def check(self, data: dict[str, Any]) -> None:
        pass  # request cells are the scheduler's, counted by `Snapshotter.check`

    def restore(self, req: Request, data: dict[str, Any]) -> None:
        cell = data["cell"]
        self.next_token[req.cell] = cell["next_token"].to(self.next_token.device)
        if self.draft is not None:
            tokens, probs = self.draft
            tokens[req.cell] = cell["draft_tokens"].to(tokens.device)
            probs[req.cell] = cell["draft_probs"].to(probs.device)


def _both_off(value: Any, mine: Any) -> bool:
    """Whether a feature group is off in the snapshot and in this engine: its other settings
    then change nothing a resume computes (a default that moved since, such as sparse decode
    attention's key retention, must not refuse snapshots taken without the feature)."""
    return (isinstance(value, dict) and isinstance(mine, dict) and value.get("enabled") is False
            and mine.get("enabled") is False)
