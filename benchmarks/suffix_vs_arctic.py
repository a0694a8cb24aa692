"""Suffix decoding, specdec's against ArcticInference's, on the same token streams.

Replays the requests a ``benchmarks.suffix`` run saved (prompt ids and the target's greedy
output ids, in the order they ran) through both suffix indexes at the same speculation budget
(trees of at most 16 nodes, ``max_depth`` 24, ``spec_factor`` 1, ``spec_offset`` 0,
``min_token_prob`` 0.1; each keeps a global index of earlier responses). At each step of a
request both propose a tree from the same context; greedy verification keeps the longest path
that the target's actual output follows, plus the target's own token; the request advances by
that, both indexes see the same new tokens. No model runs: the target's tokens are the saved
ones, so the comparison is of proposals alone, step for step.

Reported per workload and system: accepted / drafted tokens (acceptance), tokens per target pass
(accepted + 1 per step), drafted tokens per step.

ArcticInference is the ``arctic-inference`` package (its ``arctic_inference.suffix_decoding``
module, a C++ extension); pass ``--arctic-path`` to a directory where it can be imported from.

    python -m benchmarks.suffix_vs_arctic --streams benchmarks/results/suffix-latest.json --arctic-path DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from benchmarks.common import machine_info, write_json

BUDGET = {"k": 16, "max_depth": 24, "spec_factor": 1.0, "spec_offset": 0.0, "min_token_prob": 0.1}


def accepted_len(tokens: list[int], parents: list[int], actual: list[int]) -> int:
    """Greedy verification of a tree: the longest root path whose tokens the target's output
    follows (``actual``: the tokens after the context)."""
    children: dict[int, list[int]] = defaultdict(list)
    for j, p in enumerate(parents):
        children[p].append(j)
    depth, node = 0, -1
    while depth < len(actual):
        nxt = next((j for j in children[node] if tokens[j] == actual[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


class SpecdecSuffix:
    """specdec's SuffixDecoding through its Proposer interface (one request at a time)."""

    name = "specdec"

    def __init__(self) -> None:
        from specdec.proposers import SuffixDecoding

        self.p = SuffixDecoding(num_speculative_tokens=BUDGET["k"], max_depth=BUDGET["max_depth"],
                                spec_factor=BUDGET["spec_factor"], spec_offset=BUDGET["spec_offset"],
                                min_token_prob=BUDGET["min_token_prob"])  # fmt: skip

    def start(self, rid: int, prompt: list[int]) -> None:
        self.p.on_request_start(rid, prompt)

    def propose(self, rid: int, context: list[int]) -> tuple[list[int], list[int]]:
        from specdec import SamplingParams
        from specdec.interfaces import ProposeContext

        ctx = ProposeContext(seq_ids=(rid,), token_ids=(context,), params=(SamplingParams(),), generators=(None,),
                             num_speculative_tokens=BUDGET["k"])  # fmt: skip
        out = self.p.propose(ctx)
        n = out.num_draft_tokens[0]
        return out.draft_token_ids[0, :n].tolist(), out.parents[0, :n].tolist()

    def extend(self, rid: int, new: list[int], context: list[int]) -> None:
        pass  # propose() brings the request's index up to the context it is given

    def stop(self, rid: int) -> None:
        from specdec.types import RequestEnd

        self.p.on_request_end(rid, RequestEnd.FINISHED)
        self.p.release(rid)


class ArcticSuffix:
    """ArcticInference's SuffixDecodingCache, driven as its vLLM integration drives it: the
    prompt starts the request, accepted tokens are added as they come, speculation gets the last
    ``max_depth`` tokens as context."""

    name = "arctic"

    def __init__(self) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=BUDGET["max_depth"], max_cached_requests=100_000)

    def start(self, rid: int, prompt: list[int]) -> None:
        self.cache.start_request(rid, prompt)

    def propose(self, rid: int, context: list[int]) -> tuple[list[int], list[int]]:
        draft = self.cache.speculate(rid, context[-BUDGET["max_depth"] :], max_spec_tokens=BUDGET["k"],
                                     max_spec_factor=BUDGET["spec_factor"], max_spec_offset=BUDGET["spec_offset"],
                                     min_token_prob=BUDGET["min_token_prob"], use_tree_spec=True)  # fmt: skip
        return list(draft.token_ids), list(draft.parents)

    def extend(self, rid: int, new: list[int], context: list[int]) -> None:
        self.cache.add_active_response(rid, new)

    def stop(self, rid: int) -> None:
        self.cache.stop_request(rid)


def replay(system, requests: list[dict]) -> dict:
    """Every request in order through ``system``; totals per workload."""
    totals: dict[str, dict[str, int]] = defaultdict(lambda: {"steps": 0, "drafted": 0, "accepted": 0, "tokens": 0})
    for rid, req in enumerate(requests):
        prompt, output = req["prompt_ids"], req["output_ids"]
        system.start(rid, prompt)
        pos = 0
        t = totals[req["workload"]]
        while pos < len(output):
            context = prompt + output[:pos]
            tokens, parents = system.propose(rid, context)
            accepted = accepted_len(tokens, parents, output[pos:])
            step = min(accepted + 1, len(output) - pos)
            t["steps"] += 1
            t["drafted"] += len(tokens)
            t["accepted"] += min(accepted, step)
            t["tokens"] += step
            system.extend(rid, output[pos : pos + step], context)
            pos += step
        system.stop(rid)
    return {w: t | {"acceptance": t["accepted"] / t["drafted"] if t["drafted"] else 0.0,
                    "tokens_per_step": t["tokens"] / t["steps"], "drafted_per_step": t["drafted"] / t["steps"]}
            for w, t in totals.items()}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="benchmarks/results/suffix-latest.json")
    ap.add_argument("--arctic-path", default=None, help="directory to import arctic_inference from")
    ap.add_argument("--arctic-note", default="", help="how arctic-inference was installed")
    ap.add_argument("--out", default="suffix-vs-arctic")
    args = ap.parse_args(argv)
    if args.arctic_path:
        sys.path.insert(0, args.arctic_path)
    streams = json.load(open(args.streams))
    requests = streams["requests"]
    results = {s.name: replay(s, requests) for s in (SpecdecSuffix(), ArcticSuffix())}
    payload = {"benchmark": "suffix-vs-arctic", "machine": machine_info(), "streams": args.streams,
               "num_requests": len(requests), "budget": BUDGET, "arctic": args.arctic_note, "results": results}  # fmt: skip
    path = write_json(args.out, payload)
    print("| workload | system | acceptance | tokens / target pass | drafted / step |")
    print("|---|---|---:|---:|---:|")
    for workload in results["specdec"]:
        for name, r in results.items():
            w = r[workload]
            print(f"| {workload} | {name} | {w['acceptance']:.3f} | {w['tokens_per_step']:.2f} | {w['drafted_per_step']:.2f} |")
    print(path)


if __name__ == "__main__":
    main()
