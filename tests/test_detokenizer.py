"""IncrementalDetokenizer: streamed text equals a full decode; stop strings cut exactly.

Two tokenizers: the byte-level one of the tiny random checkpoint (one byte per token, so
every multi-byte character spans tokens), and a byte-level BPE trained here whose merged
tokens hold several characters or end inside a character.
"""

from __future__ import annotations

import random

import pytest

from specloop.checkpoint import load_tokenizer
from specloop.checkpoint.tokenizer import IM_END, IM_START, SPECIAL_TOKENS, save_tokenizer
from specloop.engine.detokenizer import MAX_HELD, MAX_PENDING, PROMPT_CONTEXT, IncrementalDetokenizer

ALPHABET = list("abcdefghij XYZ,.!?\n") + ["é", "ü", "✓", "€", "😀", "🚀", "中", "文", "字"]
CORPUS_WORDS = ["hello", "world", "café", "naïve", "✓✓", "done✓", "😀😀", "🚀launch", "中文字符", "文字",
                "über", "€100", "résumé", "stop", "STOP", "the end"]


@pytest.fixture(scope="session")
def byte_tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


@pytest.fixture(scope="session")
def bpe_tok(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    tok.train_from_iterator([" ".join(rng.choices(CORPUS_WORDS, k=12)) for _ in range(400)], trainer)
    folder = tmp_path_factory.mktemp("bpe")
    save_tokenizer(tok, folder, max_length=2048)
    return load_tokenizer(folder)


@pytest.fixture(params=["byte", "bpe"])
def tok(request, byte_tok, bpe_tok):
    return byte_tok if request.param == "byte" else bpe_tok


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _stream(tok, ids: list[int], stop: tuple[str, ...] = (), prompt: list[int] | None = None,
            skip_special_tokens: bool = True) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `ids` one at a time (until a stop), then flush; return the deltas."""
    detok = IncrementalDetokenizer(tok, prompt or [], stop, skip_special_tokens)
    deltas = []
    for i in ids:
        deltas.append(detok.add(i))
        if detok.stopped:
            break
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return detok, deltas


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choices(ALPHABET, k=rng.randint(1, 60)))


def test_bpe_fixture_has_merged_and_split_characters(bpe_tok):
    """The BPE tokenizer must exercise the hard cases: several characters in one token, a
    rare character across tokens, and tokens that end or start inside a character."""
    pieces = [bpe_tok.decode([i]) for i in _ids(bpe_tok, "résumé 中文字符 🎉")]
    assert any(len(p) > 2 and "\ufffd" not in p for p in pieces)
    assert any("\ufffd" in p for p in pieces)
    vocab = [bpe_tok.decode([i]) for i in range(len(bpe_tok))]
    assert any("\ufffd" in p and p.strip("\ufffd") for p in vocab)


def test_deltas_concatenate_to_the_full_decode(tok):
    rng = random.Random(1)
    prompt = _ids(tok, "<|im_start|>user\nsay ✓<|im_end|>\n<|im_start|>assistant\n")
    for _ in range(60):
        ids = _ids(tok, _random_text(rng))
        detok, deltas = _stream(tok, ids, prompt=prompt)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in d for d in deltas), "a partial character was emitted"
        assert not detok.stopped and detok.stop_reason is None


def test_random_token_ids_concatenate_to_the_full_decode(tok):
    """Any tokens a model may emit, mostly ones holding partial characters, so that runs
    of invalid and unfinished UTF-8 of every length occur."""
    rng = random.Random(4)
    partial = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    for _ in range(300):
        ids = [rng.choice(partial) if rng.random() < 0.7 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 60))]
        for skip in (True, False):
            _, deltas = _stream(tok, ids, skip_special_tokens=skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids


def test_characters_are_emitted_as_soon_as_complete(byte_tok):
    ids = _ids(byte_tok, "é😀a")  # 2 + 4 + 1 byte tokens
    _, deltas = _stream(byte_tok, ids)
    assert deltas == ["", "é", "", "", "", "😀", "a", ""]


def test_invalid_bytes_come_out_as_in_a_full_decode(byte_tok):
    e_acute, rocket = _ids(byte_tok, "é"), _ids(byte_tok, "🚀")
    cases = [
        [e_acute[1]] + _ids(byte_tok, "ab"),  # a lone continuation byte
        rocket[:2] + _ids(byte_tok, "x"),  # a truncated character, then ASCII
        e_acute[:1] + e_acute[:1] + e_acute,  # two lead bytes, then a full character
        _ids(byte_tok, "ok") + rocket[:3],  # generation ends inside a character
    ]
    for ids in cases:
        assert "".join(_stream(byte_tok, ids)[1]) == byte_tok.decode(ids)


def test_a_never_finished_character_is_released(byte_tok):
    """A lead byte followed only by tokens that decode to nothing (skipped specials) stays
    unfinished forever: it comes out as U+FFFD after at most MAX_HELD tokens."""
    lead, im_end = _ids(byte_tok, "🚀")[0], byte_tok.convert_tokens_to_ids(IM_END)
    detok = IncrementalDetokenizer(byte_tok, [], (), True)
    deltas = [detok.add(lead)] + [detok.add(im_end) for _ in range(MAX_HELD)]
    assert "".join(deltas) == "\ufffd" and detok.flush() == ""
    deltas = [detok.add(lead) for _ in range(3 * MAX_HELD)]  # a run of lead bytes
    assert sum(len(d) for d in deltas) >= 2 * MAX_HELD


@pytest.mark.parametrize("kind", ["text", "random ids"])
def test_work_per_token_is_bounded(tok, kind):
    """Decode calls see a bounded window, however long the output: no quadratic re-decode."""
    calls: list[int] = []

    class Spy:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return tok.decode(ids, **kwargs)

    rng = random.Random(2)
    if kind == "text":
        ids = _ids(tok, "".join(rng.choices(ALPHABET, k=3000)))
    else:
        ids = [rng.randrange(len(tok)) for _ in range(3000)]
    detok = IncrementalDetokenizer(Spy(), _ids(tok, "a prompt ✓ "), ("never",), True)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert max(calls) <= max(PROMPT_CONTEXT, MAX_HELD) + MAX_HELD
    if kind == "text":  # valid UTF-8: one or two decodes of a few tokens per token
        assert max(calls) <= PROMPT_CONTEXT + MAX_PENDING and len(calls) <= 2 * len(ids) + 3


def test_special_tokens_skipped_or_kept(tok):
    im_end, im_start = tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(IM_START)
    ids = _ids(tok, "hi é") + [im_end] + _ids(tok, " there✓") + [im_start]
    assert "".join(_stream(tok, ids)[1]) == "hi é there✓"
    kept = "".join(_stream(tok, ids, skip_special_tokens=False)[1])
    assert kept == "hi é<|im_end|> there✓<|im_start|>" == tok.decode(ids, skip_special_tokens=False)


def test_context_tokens_give_leading_spaces(tmp_path):
    """A Metaspace (SentencePiece-style) decoder drops the leading space of the first token
    it decodes: only decoding with the previous tokens as context keeps the spaces between
    words, including the one between the prompt and the first output token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["\u2581hello", "\u2581world", "\u2581again"]
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *words, "<unk>"])}
    spm = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    spm.pre_tokenizer, spm.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    spm.add_special_tokens(list(SPECIAL_TOKENS))
    save_tokenizer(spm, tmp_path, max_length=128)
    tok = load_tokenizer(tmp_path)
    hello, world, again = _ids(tok, "hello world again")
    assert tok.decode([world]) == "world"  # alone, the space is gone
    _, deltas = _stream(tok, [world, again, world], prompt=[hello])
    assert deltas == [" world", " again", " world", ""]


