"""A real `specloop serve` process on 127.0.0.1, for tests and benchmarks.

    with ServerProcess(["--model", ckpt, "--device", "cpu"]) as srv:
        httpx.get(srv.url + "/health")
    assert srv.returncode == 0  # stopped with SIGINT

The server listens on an ephemeral port (`--port 0`); the start-up line says which.
`launcher` replaces `python -m server` (a `python -c` script that patches something and
then calls `server.cli.main(["serve", *sys.argv[1:]])`, say); stdin is /dev/null unless
`stdin` says otherwise.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

BANNER = re.compile(r"listening on (http://[0-9.]+:\d+)")
SERVE = [sys.executable, "-m", "server"]


class ServerProcess:
    def __init__(self, args: list[str], start_timeout: float = 120.0, env: dict[str, str] | None = None,
                 launcher: list[str] | None = None, stdin: int = subprocess.DEVNULL) -> None:
        self.args = ["--host", "127.0.0.1", "--port", "0", *args]
        self.start_timeout = start_timeout
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.launcher = launcher or SERVE
        self.stdin = stdin
        self.url = ""
        self.returncode: int | None = None
        self.lines: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._found = threading.Event()

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def start(self) -> "ServerProcess":
        self._proc = subprocess.Popen([*self.launcher, *self.args], stdin=self.stdin, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=self.env)
        threading.Thread(target=self._read, daemon=True).start()
        if not self._found.wait(self.start_timeout) or not self.url:
            self.kill()
            raise RuntimeError(f"the server did not start:\n{self.output}")
        self._wait_healthy()
        return self

    def send_signal(self, sig: int) -> None:
        assert self._proc is not None
        self._proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        """Signal the server and wait for it to exit; returns the exit status."""
        assert self._proc is not None
        if self._proc.poll() is None:
            self._proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float) -> int:
        """Wait for the server to exit on its own (no signal); returns the exit status."""
        assert self._proc is not None
        try:
            self.returncode = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.kill()  # it has exited: this only closes a stdin pipe
        return self.returncode

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin.close()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append(line)
            match = BANNER.search(line)
            if match and not self.url:
                self.url = match.group(1)
                self._found.set()
        self._found.set()  # the process ended (before or after the banner)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"the server never became healthy:\n{self.output}")
