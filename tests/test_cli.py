"""The `specloop` command's front door: MODEL as a positional, --version, defaults in --help,
the port checked before the model loads, API keys, and exit 1 when the engine dies.

`main` is the console script (`server.cli.main`: the library's commands plus `serve`);
`specloop.cli` alone has no `serve` and never imports the server."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

import specloop.cli
from server.cli import API_KEY_ENV, build_parser, main
from server.testing import ServerProcess
from specloop import __version__
from specloop.cli import ENGINE_OPTIONS, HelpFormatter
from specloop.engine.config import EngineConfig

THREADS_1 = {"OMP_NUM_THREADS": "1"}
KEY = "sk-test-0123456789"

# Runs `specloop serve` with every forward call failing: the engine dies on the first request.
FAILING_SERVE = textwrap.dedent("""
    import sys
    from server.cli import main
    from specloop.engine.executor import Executor

    def submit(self, plan):
        raise RuntimeError("injected forward failure")

    Executor.submit = submit
    sys.exit(main(["serve", *sys.argv[1:]]))
""")


def one_line(text: str) -> str:
    return " ".join(text.split())


def subparsers(parser: argparse.ArgumentParser | None = None) -> dict[str, object]:
    parser = parser or build_parser()
    (action,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return dict(action.choices)


def test_console_script_is_the_server_cli():
    """pyproject's `specloop` script must be the entry point that has `serve` (the library's has not)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    module, _, function = pyproject["project"]["scripts"]["specloop"].partition(":")
    assert (module, function) == ("server.cli", "main")
    assert list(subparsers()) == ["random-checkpoint", "generate", "serve"]
    assert list(subparsers(specloop.cli.build_parser())) == ["random-checkpoint", "generate"]


def test_library_cli_has_no_serve(capsys):
    with pytest.raises(SystemExit) as done:
        specloop.cli.main(["serve"])
    assert done.value.code == 2 and "invalid choice: 'serve'" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"specloop {__version__}\n"


def test_help_shows_engine_config_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = one_line(capsys.readouterr().out)
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert defaults["block_size"] == 16
    assert "tokens per KV page (default: 16)" in out
    for name in ("max_num_seqs", "max_waiting_requests", "max_stop_strings", "max_stop_chars", "speculation"):
        assert f"(default: {defaults[name]})" in out, name
    assert "(default: 8000)" in out and "(default: 127.0.0.1)" in out
    assert "[MODEL]" in out


def test_every_option_of_every_command_shows_its_default():
    formatter = HelpFormatter("specloop")
    for command, parser in subparsers().items():
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert "default" in formatter._get_help_string(action), (command, action.dest)
    for name in ENGINE_OPTIONS:
        assert any(f.name == name for f in dataclasses.fields(EngineConfig)), name


def test_generate_takes_the_model_as_a_positional(tiny_ckpt, capsys):
    assert main(["generate", str(tiny_ckpt), "--prompt", "hi", "--max-tokens", "3", "--device", "cpu"]) == 0


