"""Batched next-token sampling on the device, without host synchronisation.

`sample` never reads a device value back to the CPU: no `.item()`, `.tolist()`, `.cpu()`
and no Python branch on a tensor value. Which filters run is decided from Python flags
computed on the CPU when the batch is built, so the CPU can plan the next forward call
while this one runs.

Each sampled row draws its Gumbel noise from its own `torch.Generator`, one `torch.rand`
call per row: a seeded request gets the same tokens alone or in any batch, whatever the
other rows are. Filters that are off for a row leave its logits bit for bit unchanged,
so running a filter for another row cannot change this row's draw.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.nn.functional as F

from specloop.sampling_params import SamplingParams

from specloop.runtime.forward_batch import NO_TOP_K  # top_k of rows without top-k; clamped in `sample`


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of one forward call as device tensors, plus CPU flags.

    Greedy rows carry neutral values (temperature 1, no filters) and no generator: they
    take the argmax and draw no noise, so their generators never advance.
    """

    temperature: torch.Tensor  # [N] fp32
    top_k: torch.Tensor  # [N] long, NO_TOP_K where disabled
    top_p: torch.Tensor  # [N] fp32, 1 where disabled
    min_p: torch.Tensor  # [N] fp32, 0 where disabled
    greedy: torch.Tensor  # [N] bool
    generators: tuple[torch.Generator | None, ...]  # None on greedy rows
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    want_logprobs: bool

    @classmethod
    def of(cls, params: list[SamplingParams], generators: list[torch.Generator], temperature: torch.Tensor,
           top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, greedy: torch.Tensor) -> "SamplingBatch":
        """From device columns already uploaded (the forward batch's heads), with the CPU
        flags from `params`; nothing is copied to the device here."""
        sampled = [not p.is_greedy for p in params]
        return cls(temperature, top_k, top_p, min_p, greedy,
                   generators=tuple(g if s else None for g, s in zip(generators, sampled)),
                   all_greedy=not any(sampled), any_greedy=not all(sampled),
                   any_top_k=any(s and p.top_k > 0 for p, s in zip(params, sampled)),
                   any_top_p=any(s and p.top_p < 1.0 for p, s in zip(params, sampled)),
                   any_min_p=any(s and p.min_p > 0.0 for p, s in zip(params, sampled)),
                   want_logprobs=any(p.logprobs for p in params))

    @classmethod
    def build(cls, params: list[SamplingParams], generators: list[torch.Generator],
              device: torch.device | str) -> "SamplingBatch":
        """Uploads the columns from Python lists: for tests and the admission check, not the
        forward path (which uses `of` over the forward batch)."""
        if len(params) != len(generators):
            raise ValueError(f"need one generator per row: {len(params)} params, {len(generators)} generators")
        device = torch.device(device)
        sampled = [not p.is_greedy for p in params]

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return _upload(torch.tensor(values, dtype=dtype), device)

        return cls(
            temperature=column([p.temperature if s else 1.0 for p, s in zip(params, sampled)], torch.float32),
            top_k=column([p.top_k if s and p.top_k > 0 else NO_TOP_K for p, s in zip(params, sampled)], torch.long),
            top_p=column([p.top_p if s else 1.0 for p, s in zip(params, sampled)], torch.float32),
            min_p=column([p.min_p if s else 0.0 for p, s in zip(params, sampled)], torch.float32),
            greedy=column([not s for s in sampled], torch.bool),
            generators=tuple(g if s else None for g, s in zip(generators, sampled)),
            all_greedy=not any(sampled),
            any_greedy=not all(sampled),
            any_top_k=any(s and p.top_k > 0 for p, s in zip(params, sampled)),
            any_top_p=any(s and p.top_p < 1.0 for p, s in zip(params, sampled)),
            any_min_p=any(s and p.min_p > 0.0 for p, s in zip(params, sampled)),
            want_logprobs=any(p.logprobs for p in params),
        )


@dataclasses.dataclass(frozen=True)
class SampleOutput:
    token_ids: torch.Tensor  # [N] long
    logprobs: torch.Tensor | None  # [N] fp32, when any row asked for them


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    """Pick one token per row of `logits` [N, V] fp32; no host synchronisation.

    Greedy rows take `argmax` (ties: the lowest index). Sampled rows divide by their
    temperature, apply top-k, then top-p, then min-p, and draw with the Gumbel-max trick.
    Logprobs are `log_softmax` of the raw logits at the chosen token, before temperature
    and filters: they report what the model believes, independent of how it was sampled.
    """
    if batch.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        scores = _filter(logits / batch.temperature[:, None], batch)
        token_ids = (scores + _gumbel_noise(batch.generators, logits)).argmax(dim=-1)
        if batch.any_greedy:
            token_ids = torch.where(batch.greedy, logits.argmax(dim=-1), token_ids)
    logprobs = None
    if batch.want_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, token_ids[:, None]).squeeze(1)
    return SampleOutput(token_ids, logprobs)


