"""What a head forward's weight stream costs in each format: the linear layers of an EAGLE-3
head (its layer and its own LM head) and of an MTP head shaped for a target, bf16 (packed)
against int8 and q4 (``quantization=`` on the head loaders), 1 and 3 rows.

Random weights (the cost does not depend on their values); the formats take turns, best of
``--repeats``, one process. Writes ``benchmarks/results/head-linears-*.json``.

    python -m benchmarks.head_linears [--target qwen2.5-coder-0.5b-instruct] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from benchmarks.common import machine_info, write_json


def _linears(head: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in head.modules() if hasattr(m, "in_features") and not list(m.children())]


def _head(target, kind: str, draft_vocab: int) -> torch.nn.Module:
    """A head of ``kind`` ("eagle3" or "mtp") for ``target``, random bf16 weights, packed."""
    from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind
    from specdec.models.mtp_head import MTPModule as MTPHeadModel
    from specdec.models.mtp_head import MTPModuleConfig as MTPHeadConfig
    from specdec.models.packed import pack_linears, should_pack

    cfg = target.config
    with torch.device("meta"):
        if kind == "eagle3":
            layers = (2, cfg.num_layers // 2, cfg.num_layers)
            config = EagleHeadConfig.for_target(cfg, EagleKind.EAGLE3, target_layers=layers, draft_vocab_size=draft_vocab)
            head = EagleHeadModel(target, config)
        else:
            head = MTPHeadModel(target, MTPHeadConfig.for_target(cfg))
    head = head.to_empty(device="cpu")
    for p in head.parameters():
        p.data.normal_(0, 0.02)
    head = head.to(torch.bfloat16).eval().requires_grad_(False)
    if should_pack(head):
        pack_linears(head)
    return head


def main(argv: list[str] | None = None) -> dict[str, object]:
    from specdec.hub import resolve_model
    from specdec.models.loading import load_model
    from specdec.models.quantized import quantize_linears

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="the EAGLE-3 head's LM head columns")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, _, _ = load_model(resolve_model(args.target), dtype="bfloat16")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for kind in ("eagle3", "mtp"):
        base = _head(target, kind, args.draft_vocab)
        heads = {
            "bf16": base,
            "int8": quantize_linears(copy.deepcopy(base), "int8"),
            "q4": quantize_linears(copy.deepcopy(base), "q4"),
        }
        for rows in (1, 3):
            best = dict.fromkeys(heads, float("inf"))
            for _ in range(args.repeats):
                for name, head in heads.items():  # formats take turns
                    mods = _linears(head)
                    xs = [torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in mods]
                    start = time.perf_counter()
                    for m, x in zip(mods, xs):
                        m(x)
                    best[name] = min(best[name], time.perf_counter() - start)
            for name, head in heads.items():
                nbytes = sum(t.numel() * t.element_size() for m in _linears(head) for t in (*m.buffers(), *m.parameters()))
                results.setdefault(kind, {}).setdefault(name, {})[f"rows{rows}_ms"] = round(1000 * best[name], 3)
                results[kind][name]["weight_mb"] = round(nbytes / 1e6, 2)
            print(f"{kind} rows={rows}: " + ", ".join(f"{n} {1000 * b:.2f} ms" for n, b in best.items()))
    payload = {"machine": machine_info(), "config": vars(args), "results": results}
    print(write_json("head-linears", payload))
    return payload


if __name__ == "__main__":
    main()