def test_the_same_model_twice_is_no_conflict(tmp_path, capsys):
    missing = tmp_path / "nothing"
    assert main(["generate", str(missing), "--model", f"{tmp_path}/./nothing", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "two models" not in err and "nothing" in err  # it got as far as loading the one model


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]])
def test_two_different_models_are_one_error_line(tmp_path, capsys, command):
    assert main([command[0], str(tmp_path / "a"), "--model", str(tmp_path / "b"), *command[1:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: two models given"), err


def test_busy_port_is_refused_before_the_model_loads(tmp_path):
    """A busy port and a model folder that does not exist: the error is about the port."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "server", str(tmp_path / "nothing"),
                               "--port", str(port)], capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot listen on 127.0.0.1:{port}: "), lines
    assert "nothing" not in done.stderr and done.stdout == ""


def test_port_taken_while_the_model_loads_is_the_same_error(tiny_ckpt, monkeypatch, capsys):
    """Two SO_REUSEADDR sockets may both bind a port; whoever listens second gets the error."""
    from specloop.engine.async_engine import AsyncEngine

    thief = socket.socket()
    thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    thief.bind(("127.0.0.1", 0))
    port = thief.getsockname()[1]
    load = AsyncEngine.from_options.__func__

    def from_options(cls, *args, **kwargs):
        thief.listen()  # another server takes the port while this one loads its model
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(AsyncEngine, "from_options", classmethod(from_options))
    try:
        assert main(["serve", str(tiny_ckpt), "--device", "cpu", "--port", str(port), "--log-level", "warning"]) == 2
    finally:
        thief.close()
    assert capsys.readouterr().err.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


def check_auth(url: str, key: str) -> None:
    assert httpx.get(url + "/health").status_code == 200
    refused = httpx.get(url + "/v1/models")
    assert refused.status_code == 401, refused.text
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert ok.status_code == 200, ok.text


def test_api_key_and_positional_model(tiny_ckpt):
    """The served name defaults to the folder's base name; the path as given still matches."""
    env = {k: v for k, v in {**os.environ, **THREADS_1}.items() if k != API_KEY_ENV}
    srv = ServerProcess([str(tiny_ckpt), "--api-key", KEY, "--device", "cpu"], env=env)
    with srv:
        check_auth(srv.url, KEY)
        auth = {"Authorization": f"Bearer {KEY}"}
        models = httpx.get(srv.url + "/v1/models", headers=auth).json()
        assert models["data"][0]["id"] == tiny_ckpt.name
        assert f"serving model {tiny_ckpt.name!r}" in srv.output
        for name in (tiny_ckpt.name, str(tiny_ckpt)):
            reply = httpx.post(srv.url + "/v1/completions", headers=auth, timeout=60,
                               json={"model": name, "prompt": [5, 6], "max_tokens": 2})
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == tiny_ckpt.name
    assert srv.returncode == 0, srv.output
    assert KEY not in srv.output  # --log-level info: nothing prints or logs it


@pytest.mark.parametrize("flag, env, expected", [(None, KEY, KEY), (None, "", None), ("other", KEY, "other"),
                                                 (None, None, None)])
def test_api_key_falls_back_to_the_environment(monkeypatch, flag, env, expected):
    seen = []
    monkeypatch.setattr("server.main.serve", lambda opts: seen.append(opts) or 0)
    if env is None:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(API_KEY_ENV, env)
    assert main(["serve", "--max-request-body-bytes", "1000", *(["--api-key", flag] if flag else [])]) == 0
    (opts,) = seen
    assert opts.api_key == expected and opts.max_body_bytes == 1000
    assert expected is None or expected not in repr(opts)  # the key never shows in a log of the options


def test_max_tokens_default_reaches_the_server(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr("server.main.serve", lambda opts: seen.append(opts) or 0)
    assert main(["serve"]) == 0 and main(["serve", "--max-tokens-default", "256"]) == 0
    assert [opts.max_tokens_default for opts in seen] == [None, 256]  # unset: chat runs to the context limit
    with pytest.raises(SystemExit):
        main(["serve", "--max-tokens-default", "0"])
    assert "--max-tokens-default" in capsys.readouterr().err


def test_empty_api_key_flag_is_an_error(capsys):
    assert main(["serve", "--api-key", ""]) == 2
    assert capsys.readouterr().err.startswith("error: --api-key is empty")


def test_engine_death_stops_the_server_with_exit_1(tiny_ckpt):
    srv = ServerProcess([str(tiny_ckpt), "--device", "cpu"], env=THREADS_1,
                        launcher=[sys.executable, "-c", FAILING_SERVE])
    srv.start()
    try:
        reply = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}, timeout=30)
        assert reply.status_code >= 500 and "error" in reply.json(), reply.text
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
        assert srv.wait(timeout=15) == 1, srv.output
    finally:
        srv.kill()
    assert "the engine failed (RuntimeError: injected forward failure)" in srv.output, srv.output


@pytest.mark.parametrize("value, message", [("{bad", "must be a JSON object"),
                                            ('{"retention": [1, 1, 0.5]}', "retention has 3 values")])
def test_a_bad_flashloop_group_is_one_error_line(tiny_ckpt, capsys, value, message):
    assert main(["generate", str(tiny_ckpt), "--prompt", "x", "--device", "cpu",
                 "--token-sparse-prefill", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_generate_with_token_sparse_prefill(tiny_ckpt, capsys):
    assert main(["generate", str(tiny_ckpt), "--prompt", "a long enough prompt for two windows", "--max-tokens", "3",
                 "--device", "cpu", "--token-sparse-prefill", '{"window": 4}']) == 0
