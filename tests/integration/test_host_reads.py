"""How often a speculative step reads device tensors back to the host.

On a GPU every such read (``tolist``, ``item``, ``bool`` of a tensor) waits for the device:
a host sync. The CPU has none, so this counts the reads themselves, a proxy that
``benchmarks/gpu/check.py`` confirms with CUDA's sync debug mode on a GPU. Before
2026-12-02 an MTP step (k = 3, batch 2) made 10.5 reads and a draft-model step 8.2: one per
draft position, the drafts twice, the emitted tokens and kept rows apart. Now the drafts stay
on the device while drafting and come back once.
"""

from __future__ import annotations

import collections

import pytest
import torch

from specdec import Generator, SamplingParams
from specdec.proposers import DraftModel, MTPHead

READS = ("tolist", "item", "__bool__", "cpu", "__int__", "__float__", "__index__")


def _reads_per_step(spec: Generator, monkeypatch) -> float:
    counts = collections.Counter()
    for name in READS:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _r=real, _n=name, **k: counts.update([_n]) or _r(self, *a, **k))  # fmt: skip
    real_verify = spec.engine._verify
    steps = []
    monkeypatch.setattr(spec.engine, "_verify", lambda *a, **k: steps.append(1) or real_verify(*a, **k))
    spec.generate(["Once upon a time", "The little dog"], SamplingParams(max_new_tokens=24, ignore_eos=True))
    monkeypatch.undo()
    assert len(steps) >= 5
    return sum(counts.values()) / len(steps)


@pytest.mark.parametrize("proposer", ["mtp", "draft"])
def test_a_speculative_step_reads_the_device_at_most_five_times(stories_path, proposer, monkeypatch):
    gen = Generator.from_pretrained(stories_path, dtype="float32")
    if proposer == "mtp":
        prop = MTPHead.from_pretrained(stories_path.parent / "stories260K-mtp", num_speculative_tokens=3)
    else:
        prop = DraftModel.from_pretrained(stories_path, num_speculative_tokens=3, dtype="float32")
    spec = gen.with_proposer(prop, policy=3)
    spec.generate(["Once upon a time"], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm
    assert _reads_per_step(spec, monkeypatch) <= 5.0
