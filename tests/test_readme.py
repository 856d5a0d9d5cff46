"""The README's commands, as written: the run block pasted on a machine without a GPU installs
torch's CPU build before the package (a plain `pip install -e .` pulls the CUDA build, about
3 GB of wheels), and on a machine with one leaves torch to `pip install -e .`; the smoke
command beside the full test command selects by the registered `slow` marker.

The run block runs under bash with every command it calls stubbed (python3, pip, specloop,
curl, and nvidia-smi where there is a GPU), each logging its arguments: what is checked is
the order of the installs and that the block ends.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
STUBS = {
    # `python3 -m venv DIR` makes DIR/bin/activate; nothing else is asked of it here
    "python3": 'echo "python3 $*" >> "$LOG"; [ "$1 $2" = "-m venv" ] && mkdir -p "$3/bin" && : > "$3/bin/activate"',
    "pip": 'echo "pip $*" >> "$LOG"',
    # ready (its /health answers) only once it would stop on SIGINT, as the real server
    "specloop": 'trap "exit 0" INT; echo "specloop $*" >> "$LOG"; : > "$LOG.up"; while :; do sleep 0.05; done',
    "curl": 'echo "curl $*" >> "$LOG"; [ "$1" != -sf ] || [ -e "$LOG.up" ]',
}


def readme_block(heading: str) -> str:
    """The first fenced bash block after the bold `heading` in the README."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"**{heading}**")
    return re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)


def run_block(tmp_path: Path, gpu: bool) -> list[str]:
    stubs, tools = tmp_path / "stubs", tmp_path / "tools"
    stubs.mkdir()
    tools.mkdir()
    for name, body in {**STUBS, **({"nvidia-smi": "exit 0"} if gpu else {})}.items():
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    for tool in ("sleep", "mkdir", "bash"):  # nothing else from the machine (no real nvidia-smi, pip, ...)
        (tools / tool).symlink_to(shutil.which(tool))
    log = tmp_path / "calls.log"
    env = {"PATH": f"{stubs}:{tools}", "LOG": str(log), "HOME": str(tmp_path)}
    # set -m: job control, as in the interactive shell the block is pasted into (SIGINT reaches `&` jobs).
    # SIGINT back to its default first: a shell cannot trap a signal it was started ignoring, which
    # it is when pytest itself runs as a background job of a non-interactive shell (nohup ... &).
    done = subprocess.run([shutil.which("bash"), "-c", "set -m\n" + readme_block("Run it")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines()


def test_run_block_installs_the_cpu_torch_first_without_a_gpu(tmp_path):
    calls = run_block(tmp_path, gpu=False)
    pips = [c for c in calls if c.startswith("pip ")]
    assert pips == [f"pip install torch --index-url {CPU_INDEX}", "pip install -e ."], calls
    assert calls[0] == "python3 -m venv .venv" and "specloop serve --port 8000" in calls
    assert calls.index("pip install -e .") < calls.index("specloop serve --port 8000")


def test_run_block_leaves_torch_to_the_package_with_a_gpu(tmp_path):
    calls = run_block(tmp_path, gpu=True)
    assert [c for c in calls if c.startswith("pip ")] == ["pip install -e ."], calls
    assert "specloop serve --port 8000" in calls and any(c.startswith("curl -N ") for c in calls)


def test_smoke_command_uses_the_registered_slow_marker():
    assert readme_block("Test it") == "pip install -e '.[test]' && python -m pytest -q -n auto\n"  # .ci/run's
    text = (ROOT / "README.md").read_text()
    smoke = text[text.index("**Test it**"):]
    assert 'python -m pytest -q -n auto -m "not slow"\n```' in smoke
    config = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'markers = \[\s*"slow:', config), "the slow marker is registered"


def test_every_slow_entry_names_an_existing_test_module():
    from tests.conftest import SLOW

    for entry in SLOW:
        assert (ROOT / entry.split("::")[0]).exists(), entry

