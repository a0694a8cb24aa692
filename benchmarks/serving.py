"""Serving benchmark: ``specdec serve`` against llama.cpp's server on the Qwen pair, over HTTP.

Every system is a real server process on 127.0.0.1 with the same CPU threads, loaded from the
same Q4_K_M GGUF of Qwen2.5-Coder-1.5B-Instruct (DESIGN.md section 8):

- ``specdec-q4``: ``specdec serve FILE.gguf --quantization q4`` (the GGUF's 4-bit blocks kept),
  plain decoding, continuous batching;
- ``specdec-q4-draft``: the same with the 0.5B draft (4-bit, confidence-ended chains, k <= 6,
  the adaptive policy), the fastest batch-1 configuration of benchmarks/results/harness-quant-*;
- ``llamacpp``: ``python -m llama_cpp.server`` (llama-cpp-python, built with GGML_NATIVE=ON)
  on the same file: llama.cpp's kernels, one request at a time (its server has no batching;
  ``--interrupt_requests False``, or it cuts a streaming request short when another arrives).

For each concurrency level (1, 4, 16 clients; the order of systems rotates per level so the
drift of a shared machine hits all), the clients stream greedy completions of HumanEval
prompts through the official ``openai`` client, each taking the next prompt when its last one
ends. Reported per system and level: output tokens per second over the level's wall time, TTFT
p50/p99 (to the first streamed text), requests; the speculative server's outputs must equal
the plain one's (lossless), llama.cpp's agreement with them is recorded.

vLLM: tried when ``--vllm-python`` names an interpreter with vLLM's CPU build; see the JSON's
``vllm`` entry for why it is absent otherwise.

    python -m benchmarks.serving --gguf /tmp/qwen1.5b-q4km.gguf --llamacpp-python /tmp/llamacpp/venv/bin/python

Writes ``benchmarks/results/serving-<UTC stamp>.json`` (and ``-latest``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.common import humaneval_prompts, machine_info, write_json

SYSTEMS = ("specdec-q4", "specdec-q4-draft", "llamacpp")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(system: str, args, port: int) -> list[str]:
    threads = str(args.threads)
    if system.startswith("specdec"):
        cmd = [sys.executable, "-m", "specdec", "serve", args.gguf, "--quantization", "q4", "--threads", threads,
               "--port", str(port), "--served-model-name", "qwen", "--max-batch-size", str(max(args.concurrency)),
               "--log-level", "warning"]  # fmt: skip
        if system == "specdec-q4-draft":
            cmd += ["--draft", args.draft, "--draft-quantization", "q4", "--draft-confidence", "0.75", "-k", "6"]
        return cmd
    return [args.llamacpp_python, "-m", "llama_cpp.server", "--model", args.gguf, "--model_alias", "qwen",
            "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", "4096", "--host", "127.0.0.1",
            "--port", str(port), "--interrupt_requests", "False"]  # fmt: skip
    # (By default llama-cpp-python's server cuts a streaming request short when another one
    # arrives; off, it serves them in turn, every one to its end.)


class Server:
    """One server process; ``url`` once it answers."""

    def __init__(self, system: str, args) -> None:
        self.system = system
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        self.log = open(Path(args.log_dir) / f"{system}.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(_command(system, args, self.port), stdout=self.log, stderr=subprocess.STDOUT, env=env)
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{system} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - start > 900:
                raise RuntimeError(f"{system} did not start in 15 minutes")
            time.sleep(1)
        self.load_s = time.monotonic() - start

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


async def _stream(client, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    text = ""
    reason = None
    usage = None
    stream = await client.completions.create(model="qwen", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True})  # fmt: skip
    async for chunk in stream:
        if chunk.choices:
            if chunk.choices[0].text and first is None:
                first = time.perf_counter() - start
            text += chunk.choices[0].text or ""
            reason = chunk.choices[0].finish_reason or reason
        if getattr(chunk, "usage", None):
            usage = chunk.usage
    return {"ttft_s": first, "latency_s": time.perf_counter() - start, "text": text, "finish_reason": reason,
            "completion_tokens": usage.completion_tokens if usage else None}  # fmt: skip


async def _level(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3600)
    queue = list(enumerate(prompts))
    results: dict[int, dict] = {}

    async def worker():
        while queue:
            i, prompt = queue.pop(0)
            results[i] = await _stream(client, prompt, max_tokens)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    ordered = [results[i] for i in range(len(prompts))]
    cut = [r["finish_reason"] for r in ordered if r["finish_reason"] not in ("stop", "length")]
    assert not cut, f"requests that did not end normally: {cut}"
    ttfts = sorted(r["ttft_s"] for r in ordered if r["ttft_s"] is not None)
    tokens = count_tokens(ordered)
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "outputs": [r["text"] for r in ordered],
        "per_request": [{k: v for k, v in r.items() if k != "text"} for r in ordered],
    }


def count_tokens(results: list[dict]) -> int:
    """Output tokens of a level: the server's ``usage`` where it streams one (specdec), else
    the target tokenizer's count of the text (llama-cpp-python's server streams no usage)."""
    total = 0
    for r in results:
        if r["completion_tokens"] is None:
            r["completion_tokens"] = len(_tokenizer().encode(r["text"], add_special_tokens=False))
            r["tokens_counted_from_text"] = True
        total += r["completion_tokens"]
    return total


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer

    from specdec.hub import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("qwen2.5-coder-1.5b-instruct"))


def run(args) -> dict:
    prompts = humaneval_prompts()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for system in args.systems:  # all up at once: an idle server uses no CPU
            servers[system] = Server(system, args)
            print(f"{system}: up in {servers[system].load_s:.0f} s", flush=True)
        levels = []
        offset = 0
        for n, concurrency in enumerate(args.concurrency):
            count = max(args.min_requests, concurrency * args.rounds)
            level_prompts = prompts[offset : offset + count]
            offset += count
            order = list(args.systems[n % len(args.systems) :]) + list(args.systems[: n % len(args.systems)])
            row = {"concurrency": concurrency, "order": order, "systems": {}}
            for system in order:
                row["systems"][system] = asyncio.run(_level(servers[system].url, level_prompts, concurrency,
                                                            args.max_tokens))  # fmt: skip
                r = row["systems"][system]
                print(f"c={concurrency} {system}: {r['tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.2f} s "
                      f"p99 {r['ttft_p99_s']:.2f} s", flush=True)  # fmt: skip
            _compare(row)
            levels.append(row)
    finally:
        for server in servers.values():
            server.stop()
    return {
        "benchmark": "serving",
        "machine": machine_info(),
        "threads": args.threads,
        "gguf": Path(args.gguf).name,
        "draft": args.draft,
        "max_tokens": args.max_tokens,
        "systems": list(args.systems),
        "server_load_s": {s: servers[s].load_s for s in servers},
        "levels": levels,
        "vllm": args.vllm_note,
    }


def _compare(row: dict) -> None:
    """Lossless check (the speculative server equals the plain one) and llama.cpp's agreement."""
    systems = row["systems"]
    if "specdec-q4" in systems and "specdec-q4-draft" in systems:
        same = [a == b for a, b in zip(systems["specdec-q4"]["outputs"], systems["specdec-q4-draft"]["outputs"])]
        row["draft_outputs_equal_plain"] = all(same)
        assert all(same), f"c={row['concurrency']}: speculative outputs differ from plain ones: {same}"
    if "specdec-q4" in systems and "llamacpp" in systems:
        pairs = zip(systems["specdec-q4"]["outputs"], systems["llamacpp"]["outputs"])
        row["llamacpp_outputs_equal_specdec"] = sum(a == b for a, b in pairs) / len(systems["llamacpp"]["outputs"])
    base = systems.get("llamacpp")
    for r in systems.values():
        if base:
            r["throughput_vs_llamacpp"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["ttft_p50_vs_llamacpp"] = r["ttft_p50_s"] / base["ttft_p50_s"]


def table(result: dict) -> str:
    lines = ["| clients | system | tok/s | vs llama.cpp | TTFT p50 | TTFT p99 |", "|---:|---|---:|---:|---:|---:|"]
    for row in result["levels"]:
        for system in result["systems"]:
            r = row["systems"][system]
            ratio = r.get("throughput_vs_llamacpp")
            lines.append(f"| {row['concurrency']} | {system} | {r['tokens_per_s']:.1f} | "
                         f"{'-' if ratio is None else f'{ratio:.2f}x'} | {r['ttft_p50_s']:.2f} s | {r['ttft_p99_s']:.2f} s |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the target as a Q4_K_M GGUF file")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="draft model of specdec-q4-draft")
    ap.add_argument("--llamacpp-python", default=sys.executable, help="a Python with llama-cpp-python[server]")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=1, help="requests per client per level")
    ap.add_argument("--min-requests", type=int, default=4, help="requests per level at least")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-dir", default="/tmp/specdec-serving-logs")
    ap.add_argument("--vllm-note", default="not run", help="why vLLM's CPU build is not among the systems")
    ap.add_argument("--out", default="serving")
    args = ap.parse_args(argv)
    result = run(args)
    path = write_json(args.out, result)
    print(table(result))
    print(path)


if __name__ == "__main__":
    main()
