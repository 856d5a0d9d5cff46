"""EngineCore: the engine step, as a short story.

    schedule -> submit -> (when enough tickets are in flight) collect -> commit -> emit

`step()` submits the next plan and commits the oldest ticket once `max_inflight_tickets`
are in flight, so on CUDA the CPU always prepares the next plan while the GPU runs the
current one. Commit drops results whose incarnation is stale (abort, finish, request-ID
reuse), turns sampled tokens into text and stop decisions, and ends requests. The core is
single-threaded; `AsyncEngine` runs it on its own thread.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from typing import Any

import torch

from specloop.checkpoint import load_model, load_tokenizer, stop_token_ids
from specloop.checkpoint.loader import resolve_dtype
from specloop.checkpoint.tokenizer import longest_token_bytes
from specloop.engine.build import build
from specloop.engine.config import EngineConfig, ResolvedConfig
from specloop.engine.detokenizer import IncrementalDetokenizer
from specloop.engine.executor import SampleResult, Ticket
from specloop.engine.snapshot import RequestSnapshot
from specloop.engine.step_histogram import StepHistogram, step_token_bounds
from specloop.errors import EngineDeadError, InvalidRequestError, RequestFailedError, SnapshotError, SpecloopError
from specloop.flashloop.config import summary as group_summary
from specloop.model.ouro import OuroModel
from specloop.pipeline.heads import Verifier
from specloop.pipeline.metrics import SpeculationMetrics
from specloop.plan import Sample, Verify, VerifyCandidate
from specloop.runtime.sampler import check_representable
from specloop.sampling_params import SamplingParams
from specloop.scheduling.controller import Commit
from specloop.scheduling.request import Request, RequestOutput, Status

log = logging.getLogger(__name__)
PROMPT_CHARS_SLACK = 2  # margin on the character bound of a prompt that cannot fit (`check_prompt_chars`)


class QueueFullError(SpecloopError):
    """The waiting queue is at max_waiting_requests; retry later."""


@dataclasses.dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_usage: float  # pages held or reserved / all pages (pages only the prefix cache holds count as free)
    kv_bytes_used: int  # bytes of the pages (and INT4 records) requests hold
    num_kv_pages: int
    num_drafts: int = 0  # speculation rounds committed
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # rounds whose candidate i was accepted
    num_preemptions: int = 0  # running requests preempted so far (they resume by recompute)
    prefill_rows_skipped: int = 0  # prompt token-loops token-sparse prefill planned to leave out (a recomputed
    # window counts again)
    token_sparse_prefill: dict[str, Any] = dataclasses.field(default_factory=dict)  # the effective group
    kv_residual_quantization: dict[str, Any] = dataclasses.field(default_factory=dict)  # the effective group
    kv_record_bytes_used: int = 0  # INT4 residual records held (part of kv_bytes_used)
    kv_records_free: int = 0
    kv_bytes_per_request: dict[str, int] = dataclasses.field(default_factory=dict)  # running requests: pages
    # and records they hold
    sparse_decode_attention: dict[str, Any] = dataclasses.field(default_factory=dict)  # the effective group
    sparse_decode_fallbacks: int = 0  # corrections that found no reference state and ran dense (as of the
    # last completed call)
    sparse_decode_reference_bytes: int = 0  # device bytes of the decode slots' reference state
    iteration_tokens: tuple[tuple[float, int], ...] = ()  # tokens entering the loops per submitted plan:
    # (upper bound, plans with at most that many) per bucket, the last bound inf
    iteration_tokens_sum: int = 0
    prefix_cache_queries: int = 0  # positions of the requests admission looked up in the prefix cache, all of
    # them as vLLM counts (a re-admission after preemption counts again; 0 with enable_prefix_caching off)
    prefix_cache_hits: int = 0  # of those, positions found cached (their rows are not computed)


def check_token_ids(prompt: Any, vocab: int) -> list[int]:
    """A prompt given as token ids, checked (a list of ints in [0, vocab)); raises InvalidRequestError."""
    if not (isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
    return list(prompt)


class EngineCore:
    def __init__(self, config: EngineConfig, model: OuroModel | None = None, tokenizer: Any = None,
                 verifier: Verifier | None = None) -> None:
        """`model` / `tokenizer`: already loaded from `config.model` (benchmarks reuse them; a
        model passed in is served as given, fused or not, while one loaded here is fused);
        `verifier`: decides speculation's verifications (benchmarks inject a replay)."""
        self.config = config
        device = torch.device(_resolve_device(config.device))
        if model is None:
            # One matmul for q/k/v and one for gate/up per layer; a model passed in is left as
            # given, since its caller may still read it by checkpoint names (the reference).
            # With tensor parallelism the full model stays in host memory: each rank's shard
            # goes to its device (`build`), so no GPU holds all of it.
            at = torch.device("cpu") if config.tensor_parallel_size > 1 else device
            dtype = resolve_dtype(config.dtype, device)  # the dtype the ranks' device calls for
            model = load_model(config.model, dtype=dtype, device=at)[0].fuse_projections()
            if device.type == "cuda":
                torch.cuda.empty_cache()  # hand the parts' freed blocks back before the KV budget is read
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        mcfg = self.model.config
        self.stop_ids = frozenset(stop_token_ids(mcfg, self.tokenizer))
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        longest = longest_token_bytes(self.tokenizer)
        # Characters beyond which a prompt certainly exceeds the context (None: no such bound).
        self.max_prompt_chars = None if longest is None else PROMPT_CHARS_SLACK * self.max_model_len * longest
        threshold = mcfg.early_exit_threshold if config.exit_threshold is None else config.exit_threshold
        parts = build(config, self.model, device, self.max_model_len, threshold, verifier, self._swap_out,
                      self._swap_in)
        self.kv, self.scheduler, self.backend, self.executor = parts.kv, parts.scheduler, parts.backend, parts.executor
        self.speculation_heads = parts.speculation_heads
        self.snapshots = parts.snapshots
        self.features = parts.features
        speculation = parts.speculation
        self.metrics = SpeculationMetrics(max(speculation.draft_width if speculation else 0, 1))
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._inflight: collections.deque[Ticket] = collections.deque()
        self._pending: list[RequestOutput] = []  # committed while quiescing for a snapshot; the next step returns them
        self._arrivals = itertools.count()
        self._queued: collections.deque[tuple[Request, float]] = collections.deque()  # added, not yet admitted
        self.iteration_tokens = StepHistogram(step_token_bounds(config.max_num_batched_tokens))
        self.failure: BaseException | None = None  # set when a step failed outside one request
        weight = next(self.model.parameters())
        self.resolved = ResolvedConfig(
            dtype=str(weight.dtype).removeprefix("torch."),
            device=str(weight.device) if config.tensor_parallel_size == 1 else str(device),
            max_model_len=self.max_model_len, num_kv_pages=parts.num_pages, kv_page_bytes=parts.page_bytes,
            attention_backend=self.backend.name, cuda_graphs=parts.graphed, exit_threshold=float(threshold),
            prefix_caching=config.prefix_caching)
        log.info("engine ready: %s on %s, %d KV pages of %d tokens (%.1f MiB), attention backend %s, CUDA graphs %s, "
                 "prefix caching %s", config.model, device, parts.num_pages, config.block_size,
                 parts.num_pages * parts.page_bytes / 2**20, self.backend.name, "on" if parts.graphed else "off",
                 "on" if config.prefix_caching else "off")

    # ---- requests ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Validate and queue a request; raises InvalidRequestError, QueueFullError or EngineDeadError.

        Everything that can fail runs before any engine state changes, so a refused or
        failed add leaves no trace; an unexpected failure (a tokenizer bug, say) raises
        RequestFailedError and the engine goes on serving.
        """
        self._check_alive()
        if self.id_in_use(request_id):
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        try:
            ids = self._prompt_ids(prompt)
            self._check_limits(ids, params)
            if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
                raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting_requests} requests)")
            check_representable(params)
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens)
        except SpecloopError:
            raise
        except Exception as exc:
            log.exception("adding request %s failed", request_id)
            raise RequestFailedError(f"the request failed while being added: {type(exc).__name__}: {exc}") from exc
        req = Request(request_id, ids, params, arrival=next(self._arrivals),
                      stop_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.stop_ids))
        self.requests[request_id] = req
        self._detok[request_id] = detok
        self.scheduler.add(req)
        self._queued.append((req, time.monotonic()))

    def _check_limits(self, ids: list[int], params: SamplingParams) -> None:
        """The bounds that depend on the served model and the engine configuration."""
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the context "
                f"length of {self.max_model_len} tokens", param="prompt")
        if not self.kv.fits_ever(total, len(ids)):
            records = self.kv.records
            if self.kv.pages_at_once(total) <= self.kv.num_pages and records is not None:
                raise InvalidRequestError(
                    f"prompt plus max_tokens ({total} tokens) needs {records.records_for(None, total, len(ids))} "
                    f"INT4 residual records but the cache has {records.num_records}", param="max_tokens")
            raise InvalidRequestError(
                f"prompt plus max_tokens ({total} tokens) needs {self.kv.pages_at_once(total)} KV pages at once "
                f"but the cache has {self.kv.num_pages}", param="max_tokens")
        vocab = self.model.config.vocab_size
        if params.top_k > vocab:
            raise InvalidRequestError(f"top_k must be at most the vocabulary size {vocab} (or -1 / 0 to disable), "
                                      f"got {params.top_k}", param="top_k")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})",
                                      param="stop_token_ids")
        cfg = self.config
        if len(params.stop) > cfg.max_stop_strings:
            raise InvalidRequestError(f"stop: at most {cfg.max_stop_strings} stop strings are allowed, got "
                                      f"{len(params.stop)}", param="stop")
        chars = sum(len(s) for s in params.stop)
        if chars > cfg.max_stop_chars:
            raise InvalidRequestError(f"stop: the stop strings may hold {cfg.max_stop_chars} characters in all, "
                                      f"got {chars}", param="stop")

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse, before tokenizing, a text too long to fit the context whatever its tokens
        (thread-safe: reads only start-up values)."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"the prompt has {num_chars} characters, which is certainly more than the context length of "
                f"{self.max_model_len} tokens", param=param)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = check_token_ids(prompt, self.model.config.vocab_size)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids

    def id_in_use(self, request_id: str) -> bool:
        """A live request has it, or a finished one whose outputs are still owed (it finished
        while a snapshot committed the tickets in flight; the next step hands them out): a
        new request under that ID would receive them."""
        return request_id in self.requests or any(o.request_id == request_id for o in self._pending)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now; its final output says finish_reason='abort'."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        # Outputs it committed while the engine quiesced for a snapshot go out in this final one.
        mine = [o for o in self._pending if o.request_id == request_id]
        self._pending = [o for o in self._pending if o.request_id != request_id]
        out = self._end(req, "abort", "", [], None)
        if mine:
            logprobs = [lp for o in mine for lp in (o.logprobs or [])] if req.params.logprobs else None
            out = dataclasses.replace(out, text="".join(o.text for o in mine),
                                      token_ids=[t for o in mine for t in o.token_ids], logprobs=logprobs)
        return out

    @property
    def max_request_tokens(self) -> int:
        """The most positions (prompt + max_tokens) one request can hold in the KV pool."""
        return self.kv.num_pages // self.kv.num_planes * self.kv.block_size

    def close(self) -> None:
        """Stop what the engine runs outside this process (tensor-parallel workers); idempotent.
        `AsyncEngine` calls it when its thread ends; garbage collection and interpreter exit do too."""
        self.executor.close()

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._inflight) or bool(self._pending)

    # ---- snapshot / restore -----------------------------------------------------------
    def snapshot(self, request_id: str) -> RequestSnapshot:
        """The request's state at a legal point (`specloop.engine.snapshot`); the request runs on.

        Every ticket in flight is committed first (what that emits comes out of the next
        `step`), so no ticket holds the request's rows. Raises InvalidRequestError for an
        unknown request and SnapshotError when it finished meanwhile."""
        self._check_alive()
        if request_id not in self.requests:
            raise InvalidRequestError(f"no request {request_id!r} to snapshot", param="request_id")
        try:
            self._pending.extend(self._quiesce())
        except BaseException as exc:
            self.failure = exc
            raise
        assert not self._inflight, "a legal point: no ticket in flight"
        req = self.requests.get(request_id)
        if req is None:
            raise SnapshotError(f"request {request_id!r} finished while the tickets in flight completed")
        return self._capture(req)

    def restore(self, snapshot: RequestSnapshot) -> None:
        """Resume a request from its snapshot, where it was: a refused restore (SnapshotError:
        another format version or configuration, its ID in use, no room) changes nothing."""
        self._check_alive()
        self.snapshots.check(snapshot, self.id_in_use(snapshot.request_id))
        self._install(snapshot)

    def _capture(self, req: Request) -> RequestSnapshot:
        return self.snapshots.capture(req, self._detok[req.request_id].state())

    def _install(self, snapshot: RequestSnapshot) -> None:
        req = self.snapshots.install(snapshot)
        self.requests[req.request_id] = req
        self._detok[req.request_id] = IncrementalDetokenizer.from_state(self.tokenizer, snapshot.data["detokenizer"])

    def _swap_out(self, req: Request) -> None:
        """Swap preemption: the request's last ticket completed; keep its snapshot in host memory."""
        req.swapped = self._capture(req)

    def _swap_in(self, req: Request) -> bool:
        """Restore a swapped-out request at the head of the queue, if there is room now."""
        rid = req.request_id
        try:  # the request holds its own ID meanwhile
            self.snapshots.check(req.swapped, self.id_in_use(rid) and self.requests.get(rid) is not req)
        except SnapshotError:
            return False
        self.scheduler.waiting.popleft()
        del self.requests[rid]
        del self._detok[rid]
        self._install(req.swapped)
        self.requests[rid].queue_time = req.queue_time
        return True

    def _quiesce(self) -> list[RequestOutput]:
        """Commit every ticket in flight: afterwards no request has rows on the device."""
        outputs: list[RequestOutput] = []
        while self._inflight:
            ticket = self._inflight.popleft()
            outputs += self._commit(ticket.result())
            self._release_tails(ticket)
            self.scheduler.ticket_done(ticket.ticket_id)
        return outputs

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(f"the engine stopped after a failed forward call: {self.failure}")

    def stats(self) -> EngineStats:
        m = self.metrics
        records, held = self.kv.records, set(self.kv.requests())
        cache = self.scheduler.prefix_cache
        parts = [self.scheduler.prompts, *self.features, *([cache] if cache is not None else [])]
        features = {k: v for f in parts for k, v in f.stats().items()}
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.kv.usage,
                           self.kv.total_bytes_used, self.kv.num_pages, m.num_drafts, m.num_draft_tokens,
                           m.num_accepted_tokens, tuple(m.accepted_per_position), self.scheduler.num_preemptions,
                           token_sparse_prefill=group_summary(self.config.token_sparse_prefill),
                           kv_residual_quantization=group_summary(self.config.kv_residual_quantization),
                           kv_record_bytes_used=records.total_bytes_used if records is not None else 0,
                           kv_records_free=records.num_free if records is not None else 0,
                           kv_bytes_per_request={r.request_id: self.kv.bytes_used(r.kv_key)
                                                 for r in self.scheduler.running if r.kv_key in held},
                           sparse_decode_attention=group_summary(self.config.sparse_decode_attention),
                           iteration_tokens=self.iteration_tokens.cumulative(),
                           iteration_tokens_sum=self.iteration_tokens.total, **features)

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step. A failure that belongs to one request (planning or committing
        it) ends that request with an error and the step goes on; anything else raised
        here (a forward call, shared bookkeeping) may have corrupted shared state, so it
        marks the engine dead and propagates."""
        self._check_alive()
        try:
            return self._step()
        except BaseException as exc:
            self.failure = exc
            raise

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule() if len(self._inflight) < self.config.max_inflight_tickets else None
        self._clock_admissions()
        outputs += [self._fail(req, exc, "planned") for req, exc in self.scheduler.take_failed()]
        if plan is not None:
            self._inflight.append(self.executor.submit(plan))
            self.iteration_tokens.observe(plan.num_entering)
        if self._inflight and (plan is None or len(self._inflight) >= self.config.max_inflight_tickets):
            ticket = self._inflight.popleft()
            outputs += self._commit(ticket.result())
            self._release_tails(ticket)
            self.scheduler.ticket_done(ticket.ticket_id)
            return outputs
        if plan is None and self.requests and not outputs:
            raise RuntimeError("scheduler stalled: live requests but no work and no ticket in flight")
        return outputs

    def _clock_admissions(self) -> None:
        """Give each request admitted since the last step its queue time. Admission is FCFS, so
        the admitted are a prefix of `_queued` (one aborted or preempted while there leaves it too)."""
        now = time.monotonic()
        while self._queued:
            req, added = self._queued[0]
            if req.status is Status.WAITING and not req.num_preemptions:
                return
            self._queued.popleft()
            if req.status is not Status.FINISHED:
                req.queue_time = now - added

    def _release_tails(self, ticket: Ticket) -> None:
        """INT4 residuals: give back the BF16 tail pages the ticket found no query reads
        exact any more (a request preempted or finished since has another key, or none)."""
        live = set(self.kv.requests())
        for key, plane, pages in ticket.releases():
            if key in live:
                self.kv.release_prefix(key, plane, pages)

    def _commit(self, results: list[SampleResult]) -> list[RequestOutput]:
        outputs = []
        for res in results:
            req = self.requests.get(res.group.request_id)
            if req is None or req.incarnation != res.group.incarnation:
                continue  # stale: the request ended or its ID was reused
            try:
                outputs.append(self._commit_one(req, res))
            except Exception as exc:
                outputs.append(self._fail(req, exc, "committed"))
        return outputs

    def _commit_one(self, req: Request, res: SampleResult) -> RequestOutput:
        head = res.group.head
        assert head.index == len(req.output_ids), "samples commit in order"
        if isinstance(head, (Verify, VerifyCandidate)):
            self.metrics.record_round(req, head.num_candidates, res.accepted)
        out = self._accept(req, res.tokens, res.logprobs)
        if not out.finished and (not isinstance(head, Sample) or head.controlled):
            self.scheduler.committed(req, Commit(res.accepted, head.index, res.tokens[-1]))
        return out

    def _fail(self, req: Request, exc: Exception, stage: str) -> RequestOutput:
        """End one request whose planning or commit raised; the engine goes on serving.

        Its storage returns like an abort's (once the tickets in flight completed) and
        whatever it had not yet emitted is lost; its final output carries the error."""
        log.error("request %s failed while being %s", req.request_id, stage, exc_info=exc)
        if self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]
            self._detok.pop(req.request_id, None)
        if req.status is not Status.FINISHED:
            self.scheduler.finish(req, "error")
        message = f"the request failed while being {stage}: {type(exc).__name__}: {exc}"
        return RequestOutput(req.request_id, "", [], True, "error", req.usage(), None, error=message,
                             queue_time=req.queue_time)

    def _accept(self, req: Request, tokens: list[int], logprobs: list[float] | None) -> RequestOutput:
        """Append tokens in order, stopping at exactly the token that ends the request."""
        params = req.params
        detok = self._detok[req.request_id]
        text, taken = "", []
        for token in tokens:
            req.output_ids.append(token)
            taken.append(token)
            if token in req.stop_ids:
                return self._end(req, "stop", text + detok.flush(), taken, logprobs)  # no text for it
            text += detok.add(token)
            if detok.stopped:
                return self._end(req, "stop", text, taken, logprobs)
            if len(req.output_ids) >= params.max_tokens:
                return self._end(req, "length", text + detok.flush(), taken, logprobs)
        kept = logprobs[: len(taken)] if params.logprobs and logprobs is not None else None
        return RequestOutput(req.request_id, text, taken, False, None, req.usage(), kept)

    def _end(self, req: Request, reason: str, text: str, tokens: list[int], logprobs: list[float] | None) -> RequestOutput:
        self.scheduler.finish(req, reason)
        del self.requests[req.request_id]
        del self._detok[req.request_id]
        kept = logprobs[: len(tokens)] if req.params.logprobs and logprobs is not None else None
        return RequestOutput(req.request_id, text, tokens, True, reason, req.usage(), kept, queue_time=req.queue_time)

    def drain(self) -> list[RequestOutput]:
        """Run steps until every request finished (used by the synchronous API)."""
        outputs: list[RequestOutput] = []
        while self.has_unfinished():
            outputs.extend(self.step())
        return outputs



def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecloopError("device cuda was requested but CUDA is not available")
    return device
