"""Chain verification: greedy identity and the lossless rejection-sampling rule.

Verify row ``j`` of a sequence's target rows is the target's prediction after draft token
``j - 1`` (row 0 follows the last emitted token), so a sequence with ``n`` drafts uses rows
``0 .. n``: rows ``0 .. n-1`` judge the drafts, row ``n`` gives the bonus token when all ``n``
are accepted.

The sampled rule (Leviathan et al. 2023; Chen et al. 2023) accepts draft ``x`` at row ``j``
with probability ``min(1, target_j(x) / draft_j(x))``; at the first rejection the recovered
token is drawn from ``normalize(max(target_j - draft_j, 0))``; after ``n`` acceptances the
bonus token is drawn from ``target_n``. Every emitted token is then distributed exactly as
if drawn from the target alone.

Seeded sampled requests use the coupled rule instead (:func:`coupled_verify`): each verify
row's token is the one plain decoding with that seed would choose at that position
(:mod:`specdec.noise`), and drafts are accepted while they equal those tokens. The output is
then the plain seeded output itself, whatever was drafted and whatever shared the batch.

Example:
    >>> num_accepted, emitted = greedy_verify(target_logits, draft_token_ids, (3, 0))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.config import SamplingParams
from specdec.noise import SeededNoise, race_sample
from specdec.sampling import (
    RowRandom,
    SamplingTensors,
    draw_uniforms,
    inverse_cdf,
    processed_probs,
)
from specdec.types import PAD_TOKEN_ID, DraftProposal, ProposalKind, VerifyResult
from specdec.verify.base import RuleVerifier
from specdec.verify.kernel_choice import seeded_keys, stream_seeds, tree_kernels, use_triton

__all__ = [
    "ChainVerifier",
    "acceptance_probability",
    "coupled_verify",
    "greedy_verify",
    "match_verify",
    "rejection_verify",
    "residual_distribution",
]


def _draft_counts(
    num_draft_tokens: Sequence[int] | torch.Tensor, batch: int, width: int
) -> tuple[int, ...]:
    counts = (
        tuple(num_draft_tokens.tolist())
        if isinstance(num_draft_tokens, torch.Tensor)
        else tuple(int(n) for n in num_draft_tokens)
    )
    if len(counts) != batch:
        raise ValueError(f"num_draft_tokens has {len(counts)} entries for a batch of {batch}")
    if any(n < 0 or n > width for n in counts):
        raise ValueError(f"num_draft_tokens must lie in 0..{width}, got {counts}")
    return counts


def _check_chain_shapes(target: torch.Tensor, draft_token_ids: torch.Tensor) -> None:
    if target.dim() != 3:
        raise ValueError(f"target must be [batch, width + 1, vocab], got {tuple(target.shape)}")
    if draft_token_ids.dim() != 2 or draft_token_ids.shape != (
        target.shape[0],
        target.shape[1] - 1,
    ):
        raise ValueError(
            f"draft_token_ids must be [batch, width] = {(target.shape[0], target.shape[1] - 1)}, "
            f"got {tuple(draft_token_ids.shape)}"
        )


def _prefix_length(
    accepted: torch.Tensor,  # [batch, width] bool
) -> torch.Tensor:  # [batch] int64
    """Length of the all-True prefix of each row: drafts after a rejection never count."""
    return torch.cumprod(accepted.to(torch.int64), dim=-1).sum(dim=-1)


def _emitted(
    draft_token_ids: torch.Tensor,  # [batch, width] int64
    num_accepted: torch.Tensor,  # [batch] int64
    final_token: torch.Tensor,  # [batch] int64, recovered or bonus
) -> torch.Tensor:  # [batch, width + 1] int64, PAD_TOKEN_ID padded
    """The accepted drafts followed by the final token, padded."""
    batch, width = draft_token_ids.shape
    positions = torch.arange(width + 1, device=draft_token_ids.device)  # [width + 1]
    pad = torch.full((batch, 1), PAD_TOKEN_ID, dtype=torch.int64, device=draft_token_ids.device)
    drafts = torch.cat([draft_token_ids.to(torch.int64), pad], dim=1)  # [batch, width + 1]
    emitted = torch.where(positions < num_accepted[:, None], drafts, PAD_TOKEN_ID)
    return emitted.scatter_(1, num_accepted[:, None], final_token[:, None])


def match_verify(
    target_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while they equal the target's own token for that row.

    Args:
        target_tokens: ``[batch, width + 1]`` int64, the token the target chooses at each
            verify row (its argmax, or its seeded draw).
        draft_token_ids: ``[batch, width]`` int64, ``PAD_TOKEN_ID`` past each sequence's drafts.
        num_draft_tokens: ``[batch]`` drafts per sequence, each in ``0 .. width``.

    Returns:
        ``num_accepted`` ``[batch]`` int64 and ``emitted`` ``[batch, width + 1]`` int64: the
        accepted drafts, then the target's token at the first mismatching row (recovered) or
        at row ``n`` (bonus), then ``PAD_TOKEN_ID``.
    """
    batch, width = draft_token_ids.shape
    if target_tokens.shape != (batch, width + 1):
        raise ValueError(
            f"target_tokens must be [batch, width + 1] = {(batch, width + 1)}, "
            f"got {tuple(target_tokens.shape)}"
        )
    counts = _draft_counts(num_draft_tokens, batch, width)
    device = target_tokens.device
    n = torch.tensor(counts, dtype=torch.int64, device=device)  # [batch]
    positions = torch.arange(width, device=device)  # [width]
    matches = (draft_token_ids == target_tokens[:, :width]) & (positions < n[:, None])
    num_accepted = _prefix_length(matches)  # [batch]
    final_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # [batch]
    return num_accepted, _emitted(draft_token_ids, num_accepted, final_token)


