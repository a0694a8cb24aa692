"""The oracle proposers of benchmarks/oracle.py (the GPU check's controlled-acceptance
speculation) accept at the rate their formula says."""

from __future__ import annotations

import pytest
import torch

from benchmarks.oracle import OracleChain, OracleTree, expected_emitted
from specdec.config import SamplingParams
from specdec.interfaces import ProposeContext
from specdec.verify.tree import tree_match_verify

TRUTH = list(range(1, 400))  # the "target's greedy continuation": the next integer


def _mean_emitted(proposer, width: int, runs: int = 3000) -> float:
    history = TRUTH[:10]
    ctx = ProposeContext(
        seq_ids=tuple(range(runs)), token_ids=(history,) * runs,
        params=(SamplingParams(),) * runs, generators=(None,) * runs, num_speculative_tokens=width,
    )  # fmt: skip
    proposal = proposer.propose(ctx)
    parents = proposal.parents
    if parents is None:  # a chain
        parents = (torch.arange(width) - 1).expand(runs, width)
    # Row r's choice (the target's greedy token there) is the truth at its depth.
    depth = torch.zeros(runs, width + 1, dtype=torch.int64)
    for j in range(width):
        depth[:, j + 1] = depth.gather(1, (parents[:, j : j + 1] + 1)).squeeze(1) + 1
    chosen = torch.tensor(TRUTH[10:])[depth]
    accepted, _, _ = tree_match_verify(chosen, proposal.draft_token_ids, parents, proposal.num_draft_tokens)
    return float(accepted.double().mean()) + 1


@pytest.mark.parametrize("alpha", [0.6, 0.9])
def test_oracle_acceptance_matches_its_formula(alpha):
    chain = OracleChain([TRUTH], alpha, 5, vocab=1000, seed=1)
    assert abs(_mean_emitted(chain, 5) - expected_emitted(alpha, 5)) < 0.1
    tree = OracleTree([TRUTH], alpha, 8, vocab=1000, seed=1)
    assert abs(_mean_emitted(tree, 16) - expected_emitted(alpha, 16, tree_levels=8)) < 0.12
