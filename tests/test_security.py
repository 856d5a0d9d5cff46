"""specloop never runs a checkpoint's code and never reads stdin.

The planted checkpoint is the tiny one with an `auto_map` in config.json and
tokenizer_config.json naming classes in `evil.py`, which writes a marker file when
imported. Loading it must ignore auto_map (or fail with one CheckpointError); it must
never import the module, and never ask "[y/N]" on stdin. The subprocesses get a stdin
pipe that stays open and is never written: a read there would block, not see EOF.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.testing import ServerProcess
from specloop.checkpoint.tokenizer import load_tokenizer
from specloop.errors import CheckpointError
from tests.conftest import TINY, make_checkpoint

EVIL = """import pathlib
pathlib.Path({marker!r}).write_text("imported")


class EvilConfig:
    pass


class EvilTokenizer:
    pass
"""
FORBIDDEN = ("trust_remote_code", "[y/N]", "custom code", "standard input", "Traceback")
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def plant(root: Path, keep_tokenizer_class: bool) -> tuple[Path, Path]:
    """(checkpoint, marker): the tiny checkpoint with auto_map pointing at a planted evil.py."""
    ckpt = make_checkpoint(root / "ckpt", TINY, seed=3)
    marker = root / "IMPORTED"
    (ckpt / "evil.py").write_text(EVIL.format(marker=str(marker)))
    edit(ckpt / "config.json", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilConfig"})
    tok = edit(ckpt / "tokenizer_config.json", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]})
    if not keep_tokenizer_class:  # only the planted code could build this tokenizer
        tok.pop("tokenizer_class")
        (ckpt / "tokenizer_config.json").write_text(json.dumps(tok))
    return ckpt, marker


def edit(path: Path, **fields: object) -> dict:
    data = {**json.loads(path.read_text()), **fields}
    path.write_text(json.dumps(data))
    return data


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> tuple[Path, Path]:
    """A tokenizer transformers can build without the planted code (tokenizer_class is set)."""
    return plant(tmp_path_factory.mktemp("planted"), keep_tokenizer_class=True)


@pytest.fixture(scope="module")
def code_only(tmp_path_factory) -> tuple[Path, Path]:
    """A tokenizer only the planted code could build (no tokenizer_class)."""
    return plant(tmp_path_factory.mktemp("code_only"), keep_tokenizer_class=False)


@contextlib.contextmanager
def silent_stdin() -> Iterator[int]:
    """The read end of a pipe that stays open and is never written: reading it blocks."""
    read, write = os.pipe()
    try:
        yield read
    finally:
        os.close(read)
        os.close(write)


def assert_untouched(output: str, marker: Path, modules: Path | None = None) -> None:
    assert not marker.exists(), "the planted module was imported"
    for text in FORBIDDEN:
        assert text not in output, f"{text!r} in the output:\n{output}"
    if modules is not None:
        assert not list(modules.rglob("evil*")), "the planted module was copied into the modules cache"


def subprocess_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    modules = tmp_path / "hf_modules"
    return {**os.environ, **ENV, "HF_MODULES_CACHE": str(modules), "HF_HUB_OFFLINE": "1"}, modules


def test_load_tokenizer_ignores_auto_map(planted, capfd):
    ckpt, marker = planted
    tok = load_tokenizer(ckpt)
    assert type(tok).__module__.startswith("transformers.")
    assert tok.decode(tok.encode("hello", add_special_tokens=False)) == "hello"
    assert "evil" not in sys.modules
    out, err = capfd.readouterr()
    assert_untouched(out + err, marker)


def test_load_tokenizer_refuses_code_only_tokenizer(code_only, capfd):
    ckpt, marker = code_only
    with pytest.raises(CheckpointError) as refused:
        load_tokenizer(ckpt)
    message = str(refused.value)
    assert "\n" not in message and "evil.EvilTokenizer" in message and "never runs" in message
    assert "evil" not in sys.modules
    out, err = capfd.readouterr()
    assert_untouched(out + err + message, marker)


@pytest.mark.parametrize("which", ["planted", "code_only"])
def test_generate_neither_imports_nor_prompts(request, tmp_path, which):
    ckpt, marker = request.getfixturevalue(which)
    env, modules = subprocess_env(tmp_path)
    with silent_stdin() as stdin:
        proc = subprocess.Popen([sys.executable, "-m", "specloop.cli", "generate", str(ckpt), "--prompt", "hi",
                                 "--max-tokens", "3", "--device", "cpu"], stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        try:
            out, err = proc.communicate(timeout=60)  # a read of stdin would block here
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert_untouched(out + err, marker, modules)
    if which == "planted":
        assert proc.returncode == 0, err
    else:
        assert proc.returncode == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: the tokenizer in ") and "never runs" in lines[0], err


def test_serve_neither_imports_nor_prompts(planted, tmp_path):
    ckpt, marker = planted
    env, modules = subprocess_env(tmp_path)
    with silent_stdin() as stdin:
        srv = ServerProcess([str(ckpt), "--device", "cpu"], env=env, stdin=stdin)
        with srv:
            for path, body in (("/v1/completions", {"prompt": "def f(x):", "max_tokens": 3}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 3})):
                reply = httpx.post(srv.url + path, json=body, timeout=60)
                assert reply.status_code == 200, reply.text
    assert srv.returncode == 0, srv.output
    assert_untouched(srv.output, marker, modules)
