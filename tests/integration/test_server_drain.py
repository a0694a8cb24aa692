"""``specdec serve`` as a process: SIGTERM drains the requests in flight, then the process exits.

The streamed request that is running when the signal arrives gets its whole answer; a request
that arrives after it is refused (the socket is closed, or a 503 on an open connection); the
exit status is 0.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_in_flight_requests(stories_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec", "serve", str(stories_path), "--port", str(port), "--dtype", "float32",
         "--served-model-name", "stories", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 480, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            events.append(next(lines))
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            try:  # a new request while draining: refused
                late = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
                assert late.status_code == 503 and late.headers["retry-after"]
            except httpx.TransportError:
                pass
            events.extend(lines)
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == 480  # the whole answer
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
