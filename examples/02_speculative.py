"""Speculative decoding on stories260K with a draft model and with prompt lookup.

    python examples/02_speculative.py

stories260K has no smaller sibling, so the draft here is a copy of the target with noise added
to its weights: it agrees with the target often but not always. It costs as much as the target,
so expect acceptance, not speed; a real draft is a smaller model of the same tokenizer
(``DraftModel.from_pretrained("path/to/draft")``).
"""

from __future__ import annotations

import copy

import torch

from specdec import Generator, SamplingParams
from specdec.cli import bundled_model_path
from specdec.proposers import DraftModel, PromptLookup

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park. They", "Mom said"]


def noisy_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """``model`` with Gaussian noise of ``scale`` times each weight's mean magnitude added."""
    noisy = copy.deepcopy(model)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=noise, dtype=p.dtype))
    return noisy


def report(name: str, gen: Generator) -> None:
    m = gen.metrics
    per_position = ", ".join(f"{a:.2f}" for a in m.per_position_acceptance)
    print(
        f"{name:14s} {m.num_generated_tokens} tokens in {m.num_target_forwards} batched target "
        f"forwards, {m.tokens_per_second:.0f} tokens/s"
    )
    if m.num_drafted:
        print(
            f"{'':14s} drafted {m.num_drafted}, accepted {m.num_accepted}: acceptance rate "
            f"{m.acceptance_rate:.2f}, mean accepted length {m.mean_accepted_length:.2f}, "
            f"per position [{per_position}]"
        )


def main() -> None:
    # float32: greedy exactness is checked below, and bf16 may flip near-ties between a
    # (k+1)-row verify pass and a 1-row decode pass.
    plain = Generator.from_pretrained(bundled_model_path(), dtype="float32")
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    baseline = plain.generate(PROMPTS, params)
    report("plain", plain)

    draft = DraftModel.from_model(noisy_copy(plain.target, 0.1, seed=0), num_speculative_tokens=4)
    for name, proposer in (("draft model", draft), ("prompt lookup", PromptLookup(4))):
        gen = Generator.from_components(
            plain.target, plain.tokenizer, proposer=proposer, eos_token_ids=plain.eos_token_ids
        )
        outs = gen.generate(PROMPTS, params)
        same = [o.token_ids for o in outs] == [o.token_ids for o in baseline]
        report(name, gen)
        print(f"{'':14s} identical to plain greedy: {same}")
        if not same:
            raise SystemExit(f"{name}: speculative greedy output differs from plain greedy output")

    print("\n" + PROMPTS[0] + baseline[0].text)


if __name__ == "__main__":
    main()
