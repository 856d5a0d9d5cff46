"""Loop-at-a-time execution of the model over explicit rows, on a per-depth KV cache.

`LoopStepper` advances arbitrary sets of rows, each row one (sequence, position) token
moving one loop deeper, in a single forward call. Any schedule that keeps the readiness
invariant works: a row is ready when its token finished the previous depth and every
earlier position of its sequence has finished this depth (or exited) or is advanced at
this depth in the same call. Loop-at-a-time prefill, wavefront chunked prefill (chunks
at different depths in one call) and token-by-token decode are all such schedules.

It is the small, synchronous harness for the model; the serving runtime schedules the
same rows over paged storage.
"""

from __future__ import annotations

import dataclasses

import torch

from specloop.model.dense_cache import PerDepthKVCache
from specloop.model.exit_gate import exit_step
from specloop.model.ouro import OuroModel


@dataclasses.dataclass
class _Sequence:
    tokens: list[int]
    depth_done: list[int]  # loops finished per position
    finished: list[bool]  # exited or reached full depth
    hidden: torch.Tensor  # [T_max, H] latest end-of-loop state
    survival: torch.Tensor  # [T_max] fp32
    exit_loops: list[int]
    logits: dict[int, torch.Tensor]  # position -> fp32 logits at the exit loop


class LoopStepper:
    def __init__(self, model: OuroModel, max_seqs: int, max_len: int, exit_threshold: float | None = None) -> None:
        cfg = model.config
        self.model = model
        self.num_loops = cfg.num_loops
        self.threshold = cfg.early_exit_threshold if exit_threshold is None else exit_threshold
        self.max_len = max_len
        self.cache = PerDepthKVCache(cfg, max_seqs, max_len, model.dtype, model.device)
        self.seqs: list[_Sequence] = []
        self._max_seqs = max_seqs
        self.calls = 0

    def add_sequence(self, tokens: list[int]) -> int:
        if len(self.seqs) >= self._max_seqs:
            raise ValueError("stepper is full")
        h = self.model.config.hidden_size
        dev = self.model.device
        self.seqs.append(_Sequence(
            tokens=[], depth_done=[], finished=[], exit_loops=[], logits={},
            hidden=torch.zeros(self.max_len, h, dtype=self.model.dtype, device=dev),
            survival=torch.ones(self.max_len, dtype=torch.float32, device=dev),
        ))
        seq = len(self.seqs) - 1
        self.append_tokens(seq, tokens)
        return seq

    def append_tokens(self, seq: int, tokens: list[int]) -> None:
        s = self.seqs[seq]
        if len(s.tokens) + len(tokens) > self.max_len:
            raise ValueError("sequence exceeds the stepper's max_len")
        s.tokens.extend(tokens)
        s.depth_done.extend([0] * len(tokens))
        s.finished.extend([False] * len(tokens))
        s.exit_loops.extend([0] * len(tokens))

    def _check_ready(self, rows: list[tuple[int, int]]) -> None:
        in_call = {(seq, pos): self.seqs[seq].depth_done[pos] for seq, pos in rows}
        for seq, pos in rows:
            s = self.seqs[seq]
            depth = s.depth_done[pos]
            if s.finished[pos]:
                raise ValueError(f"row ({seq}, {pos}) already finished")
            for prev in range(pos):
                done = s.finished[prev] or s.depth_done[prev] > depth
                if not done and in_call.get((seq, prev)) != depth:
                    raise ValueError(f"row ({seq}, {pos}) at depth {depth} is not ready: position {prev}")

    @torch.no_grad()
    def step(self, rows: list[tuple[int, int]]) -> None:
        """Advance every (seq, pos) row one loop in one forward call."""
        self._check_ready(rows)
        dev = self.model.device
        seq_ids = torch.tensor([r[0] for r in rows], device=dev)
        positions = torch.tensor([r[1] for r in rows], device=dev)
        depths = [self.seqs[s].depth_done[p] for s, p in rows]
        inputs = []
        for (s, p), d in zip(rows, depths):
            seq = self.seqs[s]
            if d == 0:
                inputs.append(self.model.embed(torch.tensor([seq.tokens[p]], device=dev))[0])
            else:
                inputs.append(seq.hidden[p])
        self.cache.set_rows(seq_ids, positions, torch.tensor(depths, device=dev))
        out = self.model.loop(torch.stack(inputs), positions, self.cache)
        lam = self.model.exit_lambda(out)
        self.calls += 1
        for i, ((s, p), d) in enumerate(zip(rows, depths)):
            seq = self.seqs[s]
            seq.hidden[p] = out[i]
            exits, surv = exit_step(seq.survival[p : p + 1], lam[i : i + 1], d + 1, self.num_loops, self.threshold)
            seq.survival[p] = surv[0]
            seq.depth_done[p] = d + 1
            if bool(exits[0]):
                seq.finished[p] = True
                seq.exit_loops[p] = d + 1
                self.cache.inherit(s, torch.tensor([p], device=dev), d)
                seq.logits[p] = self.model.head(out[i : i + 1])[0]

    def run_to_completion(self, seq: int, chunk_size: int | None = None) -> None:
        """Loop-at-a-time: each chunk of unfinished positions goes through every depth."""
        s = self.seqs[seq]
        pending = [p for p in range(len(s.tokens)) if not s.finished[p]]
        chunk = chunk_size or max(1, len(pending))
        for start in range(0, len(pending), chunk):
            part = pending[start : start + chunk]
            while True:
                live = [(seq, p) for p in part if not s.finished[p]]
                if not live:
                    break
                self.step(live)

    def logits(self, seq: int) -> torch.Tensor:
        s = self.seqs[seq]
        return torch.stack([s.logits[p] for p in range(len(s.tokens))])

    def greedy(self, seq: int, max_new_tokens: int, chunk_size: int | None = None) -> list[int]:
        """Prefill what is pending, then decode token by token, four loops per token."""
        self.run_to_completion(seq, chunk_size)
        out = []
        for _ in range(max_new_tokens):
            s = self.seqs[seq]
            nxt = int(s.logits[len(s.tokens) - 1].argmax())
            out.append(nxt)
            self.append_tokens(seq, [nxt])
            self.run_to_completion(seq)
        return out
