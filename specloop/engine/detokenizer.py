"""Streaming detokenization: token ids in, final text deltas out, stop strings cut.

Two things make a token's text not final yet:

- its bytes may end inside a UTF-8 character (the decoded text ends in U+FFFD) that the
  next tokens complete;
- its text may be the start of a stop string that the next tokens complete.

Both are held back until they resolve. Each token is decoded inside a short window of
the tokens before it (the context), so that decoders which depend on neighbours (byte
merges, leading-space rules) come out as in a full decode, while the work per token stays
bounded instead of growing with the output.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5  # prompt tokens decoded as context of the first output token
MAX_PENDING = 4  # tokens held while the text ends in U+FFFD before looking for a final part
MAX_HELD = 16  # tokens held at most: then the text is released as it reads, U+FFFD and all


class IncrementalDetokenizer:
    """Turns one request's sampled tokens into streamed text.

    `add` returns the text that became final with that token; `flush` releases what is
    held back when generation ends. `text` is everything emitted. Once a stop string
    appears, `stopped` is set, `stop_reason` names it, the text ends right before it, and
    later tokens are ignored. When several stop strings appear, the one that completes
    first wins (the longest on a tie), so the result does not depend on how the text is
    split into tokens.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...],
                 skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = stop
        self._window = list(prompt_ids[-PROMPT_CONTEXT:])  # context tokens, then pending ones
        self._read = len(self._window)  # window[:read] is context whose text is already out
        self._context_text = self._decode(self._window)
        self._held = ""  # final text kept back because it may start a stop string
        self._pieces: list[str] = []
        self.stopped = False
        self.stop_reason: str | None = None

    STATE = ("_skip_special", "_stop", "_window", "_read", "_context_text", "_held", "_pieces", "stopped",
             "stop_reason")

    def state(self) -> dict[str, Any]:
        """Plain values that `from_state` rebuilds it from (a request snapshot's part)."""
        return {name: list(v) if isinstance(v, (list, tuple)) else v
                for name, v in ((n, getattr(self, n)) for n in self.STATE)}

    @classmethod
    def from_state(cls, tokenizer: Any, state: dict[str, Any]) -> "IncrementalDetokenizer":
        detok = cls.__new__(cls)
        detok._tokenizer = tokenizer
        for name in cls.STATE:
            setattr(detok, name, state[name])
        detok._stop = tuple(detok._stop)
        return detok

    @property
    def text(self) -> str:
        """Everything emitted so far (joined lazily: appending stays linear)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int) -> str:
        """Feed one sampled token; return the text that became final."""
        if self.stopped:
            return ""
        self._window.append(token_id)
        split, text = len(self._window), self._decode(self._window)
        if text.endswith(REPLACEMENT):  # maybe a character whose next bytes are still to come
            split, text = self._final_part(text)
            if split == self._read:
                return ""
        delta = text[len(self._context_text):]
        self._advance(split)
        return self._release(delta, final=False)

    def flush(self) -> str:
        """End of generation: release everything held back, up to a stop string."""
        if self.stopped:
            return ""
        delta = self._decode(self._window)[len(self._context_text):]
        self._advance(len(self._window))
        return self._release(delta, final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _final_part(self, text: str) -> tuple[int, str]:
        """The latest token boundary before which the window's text is final, and that text.

        U+FFFD at the end of `text` comes from invalid bytes as well as from unfinished
        characters, so after MAX_PENDING tokens the window is searched: a boundary is
        final when the text before it decodes to a proper prefix of `text` (a character
        cut there would read differently in `text`, or still be unfinished at its end).
        After MAX_HELD tokens everything is released as it reads now.
        """
        pending = len(self._window) - self._read
        if pending >= MAX_HELD:
            return len(self._window), text
        if pending >= MAX_PENDING:
            for split in range(len(self._window) - 1, self._read, -1):
                head = self._decode(self._window[:split])
                if len(head) < len(text) and text.startswith(head):
                    return split, head
        return self._read, self._context_text

    def _advance(self, split: int) -> None:
        """The text of window[read:split] is out: those tokens become the next context."""
        self._window = self._window[self._read:]
        self._read = split - self._read
        self._context_text = self._decode(self._window[:self._read])

    def _release(self, delta: str, final: bool) -> str:
        """Cut `held + delta` at the first stop string, or hold back a tail that may start one."""
        text = self._held + delta
        match = _first_stop(text, self._stop)
        if match is not None:
            start, self.stop_reason = match
            self.stopped = True
            out, self._held = text[:start], ""
        else:
            cut = len(text) if final else len(text) - _stop_prefix_length(text, self._stop)
            out, self._held = text[:cut], text[cut:]
        if out:
            self._pieces.append(out)
        return out


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop string) of the occurrence that ends first; the longest on a tie."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0:
            candidate = (start + len(stop), start, stop)
            best = candidate if best is None else min(best, candidate)
    return None if best is None else (best[1], best[2])


def _stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