def greedy_verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts while they equal the target's argmax; no randomness.

    ``target_logits`` is ``[batch, width + 1, vocab]`` float, row ``j`` after draft ``j - 1``;
    the drafts, their counts and the result are as for :func:`match_verify`, which this is
    with the target's argmax as its token.

    Example:
        >>> logits = torch.full((1, 3, 4), -100.0); logits[0, [0, 1, 2], [2, 3, 1]] = 100.0
        >>> greedy_verify(logits, torch.tensor([[2, 0]]), (2,))
        (tensor([1]), tensor([[ 2,  3, -1]]))
    """
    _check_chain_shapes(target_logits, draft_token_ids)
    return match_verify(target_logits.argmax(dim=-1), draft_token_ids, num_draft_tokens)


def coupled_verify(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int] | torch.Tensor,
    noises: Sequence[SeededNoise],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded rule: accept drafts while they equal the seeded draw of each verify row.

    Row ``j`` of sequence ``i`` chooses ``race_sample`` of ``target_probs[i, j]`` with the
    noise at ``noises[i].position + j``, exactly the token plain decoding with that seed
    chooses there once the drafts before it are accepted. Every emitted token is therefore
    that plain token: the output has the target's distribution (each position's noise is
    fresh) and does not depend on the drafts, which only decide how many tokens one step
    emits. No draft probabilities are needed.

    Args:
        target_probs: ``[batch, width + 1, vocab]`` float, the target's processed distribution.
        draft_token_ids: ``[batch, width]`` int64, ``PAD_TOKEN_ID`` past each sequence's drafts.
        num_draft_tokens: ``[batch]`` drafts per sequence, each in ``0 .. width``.
        noises: one per sequence, at the position of its verify row 0's token.

    Returns:
        ``num_accepted`` and ``emitted`` as for :func:`match_verify`; a row whose distribution
        is not finite chooses ``-1``, which no draft matches.
    """
    _check_chain_shapes(target_probs, draft_token_ids)
    return match_verify(race_sample(target_probs, noises), draft_token_ids, num_draft_tokens)


