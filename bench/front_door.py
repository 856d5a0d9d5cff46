"""What one large or hostile request costs everyone else, against a real `specloop serve`.

A greedy stream runs in the background while the probe sends, one after another: a string
prompt just under the body limit (tokenized in the tokenizer pool, then refused for its
length), a body 5x over the limit (413 from Content-Length), the same without
Content-Length (413 while streaming the body), 100,000 stop strings, and the issue's
`top_k = 2^63`. For each probe it records its status, its latency, the longest gap between
two chunks of the background stream while it ran, and `/health`'s latency; at the end the
server's resident memory. The issue measured, before the front door: a 20 MB prompt
stalled other streams for 29 s and 50 MB raised resident memory by 10 GB.

    python bench/front_door.py --out bench/results/front_door_cpu.json [--model PATH] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server.testing import ServerProcess  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Stream(threading.Thread):
    """Back-to-back greedy streams; `gaps` holds (time, gap since the previous chunk)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.gaps = url, threading.Event(), []

    def run(self) -> None:
        body = {"prompt": "def fibonacci(n):", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                last = time.monotonic()
                with client.stream("POST", "/v1/completions", json=body) as response:
                    for _ in response.iter_lines():
                        now = time.monotonic()
                        self.gaps.append((now, now - last))
                        last = now

    def worst_gap(self, start: float, end: float) -> float:
        return max((g for t, g in self.gaps if start <= t <= end + 5.0 and t - g <= end), default=0.0)


def probes(limit: int) -> list[tuple[str, dict]]:
    def chunks(data: bytes):
        for i in range(0, len(data), 1 << 16):
            yield data[i:i + (1 << 16)]

    near = json.dumps({"prompt": "word " * ((limit - 64) // 5), "max_tokens": 1}).encode()
    over = json.dumps({"prompt": "x" * (5 * limit)}).encode()
    return [
        ("prompt just under the body limit", {"content": near}),
        ("body 5x over the limit", {"content": over}),
        ("body 5x over the limit, chunked", {"content": chunks(over)}),
        ("100,000 stop strings", {"json": {"prompt": "x", "stop": ["ab"] * 100_000}}),
        ("top_k = 2^63", {"json": {"prompt": "x", "temperature": 1, "top_k": 2**63}}),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the shipped model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    server_args = ([args.model] if args.model else []) + ["--device", args.device, "--log-level", "warning"]
    from server.app import DEFAULT_MAX_BODY_BYTES as limit

    with ServerProcess(server_args) as srv:
        stream = Stream(srv.url)
        stream.start()
        time.sleep(2.0)
        rss_before = rss_mib(srv.pid)
        rows = []
        for name, kwargs in probes(limit):
            start = time.monotonic()
            reply = httpx.post(srv.url + "/v1/completions", headers={"content-type": "application/json"},
                               timeout=300, **kwargs)
            end = time.monotonic()
            health_start = time.monotonic()
            health = httpx.get(srv.url + "/health", timeout=30).status_code
            rows.append({"probe": name, "status": reply.status_code, "latency_s": round(end - start, 3),
                         "health": health, "health_latency_s": round(time.monotonic() - health_start, 4),
                         "code": reply.json()["error"]["code"] if reply.status_code != 200 else None,
                         "param": reply.json()["error"]["param"] if reply.status_code != 200 else None})
            time.sleep(1.0)
            rows[-1]["worst_stream_gap_s"] = round(stream.worst_gap(start, end), 3)
            print(rows[-1], flush=True)
        stream.stop.set()
        stream.join(120)
        baseline = sorted(g for _, g in stream.gaps)
        record = {
            "command": "python " + " ".join(sys.argv),
            "server_args": server_args,
            "max_body_bytes": limit,
            "probes": rows,
            "stream_gap_p50_s": round(baseline[len(baseline) // 2], 4),
            "stream_gap_p99_s": round(baseline[int(len(baseline) * 0.99)], 4),
            "server_rss_mib_before": round(rss_before, 1),
            "server_rss_mib_after": round(rss_mib(srv.pid), 1),
        }
    print(json.dumps(record, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