@pytest.mark.parametrize("text, stop, expected", [
    ("Hello world, bye", ("world",), "Hello "),
    ("done ✓ ok then", ("✓ ok",), "done "),  # a multi-byte character inside the stop string
    ("café au lait", ("é a",), "caf"),
    ("aaab", ("aab",), "a"),  # overlapping partial matches
    ("line one\n\nline two", ("\n\n",), "line one"),
])
def test_stop_string_across_token_boundaries(tok, text, stop, expected):
    detok, deltas = _stream(tok, _ids(tok, text), stop)
    assert "".join(deltas) == detok.text == expected
    assert detok.stopped and detok.stop_reason == stop[0]


def test_stop_at_the_first_token(byte_tok):
    for text, stop in [("Hi there", "H"), ("é!", "é")]:
        detok = IncrementalDetokenizer(byte_tok, _ids(byte_tok, "prompt: "), (stop,), True)
        ids = _ids(byte_tok, text)
        deltas = [detok.add(i) for i in ids]
        assert detok.stopped and detok.stop_reason == stop
        assert deltas == [""] * len(ids) and detok.text == "" and detok.flush() == ""


def test_nothing_after_a_stop(byte_tok):
    detok = IncrementalDetokenizer(byte_tok, [], ("END",), True)
    for i in _ids(byte_tok, "abcEND"):
        detok.add(i)
    assert detok.stopped and detok.text == "abc"
    assert [detok.add(i) for i in _ids(byte_tok, "more")] == ["", "", "", ""]
    assert detok.flush() == "" and detok.text == "abc"


@pytest.mark.parametrize("text, stops, expected, reason", [
    ("hello world", ("world", "lo w"), "hel", "lo w"),  # "lo w" completes first
    ("xaby", ("b", "a"), "x", "a"),  # list order does not matter
    ("abcd", ("bcd", "c"), "ab", "c"),  # first to complete, not first to start
    ("hello world", ("world", "or"), "hello w", "or"),  # the same inside one BPE token
    ("xabc", ("bc", "abc"), "x", "abc"),  # complete together: the longest wins
])
def test_several_stop_strings_first_completed_wins(tok, text, stops, expected, reason):
    for order in (stops, stops[::-1]):
        detok, deltas = _stream(tok, _ids(tok, text), order)
        assert "".join(deltas) == expected and detok.stop_reason == reason


def test_stop_prefix_is_held_then_released(byte_tok):
    _, deltas = _stream(byte_tok, _ids(byte_tok, "xSTOy"), ("STOP",))
    assert deltas == ["x", "", "", "", "STOy", ""]
    _, deltas = _stream(byte_tok, _ids(byte_tok, "abST"), ("STOP",))
    assert deltas == ["a", "b", "", "", "ST"]  # generation ends: flush releases the held tail


def _cut_at_first_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """Reference: scan the finished text character by character."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[:end - len(stop)], stop
    return text, None


def test_stop_strings_match_a_character_scan_of_the_full_text(tok):
    """Random texts and stop strings (often present, often only partly present): the
    streamed result equals cutting the full decode at the first completed stop string,
    whatever the tokenization."""
    rng = random.Random(3)
    for _ in range(150):
        text = _random_text(rng)
        stops = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(text))
            stop = text[start:start + rng.randint(1, 4)]
            stops.append(stop if rng.random() < 0.7 else stop + rng.choice(ALPHABET))
        stops_t = tuple(stops)
        ids = _ids(tok, text)
        detok, deltas = _stream(tok, ids, stops_t)
        expected, reason = _cut_at_first_stop(tok.decode(ids), stops_t)
        assert ("".join(deltas), detok.stop_reason) == (expected, reason), (text, stops_t)
        assert detok.stopped == (reason is not None)