def acceptance_probability(
    target_at_draft: torch.Tensor,  # [...] target probability of each draft token
    draft_at_draft: torch.Tensor,  # [...] draft probability of each draft token
) -> torch.Tensor:  # [...] in [0, 1]
    """``min(1, target / draft)``; 0 wherever the target gives the token no probability.

    A token the draft could not have drawn (``draft == 0``) is accepted if the target allows
    it; a token the target forbids is never accepted, whatever the draft said.
    """
    tiny = torch.finfo(draft_at_draft.dtype).tiny
    ratio = (target_at_draft / draft_at_draft.clamp_min(tiny)).clamp(max=1.0)
    return torch.where(target_at_draft > 0, ratio, 0.0)


def residual_distribution(
    target_row: torch.Tensor,  # [batch, vocab] float, target distribution
    draft_row: torch.Tensor,  # [batch, vocab] float, draft distribution (zeros: none)
) -> torch.Tensor:  # [batch, vocab] float, rows sum to 1
    """``normalize(max(target - draft, 0))``, falling back to ``target`` where that is all 0.

    Mathematically the residual of a rejection is never all zero (a rejection needs
    ``target(x) < draft(x)`` somewhere, hence ``target > draft`` somewhere else); the fallback
    covers round-off when target and draft agree to the last bit on the kept tokens. A zero
    ``draft_row`` returns ``target_row`` itself (the bonus case).
    """
    residual = (target_row - draft_row).clamp_min(0.0)  # [batch, vocab]
    total = residual.sum(dim=-1, keepdim=True)  # [batch, 1]
    degenerate = total <= 0
    return torch.where(degenerate, target_row, residual / torch.where(degenerate, 1.0, total))


