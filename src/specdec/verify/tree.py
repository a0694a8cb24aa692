"""Tree verification: greedy and seeded matching, and the lossless multi-draft rejection rule.

A tree proposal drafts several continuations at once. ``parents[i, j]`` is the index of draft
node ``j``'s parent among the drafts, ``-1`` for children of the root (the last emitted
token), and parents come before children. Verify row 0 is the target's prediction after the
root and row ``j + 1`` its prediction after the path root .. node ``j``, so a sequence with
``n`` nodes uses rows ``0 .. n``. A step keeps one root-to-node path and emits its tokens
followed by one recovered or bonus token, as a chain step does.

Greedy sequences follow the child equal to the target's argmax (:func:`tree_greedy_verify`)
and seeded ones the child equal to their seeded draw at that depth
(:func:`tree_coupled_verify`): both emit exactly what plain decoding emits. Other sampled
sequences use recursive rejection sampling over each node's siblings
(:func:`tree_rejection_verify`; SpecInfer, Miao et al. 2023; Sequoia, Chen et al. 2024). At a
node whose children carry ``x_1 .. x_m`` the target's distribution ``r_1 = p`` is offered to
each child in turn; after a rejection it shrinks to the residual ``r_{j+1}``; after ``m``
rejections the recovered token is drawn from ``r_{m+1}``, and after an acceptance the walk
goes on at that child with a fresh ``p``. Every emitted token is then distributed as the
target alone would draw it. Two sibling rules, chosen by whether the proposal has
``draft_probs``:

- deterministic siblings (``None``, e.g. the draft's top-k): accept ``x_j`` with ``r_j(x_j)``;
  ``r_{j+1}`` is ``r_j`` without ``x_j``, renormalised (:func:`sibling_step_deterministic`);
- siblings drawn without replacement from the draft's ``q``: accept ``x_j`` with
  ``min(1, r_j(x_j) / q_j(x_j))``; ``r_{j+1} = normalize(max(r_j - q_j, 0))`` and ``q_{j+1}``
  is ``q_j`` without ``x_j``, renormalised (:func:`sibling_step_without_replacement`).

With one child per node both are exactly the chain rule of
:func:`~specdec.verify.chain.rejection_verify`, uniform for uniform.

Example:
    >>> result = TreeVerifier().verify(target_logits, tree_proposal, params, generators)
    >>> result.emitted_token_ids, result.accepted_rows  # the kept path's tokens and rows
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.noise import SeededNoise, race_sample
from specdec.sampling import SamplingTensors, draw_uniforms, inverse_cdf
from specdec.types import PAD_TOKEN_ID, DraftProposal, ProposalKind, VerifyResult
from specdec.verify.base import RuleVerifier
from specdec.verify.chain import (
    _draft_counts,
    _row_index,
    _target_probs,
    acceptance_probability,
    residual_distribution,
    split_by_rule,
)
from specdec.verify.kernel_choice import seeded_keys, stream_seeds, tree_kernels, use_triton
from specdec.verify.tree_layout import check_parents, tree_depths

__all__ = [
    "TreeVerifier",
    "children_of",
    "sibling_step_deterministic",
    "sibling_step_without_replacement",
    "tree_coupled_verify",
    "tree_greedy_verify",
    "tree_match_verify",
    "tree_rejection_path",
    "tree_rejection_verify",
]

F64 = torch.float64

# num_accepted [batch] int64, emitted [batch, width + 1] int64, accepted_rows [batch, width + 1]
# int64 (both PAD_TOKEN_ID padded): what every batched function here returns.
TreeResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# --- tree structure -------------------------------------------------------------------------


def children_of(parents: Sequence[int], num_nodes: int) -> list[list[int]]:
    """The children of every verify row, in node order.

    Args:
        parents: at least ``num_nodes`` entries; ``parents[j]`` is node ``j``'s parent node,
            ``-1`` for the root's children. Entries past ``num_nodes`` are ignored (padding).
        num_nodes: the sequence's number of draft nodes ``n``.

    Returns:
        ``n + 1`` lists: entry ``r`` holds the nodes whose parent is row ``r`` (row 0 is the
        root, row ``j + 1`` node ``j``).

    Example:
        >>> children_of([-1, -1, 0, 2], 4)
        [[0, 1], [2], [], [3], []]
    """
    check_parents(parents, num_nodes)
    children: list[list[int]] = [[] for _ in range(num_nodes + 1)]
    for j in range(num_nodes):
        children[int(parents[j]) + 1].append(j)
    return children


# --- greedy and seeded: follow the target's own token ----------------------------------------


def _longest_match(
    children: list[list[int]], tokens: Sequence[int], chosen: Sequence[int]
) -> list[int]:
    """The nodes of the longest path whose every node carries the token its parent row chose.

    Duplicate siblings (several children with the chosen token) are resolved by the length of
    the path below them, the lowest index on ties, so a duplicate never costs accepted tokens.
    """
    length = [0] * len(children)  # [n + 1] longest matching path below each row
    best = [-1] * len(children)  # [n + 1] the child that starts it
    # Children come after their parents, so walking rows backwards sees every child row first.
    for row in reversed(range(len(children))):
        for child in children[row]:
            if (
                chosen[row] >= 0
                and tokens[child] == chosen[row]
                and length[child + 1] + 1 > length[row]
            ):
                length[row], best[row] = length[child + 1] + 1, child
    path, row = [], 0
    while best[row] >= 0:
        path.append(best[row])
        row = best[row] + 1
    return path


def _pack(
    paths: Sequence[tuple[Sequence[int], int]],  # per sequence: accepted nodes, final token
    tokens: Sequence[Sequence[int]],  # per sequence: its draft tokens
    width: int,
    device: torch.device,
) -> TreeResult:
    """Kept paths -> (num_accepted, emitted, accepted_rows) tensors, PAD_TOKEN_ID padded."""
    emitted = [[tokens[i][j] for j in nodes] + [final] for i, (nodes, final) in enumerate(paths)]
    rows = [[0] + [j + 1 for j in nodes] for nodes, _ in paths]
    pad = [PAD_TOKEN_ID] * (width + 1)
    return (
        torch.tensor([len(nodes) for nodes, _ in paths], dtype=torch.int64, device=device),
        torch.tensor([e + pad[len(e) :] for e in emitted], dtype=torch.int64, device=device),
        torch.tensor([r + pad[len(r) :] for r in rows], dtype=torch.int64, device=device),
    )


def _check_tree(
    target: torch.Tensor,  # [batch, width + 1, ...]
    draft_token_ids: torch.Tensor,  # [batch, width]
    parents: torch.Tensor | None,  # [batch, width]
    num_draft_tokens: Sequence[int] | torch.Tensor,
) -> tuple[tuple[int, ...], list[list[int]], list[list[int]]]:
    """Validate a tree batch; return counts and host copies of the tokens and parents."""
    if target.dim() < 2:
        raise ValueError(f"target must be [batch, width + 1, ...], got {tuple(target.shape)}")
    batch, width = target.shape[0], target.shape[1] - 1
    if draft_token_ids.shape != (batch, width):
        raise ValueError(
            f"draft_token_ids must be [batch, width] = {(batch, width)}, "
            f"got {tuple(draft_token_ids.shape)}"
        )
    if parents is None or parents.shape != (batch, width):
        shape = None if parents is None else tuple(parents.shape)
        raise ValueError(f"parents must be [batch, width] = {(batch, width)}, got {shape}")
    counts = _draft_counts(num_draft_tokens, batch, width)
    # Host copies for the walks, in one device-to-host copy.
    ids = draft_token_ids.to(torch.int64)
    tokens, parent_rows = torch.stack([ids, parents.to(ids.device, torch.int64)]).tolist()
    for count, row in zip(counts, parent_rows):
        children_of(row, count)  # raises on a bad parent before any work
    vocab = target.shape[2] if target.dim() == 3 else None
    for i, (count, row) in enumerate(zip(counts, tokens)):
        if any(t < 0 or (vocab is not None and t >= vocab) for t in row[:count]):
            raise ValueError(
                f"draft_token_ids[{i}, :{count}] must lie in 0 .. vocab - 1, got {row[:count]}"
            )
    return counts, tokens, parent_rows


def tree_match_verify(
    target_tokens: torch.Tensor,
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    num_draft_tokens: Sequence[int] | torch.Tensor,
) -> TreeResult:
    """Keep the longest path whose nodes equal the target's own token at their parent row.

    Args:
        target_tokens: ``[batch, width + 1]`` int64, the token the target chooses at each verify
            row (its argmax, or its seeded draw); ``-1`` matches nothing.
        draft_token_ids: ``[batch, width]`` int64, ``PAD_TOKEN_ID`` past each sequence's nodes.
        parents: ``[batch, width]`` int64, each node's parent node, ``-1`` for the root's.
        num_draft_tokens: ``[batch]`` nodes per sequence, each in ``0 .. width``.

    Returns:
        ``num_accepted`` ``[batch]`` int64; ``emitted`` ``[batch, width + 1]`` int64 (the path's
        tokens, then the target's token at the path's last row); ``accepted_rows``
        ``[batch, width + 1]`` int64 (row 0, then the path's rows); both ``PAD_TOKEN_ID`` padded.

    Example:
        >>> tree_match_verify(torch.tensor([[5, 9, 7, 8]]), torch.tensor([[4, 5, 7]]),
        ...                   torch.tensor([[-1, -1, 1]]), (3,))
        (tensor([2]), tensor([[ 5,  7,  8, -1]]), tensor([[ 0,  2,  3, -1]]))
    """
    checked = _check_tree(target_tokens, draft_token_ids, parents, num_draft_tokens)
    return _match(target_tokens, *checked)


def _match(
    target_tokens: torch.Tensor,  # [batch, width + 1] int64
    counts: Sequence[int],
    tokens: list[list[int]],  # [batch][width] host copy of the drafts
    parent_rows: list[list[int]],  # [batch][width] host copy of the parents
) -> TreeResult:
    chosen = target_tokens.tolist()  # host copy: one sync for the whole batch
    paths = []
    for i, n in enumerate(counts):
        nodes = _longest_match(children_of(parent_rows[i], n), tokens[i], chosen[i])
        paths.append((nodes, chosen[i][nodes[-1] + 1 if nodes else 0]))
    return _pack(paths, tokens, target_tokens.shape[1] - 1, target_tokens.device)


def tree_greedy_verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    num_draft_tokens: Sequence[int] | torch.Tensor,
) -> TreeResult:
    """Keep the longest path of argmax tokens; no randomness. A chain-shaped tree
    (``parents = [-1, 0, 1, ...]``) gives exactly :func:`~specdec.verify.chain.greedy_verify`.

    Args:
        target_logits: ``[batch, width + 1, vocab]`` float, row ``j + 1`` after node ``j``.
        draft_token_ids, parents, num_draft_tokens: as for :func:`tree_match_verify`.

    Returns:
        As :func:`tree_match_verify`.
    """
    if target_logits.dim() != 3:
        raise ValueError(
            f"target_logits must be [batch, width + 1, vocab], got {tuple(target_logits.shape)}"
        )
    return tree_match_verify(
        target_logits.argmax(dim=-1), draft_token_ids, parents, num_draft_tokens
    )


def tree_coupled_verify(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    num_draft_tokens: Sequence[int] | torch.Tensor,
    noises: Sequence[SeededNoise],
) -> TreeResult:
    """The seeded rule: keep the longest path of the seeded draws of its rows.

    Row ``r`` chooses ``race_sample`` of ``target_probs[i, r]`` with the noise at
    ``noises[i].position + depth(r)``: every row at one depth stands for the same output
    position, and the noise there is what plain seeded decoding uses, so the emitted tokens
    are exactly the plain seeded tokens (see :func:`~specdec.verify.chain.coupled_verify`).

    Args:
        target_probs: ``[batch, width + 1, vocab]`` float, the target's processed distribution.
        draft_token_ids, parents, num_draft_tokens: as for :func:`tree_match_verify`.
        noises: one per sequence, at the position of its root row's token.

    Returns:
        As :func:`tree_match_verify`.
    """
    counts, tokens, parent_rows = _check_tree(
        target_probs, draft_token_ids, parents, num_draft_tokens
    )
    if len(noises) != len(counts):
        raise ValueError(f"got {len(noises)} noises for a batch of {len(counts)}")
    batch, width_1, vocab = target_probs.shape
    # Only real rows are drawn (rows past n are padding); each with its depth's noise.
    flat, row_noises = [], []
    for i, n in enumerate(counts):
        for row, depth in enumerate(tree_depths(parent_rows[i], n)):
            flat.append(i * width_1 + row)
            row_noises.append(noises[i].shifted(depth))
    index = torch.tensor(flat, dtype=torch.int64, device=target_probs.device)  # [sum(n + 1)]
    chosen = torch.full((batch * width_1,), -1, dtype=torch.int64, device=target_probs.device)
    chosen[index] = race_sample(target_probs.reshape(-1, vocab)[index], row_noises)
    return _match(chosen.view(batch, width_1), counts, tokens, parent_rows)


# --- sampled: recursive rejection over siblings ---------------------------------------------


def _point(token: int, like: torch.Tensor) -> torch.Tensor:
    """``[vocab]`` one-hot at ``token``: the "draft distribution" of a chosen (not drawn) token."""
    point = torch.zeros_like(like)  # [vocab]
    point[token] = 1.0
    return point


def _judge(
    r: torch.Tensor,  # [vocab] float64, the distribution offered to this sibling
    q: torch.Tensor,  # [vocab] float64, the distribution the sibling was drawn from
    token: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # [] acceptance probability, [vocab] residual
    """One sibling's test, the chain rule's own functions: ``min(1, r/q)`` and the residual."""
    alpha = acceptance_probability(r[token], q[token])
    return alpha, residual_distribution(r[None], q[None])[0]


def _stack(
    accept: list[torch.Tensor], residuals: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    first = residuals[0]
    alphas = torch.stack(accept) if accept else first.new_zeros(0)  # [m]
    return alphas, torch.stack(residuals)  # [m + 1, vocab]


def sibling_step_deterministic(
    p: torch.Tensor, tokens: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One node's siblings as fixed choices (no ``draft_probs``): the rule for top-k children.

    Sibling ``j`` is accepted with ``r_j(x_j)`` and, on rejection, ``r_{j+1}`` is ``r_j`` with
    ``x_j`` zeroed and renormalised: the target's draw, conditioned on not being ``x_j``. A
    duplicate sibling therefore has probability 0. This is lossless however the siblings were
    chosen, since it uses no draft distribution at all.

    Args:
        p: ``[vocab]`` float64, the target's processed distribution at the node's row.
        tokens: the ``m`` children's tokens, in node order.

    Returns:
        ``accept`` ``[m]``: sibling ``j``'s acceptance probability once ``1 .. j-1`` were
        rejected; ``residuals`` ``[m + 1, vocab]``: ``r_1 = p, r_2, ..., r_{m+1}``, the last being
        the distribution of the recovered token (of the bonus token when ``m == 0``).

    Example:
        >>> accept, residuals = sibling_step_deterministic(torch.tensor([0.5, 0.25, 0.25]), [0, 1])
        >>> accept.tolist(), residuals[-1].tolist()
        ([0.5, 0.5], [0.0, 0.0, 1.0])
    """
    accept, residuals = [], [p]
    for token in tokens:
        alpha, residual = _judge(residuals[-1], _point(token, p), token)
        accept.append(alpha)
        residuals.append(residual)
    return _stack(accept, residuals)


def _without(q: torch.Tensor, token: int) -> torch.Tensor:
    """``[vocab]`` ``q`` with ``token`` removed and renormalised; all zero when nothing is left.

    Dividing by the remaining sum rather than ``1 - q(token)`` is the same for a normalised
    ``q`` and stays exact when the draft's float32 row sums to 1 only within round-off.
    """
    kept = q.clone()  # [vocab]
    kept[token] = 0.0
    total = kept.sum()
    return torch.where(total > 0, kept / torch.where(total > 0, total, 1.0), 0.0)


def sibling_step_without_replacement(
    p: torch.Tensor, q: torch.Tensor, tokens: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One node's siblings drawn without replacement from the draft's ``q`` (Sequoia's rule).

    With ``q_1 = q`` and ``r_1 = p``, sibling ``j`` is accepted with
    ``min(1, r_j(x_j) / q_j(x_j))``; on rejection ``r_{j+1} = normalize(max(r_j - q_j, 0))``
    and ``q_{j+1}`` is ``q_j`` without ``x_j`` (the law of the next sibling given this one).
    Degenerate cases keep the step lossless or follow the chain rule:

    - ``q_j(x_j) == 0`` (the draft could not have drawn it): accepted when ``r_j`` allows it,
      as :func:`~specdec.verify.chain.acceptance_probability` does;
    - ``q_j`` with no mass left (``q`` was one-hot, or all zero): the sibling cannot have been
      drawn from it, so it is judged as a fixed choice (:func:`sibling_step_deterministic`);
    - a residual all zero from round-off falls back to ``r_j``
      (:func:`~specdec.verify.chain.residual_distribution`).

    Args:
        p: ``[vocab]`` float64, the target's processed distribution at the node's row.
        q: ``[vocab]`` float64, the draft's processed distribution the siblings were drawn from.
        tokens: the ``m`` children's tokens, in the order they were drawn (node order).

    Returns:
        As :func:`sibling_step_deterministic`.

    Example:
        >>> p, q = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, 0.5, 0.5])
        >>> accept, residuals = sibling_step_without_replacement(p, q, [2, 1])
        >>> accept.tolist(), residuals[-1].tolist()
        ([0.0, 0.0], [1.0, 0.0, 0.0])
    """
    accept, residuals = [], [p]
    for token in tokens:
        drawn_from = torch.where(q.sum() > 0, q, _point(token, q))  # [vocab], no host sync
        alpha, residual = _judge(residuals[-1], drawn_from, token)
        accept.append(alpha)
        residuals.append(residual)
        q = _without(drawn_from, token)
    return _stack(accept, residuals)


def tree_rejection_path(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    tokens: Sequence[int],
    parents: Sequence[int],
    uniforms: torch.Tensor,
) -> tuple[list[int], int]:
    """Walk one sequence's tree with given uniforms: the kept path and the final token.

    Node ``j`` is tested with ``uniforms[j]`` (accepted when ``u < accept``; each node is
    tested at most once) and the recovered or bonus token is drawn by inverse CDF with
    ``uniforms[n]``, the chain's layout.

    Args:
        target_probs: ``[n + 1, vocab]`` float, the target's processed distribution per row.
        draft_probs: ``[n, vocab]`` float, row ``j`` the draft distribution node ``j``'s sibling
            group was drawn from (the group's first node's row is used); ``None`` for fixed
            siblings.
        tokens: ``n`` draft tokens; parents: ``n`` parent nodes (``-1`` for the root's).
        uniforms: ``[n + 1]`` float64 in [0, 1).

    Returns:
        The accepted nodes, the root's child first, and the final token (``-1`` when the final
        row is no distribution).
    """
    n = len(tokens)
    if uniforms.shape != (n + 1,):
        raise ValueError(f"uniforms must be [n + 1] = [{n + 1}], got {tuple(uniforms.shape)}")
    children = children_of(parents, n)
    tests = uniforms.tolist()  # host copy: each test is one comparison on the host
    path, row = [], 0
    while True:
        kids = children[row]
        p = target_probs[row].to(F64)  # [vocab]
        if draft_probs is None or not kids:
            accept, residuals = sibling_step_deterministic(p, [tokens[c] for c in kids])
        else:
            q = draft_probs[kids[0]].to(F64)  # [vocab], shared by the whole sibling group
            accept, residuals = sibling_step_without_replacement(p, q, [tokens[c] for c in kids])
        alphas = accept.tolist() if kids else []  # host sync, once per tree level
        chosen = next((c for c, a in zip(kids, alphas) if tests[c] < a), None)
        if chosen is None:
            final = inverse_cdf(residuals[-1:], uniforms[n:].to(residuals.device))
            return path, int(final.item())
        path.append(chosen)
        row = chosen + 1


def tree_rejection_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    num_draft_tokens: Sequence[int] | torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> TreeResult:
    """The lossless multi-draft rule over a batch of trees.

    Each sequence draws ``n + 1`` uniforms from its generator in one call, whatever path it
    takes (so a seed reproduces the step): node ``j`` uses uniform ``j``, the final token
    uniform ``n`` (:func:`tree_rejection_path`).

    Args:
        target_probs: ``[batch, width + 1, vocab]`` float, the target's processed distribution.
        draft_probs: ``[batch, width, vocab]`` float, ``draft_probs[i, j]`` the distribution
            node ``j`` and its siblings were drawn from without replacement; ``None`` for fixed
            siblings.
        draft_token_ids, parents, num_draft_tokens: as for :func:`tree_match_verify`.
        generators: one per sequence; ``None`` uses the default RNG.

    Returns:
        As :func:`tree_match_verify`.
    """
    counts, tokens, parent_rows = _check_tree(
        target_probs, draft_token_ids, parents, num_draft_tokens
    )
    batch, width = draft_token_ids.shape
    expected = (batch, width, target_probs.shape[2])
    if draft_probs is not None and draft_probs.shape != expected:
        raise ValueError(
            f"draft_probs must be [batch, width, vocab] = {expected}, got {tuple(draft_probs.shape)}"
        )
    if len(generators) != batch:
        raise ValueError(f"got {len(generators)} generators for a batch of {batch}")
    uniforms = draw_uniforms(generators, [n + 1 for n in counts], target_probs.device)
    paths = []
    for i, piece in enumerate(uniforms.split([n + 1 for n in counts])):
        n = counts[i]
        rows = None if draft_probs is None else draft_probs[i, :n]
        paths.append(
            tree_rejection_path(
                target_probs[i, : n + 1], rows, tokens[i][:n], parent_rows[i][:n], piece
            )
        )
    return _pack(paths, tokens, width, target_probs.device)


# --- the device path (Triton kernels; see specdec.verify.kernel_choice) --------------------


def _counts_on(device: torch.device, counts: Sequence[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64, device=device)  # [batch], a host copy only


def _triton_greedy(target_logits, draft_token_ids, parents, counts) -> TreeResult:
    """:func:`tree_greedy_verify` on the device: argmax per row, then the longest match."""
    kernels = tree_kernels()
    counts_t = _counts_on(target_logits.device, counts)
    chosen = kernels.row_choices(target_logits, parents, counts_t)
    return kernels.match_paths(chosen, draft_token_ids, parents, counts_t)


def _triton_coupled(target_probs, draft_token_ids, parents, counts, noises) -> TreeResult:
    """:func:`tree_coupled_verify` on the device (the same noise at every depth, bit for bit)."""
    kernels = tree_kernels()
    counts_t = _counts_on(target_probs.device, counts)
    seeds, positions = seeded_keys(noises, target_probs.device)
    chosen = kernels.row_choices(target_probs, parents, counts_t, seeds, positions)
    return kernels.match_paths(chosen, draft_token_ids, parents, counts_t)


def _triton_rejection(
    target_probs, draft_probs, draft_token_ids, parents, counts, generators
) -> TreeResult:
    """:func:`tree_rejection_verify`'s rule on the device with counter-based uniforms."""
    seeds = stream_seeds(generators, target_probs.device)
    return tree_kernels().rejection_paths(
        target_probs, draft_probs, draft_token_ids, parents,
        _counts_on(target_probs.device, counts), seeds, torch.zeros_like(seeds),
    )  # fmt: skip


# --- the verifier ----------------------------------------------------------------------------


class TreeVerifier(RuleVerifier):
    """The :class:`~specdec.interfaces.Verifier` for tree proposals.

    Greedy sequences keep the longest argmax path (:func:`tree_greedy_verify`) and consume no
    randomness; seeded sampled sequences (a :class:`~specdec.noise.SeededNoise`) the longest
    path of their seeded draws (:func:`tree_coupled_verify`); other sampled sequences go
    through :func:`tree_rejection_verify`. All kinds may share one batch, and each gives the
    same output as a chain-shaped tree through :class:`~specdec.verify.chain.ChainVerifier`.

    ``kernels`` chooses the implementation (:mod:`specdec.verify.kernel_choice`): ``"auto"``
    runs the Triton kernels on CUDA when Triton is installed, the torch functions above
    otherwise.

    Example:
        >>> result = TreeVerifier().verify(target_logits, proposal, params, generators)
        >>> result.num_accepted, result.emitted_token_ids, result.accepted_rows
    """

    kind = ProposalKind.TREE

    def _counts(self, target_logits: torch.Tensor, proposal: DraftProposal) -> tuple[int, ...]:
        if target_logits.dim() != 3:
            raise ValueError(
                f"target_logits must be [batch, width + 1, vocab], got {tuple(target_logits.shape)}"
            )
        counts, _, _ = _check_tree(
            target_logits, proposal.draft_token_ids, proposal.parents, proposal.num_draft_tokens
        )
        return counts

    def _verify(self, target_logits, proposal, params, generators, sampling, counts) -> VerifyResult:
        batch, width = proposal.batch_size, proposal.width
        device = target_logits.device
        num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)  # [batch]
        emitted = torch.full((batch, width + 1), PAD_TOKEN_ID, dtype=torch.int64, device=device)
        accepted_rows = torch.full_like(emitted, PAD_TOKEN_ID)  # [batch, width + 1]
        greedy, seeded, streamed = split_by_rule(params, generators)
        if seeded or streamed:
            sampling = sampling or SamplingTensors.from_params(params, device)

        def part(rows: list[int]):  # those sequences' index, counts, drafts and parents
            idx = _row_index(rows, batch, device)
            ids, parents = proposal.draft_token_ids[idx], proposal.parents[idx]
            return idx, [counts[i] for i in rows], ids, parents

        on_device = use_triton(self.kernels, device)
        if greedy:
            idx, n, ids, par = part(greedy)
            verify = _triton_greedy if on_device else tree_greedy_verify
            num_accepted[idx], emitted[idx], accepted_rows[idx] = verify(
                target_logits[idx], ids, par, n
            )
        if seeded:
            idx, n, ids, par = part(seeded)
            probs = _target_probs(target_logits[idx], sampling.select_rows(seeded))
            verify = _triton_coupled if on_device else tree_coupled_verify
            num_accepted[idx], emitted[idx], accepted_rows[idx] = verify(
                probs, ids, par, n, [generators[i] for i in seeded]
            )
        if streamed:
            idx, n, ids, par = part(streamed)
            probs = _target_probs(target_logits[idx], sampling.select_rows(streamed))
            draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[idx]
            verify = _triton_rejection if on_device else tree_rejection_verify
            num_accepted[idx], emitted[idx], accepted_rows[idx] = verify(
                probs, draft_probs, ids, par, n, [generators[i] for i in streamed]
            )
        return VerifyResult(
            num_accepted=tuple(num_accepted.tolist()),  # host copy: the engine commits by it
            emitted_token_ids=emitted,
            accepted_rows=accepted_rows,
        )