def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[N, V] fp32: the distribution `sample` draws each row from (one-hot on greedy rows).

    Speculative sampling needs it for both the draft (q) and the target (p)."""
    probs = _filter(logits / batch.temperature[:, None], batch).softmax(dim=-1)
    if batch.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(batch.greedy[:, None], one_hot, probs)
    return probs


def check_representable(params: SamplingParams) -> None:
    """Build this request's sampling row on the CPU once, at admission.

    The runner builds the same tensors in the middle of a forward call, where a failure
    would end the engine; building them here first turns a value the device dtypes cannot
    hold into a refusal of this one request."""
    SamplingBatch.build([params], [draw_generator(params.seed, 0, 0, 0, "check", "cpu")], "cpu")


def make_generator(seed: int | None, engine_seed: int, request_index: int,
                   device: torch.device | str) -> torch.Generator:
    """A request's generator: its own seed, or one derived from (engine seed, request index).

    Deriving unseeded requests' seeds makes a whole run reproducible from the engine seed
    while still giving every request different noise.
    """
    if seed is None:
        digest = hashlib.blake2b(f"{engine_seed}/{request_index}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little")
    return torch.Generator(device=torch.device(device)).manual_seed(seed % 2**64)


def draw_generator(seed: int | None, engine_seed: int, request_index: int, position: int, purpose: str,
                   device: torch.device | str) -> torch.Generator:
    """A fresh generator for one draw, a function of (request seed, position, purpose).

    The engine uses one per draw instead of one stream per request, so a draw never
    depends on how many draws came before it: speculation discards calls planned on a
    wrong guess, and their draws must not shift the ones that count. Unseeded requests
    use (engine seed, request index) as their seed, as `make_generator` does.
    """
    base = str(seed % 2**64) if seed is not None else f"{engine_seed}/{request_index}"
    digest = hashlib.blake2b(f"{base}/{position}/{purpose}".encode(), digest_size=8).digest()
    return torch.Generator(device=torch.device(device)).manual_seed(int.from_bytes(digest, "little"))


def _upload(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        values = values.pin_memory()
    return values.to(device, non_blocking=True)


def _filter(scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set the scores of tokens that top-k, top-p or min-p exclude to -inf."""
    if batch.any_top_k or batch.any_top_p:
        scores = _top_k_top_p(scores, batch)
    if batch.any_min_p:
        # p >= min_p * p_max  <=>  score >= max score + log(min_p); log(0) = -inf keeps all
        floor = scores.amax(dim=-1, keepdim=True) + torch.log(batch.min_p)[:, None]
        scores = scores.masked_fill(scores < floor, float("-inf"))
    return scores


def _top_k_top_p(scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k (ties with the k-th score are kept), then top-p on the renormalised rest.

    Top-p keeps the smallest prefix of the sorted tokens whose mass reaches top_p: a
    token stays when the mass strictly before it is below top_p, so the top token
    always stays. Rows with top_p = 1 skip the test, so rounding in the cumulative sum
    cannot drop their tail.
    """
    ranked, order = scores.sort(dim=-1, descending=True)
    drop = torch.zeros_like(ranked, dtype=torch.bool)
    if batch.any_top_k:
        k = batch.top_k.clamp(max=scores.shape[-1])
        drop = ranked < ranked.gather(1, (k - 1)[:, None])
        ranked = ranked.masked_fill(drop, float("-inf"))
    if batch.any_top_p:
        mass = ranked.softmax(dim=-1).cumsum(dim=-1)
        mass_before = F.pad(mass[:, :-1], (1, 0))
        top_p = batch.top_p[:, None]
        drop |= (mass_before >= top_p) & (top_p < 1.0)
    drop = torch.empty_like(drop).scatter_(1, order, drop)  # back to vocabulary order
    return scores.masked_fill(drop, float("-inf"))


def _gumbel_noise(generators: tuple[torch.Generator | None, ...], like: torch.Tensor) -> torch.Tensor:
    """[N, V] Gumbel(0, 1) noise, each sampled row from its own generator; 0 on greedy rows."""
    vocab = like.shape[-1]
    return torch.stack([like.new_zeros(vocab) if gen is None else _gumbel_row(gen, vocab, like.device)
                        for gen in generators])


def _gumbel_row(gen: torch.Generator, vocab: int, device: torch.device) -> torch.Tensor:
    # u in [tiny, 1): the noise stays finite, so a kept token never scores -inf
    u = torch.rand(vocab, generator=gen, device=device).clamp_(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))