def rejection_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int] | torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lossless speculative-sampling rule, vectorised over sequences and positions.

    Each sequence draws ``n + 1`` uniforms from its generator in one call: ``n`` for the
    acceptance tests, one for the recovered or bonus token (so a seed reproduces the step).

    Args:
        target_probs: ``[batch, width + 1, vocab]`` float, the target's processed distribution
            per verify row.
        draft_probs: ``[batch, width, vocab]`` float, the processed distribution each draft was
            drawn from; ``None`` for one-hot (deterministic) drafts, which are accepted with
            probability ``target_j(x)`` and leave ``target_j`` without ``x`` as the residual.
        draft_token_ids: ``[batch, width]`` int64, ``PAD_TOKEN_ID`` past each sequence's drafts.
        num_draft_tokens: ``[batch]`` drafts per sequence, each in ``0 .. width``.
        generators: one per sequence; ``None`` uses the default RNG.

    Returns:
        ``num_accepted`` ``[batch]`` int64 and ``emitted`` ``[batch, width + 1]`` int64
        (accepted drafts, recovered or bonus token, ``PAD_TOKEN_ID``).

    Example:
        >>> num_accepted, emitted = rejection_verify(target_probs, draft_probs, ids, (4, 2), gens)
    """
    _check_chain_shapes(target_probs, draft_token_ids)
    batch, width = draft_token_ids.shape
    if draft_probs is not None and draft_probs.shape != (batch, width, target_probs.shape[2]):
        raise ValueError(
            f"draft_probs must be [batch, width, vocab] = {(batch, width, target_probs.shape[2])}, "
            f"got {tuple(draft_probs.shape)}"
        )
    if len(generators) != batch:
        raise ValueError(f"got {len(generators)} generators for a batch of {batch}")
    counts = _draft_counts(num_draft_tokens, batch, width)
    device = target_probs.device
    n = torch.tensor(counts, dtype=torch.int64, device=device)  # [batch]
    rows = torch.arange(batch, device=device)  # [batch]
    positions = torch.arange(width, device=device)  # [width]
    is_draft = positions < n[:, None]  # [batch, width] bool

    # Uniforms come laid out per sequence as [test_0 .. test_{n-1}, final].
    uniforms = draw_uniforms(generators, [c + 1 for c in counts], device)  # [sum(n + 1)] float64
    is_final = torch.zeros(uniforms.shape[0], dtype=torch.bool, device=device)
    is_final[torch.cumsum(n + 1, dim=0) - 1] = True
    test_uniforms = torch.ones(batch, width, dtype=torch.float64, device=device)
    test_uniforms[is_draft] = uniforms[~is_final]  # row-major order matches the layout
    final_uniforms = uniforms[is_final]  # [batch]

    draft_ids = draft_token_ids.clamp_min(0)[..., None]  # [batch, width, 1], PAD -> 0 for gathers
    target_at_draft = target_probs[:, :width].gather(2, draft_ids).squeeze(2)  # [batch, width]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)  # [batch, width]
    else:
        draft_probs = draft_probs.to(target_probs.dtype)
        draft_at_draft = draft_probs.gather(2, draft_ids).squeeze(2)  # [batch, width]
    accept = test_uniforms < acceptance_probability(target_at_draft, draft_at_draft)
    num_accepted = _prefix_length(accept & is_draft)  # [batch]

    final_row = target_probs[rows, num_accepted]  # [batch, vocab]
    if width > 0:
        rejected = (num_accepted < n)[:, None]  # [batch, 1] bool; else the bonus row
        judged = num_accepted.clamp(max=width - 1)  # [batch], the rejecting row if any
        if draft_probs is None:
            draft_row = torch.zeros_like(final_row).scatter_(1, draft_ids[rows, judged], 1.0)
        else:
            draft_row = draft_probs[rows, judged]  # [batch, vocab]
        final_row = residual_distribution(final_row, torch.where(rejected, draft_row, 0.0))
    final_token = inverse_cdf(final_row, final_uniforms)  # [batch]
    return num_accepted, _emitted(draft_token_ids, num_accepted, final_token)


def _target_probs(
    target_logits: torch.Tensor,  # [rows, width + 1, vocab] float
    sampling: SamplingTensors,  # one row per sequence
) -> torch.Tensor:  # [rows, width + 1, vocab], the processed distribution of every verify row
    rows, width_1, vocab = target_logits.shape
    st = sampling.repeat_rows(width_1)
    return processed_probs(target_logits.reshape(-1, vocab), st).reshape(rows, width_1, vocab)


def split_by_rule(
    params: Sequence[SamplingParams], generators: Sequence[RowRandom]
) -> tuple[list[int], list[int], list[int]]:
    """Indices of the greedy, the seeded (coupled rule) and the streamed (rejection rule)
    sequences of a batch; chain and tree verifiers both split by it."""
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    seeded = [
        i for i, p in enumerate(params) if not p.is_greedy and isinstance(generators[i], SeededNoise)
    ]
    taken = set(greedy) | set(seeded)
    return greedy, seeded, [i for i in range(len(params)) if i not in taken]


def _row_index(rows: list[int], batch: int, device: torch.device) -> slice | torch.Tensor:
    """Index of ``rows`` in a batch: a plain slice (a view, no copy) when it is all of them."""
    if len(rows) == batch:
        return slice(None)
    return torch.tensor(rows, dtype=torch.int64, device=device)  # [len(rows)]


class ChainVerifier(RuleVerifier):
    """The default :class:`~specdec.interfaces.Verifier` for chain proposals.

    Greedy sequences (temperature 0) are verified by token identity (:func:`greedy_verify`),
    consuming no randomness, so speculative greedy output equals plain greedy output token for
    token. Seeded sampled sequences (a :class:`~specdec.noise.SeededNoise` as their generator)
    go through :func:`coupled_verify`, so their output equals plain seeded output token for
    token; other sampled sequences through :func:`rejection_verify`, the rule that accepts
    the most drafts. All kinds may share one batch.

    ``kernels`` chooses the implementation (:mod:`specdec.verify.kernel_choice`): ``"auto"``
    runs the Triton kernels on CUDA when Triton is installed, the torch functions above
    otherwise.

    Example:
        >>> result = ChainVerifier().verify(target_logits, proposal, params, generators)
        >>> result.num_accepted, result.emitted_token_ids
    """

    kind = ProposalKind.CHAIN

    def _counts(self, target_logits: torch.Tensor, proposal: DraftProposal) -> tuple[int, ...]:
        _check_chain_shapes(target_logits, proposal.draft_token_ids)
        return _draft_counts(proposal.num_draft_tokens, proposal.batch_size, proposal.width)

    def _verify(self, target_logits, proposal, params, generators, sampling, counts) -> VerifyResult:
        batch, width = proposal.batch_size, proposal.width
        device = target_logits.device
        num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)  # [batch]
        emitted = torch.full((batch, width + 1), PAD_TOKEN_ID, dtype=torch.int64, device=device)

        greedy, seeded, streamed = split_by_rule(params, generators)
        on_device = use_triton(self.kernels, device)
        if greedy:
            idx = _row_index(greedy, batch, device)
            verify = _triton_greedy_verify if on_device else greedy_verify
            num_accepted[idx], emitted[idx] = verify(
                target_logits[idx], proposal.draft_token_ids[idx], [counts[i] for i in greedy]
            )
        if seeded or streamed:
            sampling = sampling or SamplingTensors.from_params(params, device)
        if seeded:
            idx = _row_index(seeded, batch, device)
            args = (
                _target_probs(target_logits[idx], sampling.select_rows(seeded)),
                proposal.draft_token_ids[idx],
                [counts[i] for i in seeded],
                [generators[i] for i in seeded],
            )
            verify = _triton_coupled_verify if on_device else coupled_verify
            num_accepted[idx], emitted[idx] = verify(*args)
        if streamed:
            idx = _row_index(streamed, batch, device)
            draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[idx]
            args = (
                _target_probs(target_logits[idx], sampling.select_rows(streamed)),
                draft_probs,
                proposal.draft_token_ids[idx],
                [counts[i] for i in streamed],
                [generators[i] for i in streamed],
            )
            verify = _triton_rejection_verify if on_device else rejection_verify
            num_accepted[idx], emitted[idx] = verify(*args)

        rows = torch.arange(width + 1, device=device).expand(batch, width + 1)  # [batch, width + 1]
        accepted_rows = torch.where(rows <= num_accepted[:, None], rows, PAD_TOKEN_ID)
        return VerifyResult(
            num_accepted=tuple(num_accepted.tolist()),  # host copy: the engine commits by it
            emitted_token_ids=emitted,
            accepted_rows=accepted_rows,
        )


# --- the device path (Triton kernels; see specdec.verify.kernel_choice) --------------------


def _chain_args(drafts: torch.Tensor, counts: Sequence[int]):
    """The kernels' view of a chain batch: chain parents and the counts on the device."""
    batch, width = drafts.shape
    counts_t = torch.tensor(counts, dtype=torch.int64, device=drafts.device)  # [batch]
    return tree_kernels().chain_parents(batch, width, drafts.device), counts_t


