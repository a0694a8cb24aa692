"""Acceptance of the two sampled verification rules side by side, same models, same prompts.

Seeded requests are verified by the coupled rule (their output is plain seeded decoding's,
token for token: specdec.noise); unseeded requests by rejection sampling (the rule that
accepts the most). This measures what reproducibility costs in acceptance, on stories260K
(float32) with its bundled MTP head and with a draft model (a noisy copy of the target).

    python -m benchmarks.seeded_acceptance   # writes benchmarks/results/seeded-acceptance-*.json
"""

from __future__ import annotations

import json

import torch

from benchmarks.common import machine_info, noisy_copy, write_json
from specdec import Generator, SamplingParams
from specdec.cli import bundled_model_path
from specdec.models.loading import load_model
from specdec.proposers import DraftModel, MTPHead

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They",
           "One day, a bird", "The sun was", "Tim had a red ball."]


def measure(gen: Generator, temperature: float, seeded: bool, repeats: int) -> dict:
    before = gen.metrics
    for r in range(repeats):
        params = [
            SamplingParams(max_new_tokens=64, temperature=temperature, ignore_eos=True,
                           seed=1000 * r + i if seeded else None)
            for i in range(len(PROMPTS))
        ]
        gen.generate(PROMPTS, params)
    after = gen.metrics
    drafted = after.num_drafted - before.num_drafted
    accepted = after.num_accepted - before.num_accepted
    steps = after.num_verify_steps - before.num_verify_steps
    emitted = after.num_emitted_in_verify - before.num_emitted_in_verify
    return {"drafted": drafted, "acceptance_rate": accepted / drafted,
            "mean_accepted_length": emitted / steps}


def main() -> None:
    torch.set_num_threads(1)
    path = bundled_model_path()
    target, _, _ = load_model(path, dtype="float32")
    plain = Generator.from_pretrained(path, dtype="float32")
    proposers = {
        "mtp-head-k3": lambda: MTPHead.from_pretrained(path.parent / "stories260K-mtp", num_speculative_tokens=3),
        "draft-model-k3": lambda: DraftModel.from_model(noisy_copy(target, 0.2, 3), num_speculative_tokens=3),
    }
    rows = []
    for name, make in proposers.items():
        gen = plain.with_proposer(make(), policy=3)
        for temperature in (0.7, 1.0):
            for seeded in (False, True):
                row = {"proposer": name, "temperature": temperature,
                       "rule": "coupled (seeded)" if seeded else "rejection (unseeded)",
                       **measure(gen, temperature, seeded, repeats=20)}
                rows.append(row)
                print(json.dumps(row))
    out = write_json("seeded-acceptance", {
        "machine": machine_info(), "model": "stories260K float32", "prompts": PROMPTS,
        "tokens_per_request": 64, "requests_per_cell": 20 * len(PROMPTS), "rows": rows,
    })
    print(out)


if __name__ == "__main__":
    main()