def _triton_greedy_verify(target_logits, draft_token_ids, counts):
    """:func:`greedy_verify` in one launch (``kernels/triton/verify.py``)."""
    from specdec.kernels.triton.verify import greedy_chain_verify

    _, counts_t = _chain_args(draft_token_ids, counts)
    return greedy_chain_verify(target_logits, draft_token_ids, counts_t)


def _triton_coupled_verify(target_probs, draft_token_ids, counts, noises):
    """:func:`coupled_verify` on the device: the same tokens (the same noise, bit for bit)."""
    kernels = tree_kernels()
    parents, counts_t = _chain_args(draft_token_ids, counts)
    seeds, positions = seeded_keys(noises, target_probs.device)
    chosen = kernels.row_choices(target_probs, parents, counts_t, seeds, positions)
    accepted, emitted, _ = kernels.match_paths(chosen, draft_token_ids, parents, counts_t)
    return accepted, emitted


def _triton_rejection_verify(target_probs, draft_probs, draft_token_ids, counts, generators):
    """:func:`rejection_verify`'s rule on the device with counter-based uniforms (one seed per
    sequence from its generator). A chain is the tree whose nodes each have one child, where
    the tree's sibling rules are the chain rule (an all-zero ``draft_probs`` row, which no
    draft produces, is judged as a fixed choice there rather than accepted outright)."""
    kernels = tree_kernels()
    parents, counts_t = _chain_args(draft_token_ids, counts)
    device = target_probs.device
    seeds = stream_seeds(generators, device)
    offsets = torch.zeros_like(seeds)
    accepted, emitted, _ = kernels.rejection_paths(
        target_probs, draft_probs, draft_token_ids, parents, counts_t, seeds, offsets
    )
    return accepted, emitted
