"""Chain and tree verification on the device, greedy and sampled, with no host sync.

A chain is the tree whose node ``j`` has parent ``j - 1`` (:func:`chain_parents`), so one set of
kernels serves both proposal kinds. Three kernels, each beside its torch reference in
:mod:`specdec.verify.tree` (the rules, their proofs and their edge cases are written there):

- :func:`row_choices`: the target's own token at every verify row, its argmax (greedy) or its
  seeded draw (the exponential race of :mod:`specdec.noise`, SplitMix64 keyed by the request's
  seed and the row's output position, the same bits as on the CPU). Reference: ``argmax`` and
  :func:`~specdec.noise.race_sample` as :func:`~specdec.verify.tree.tree_coupled_verify` calls it.
- :func:`match_paths`: the longest root-to-node path whose nodes carry their parent row's
  chosen token (duplicate siblings resolved by the length below them, then the lowest index).
  Reference: :func:`~specdec.verify.tree.tree_match_verify`.
- :func:`rejection_paths`: recursive rejection sampling over each node's siblings, deterministic
  siblings or siblings drawn without replacement from the draft's ``q``, then the recovered or
  bonus token by inverse CDF. Reference: :func:`~specdec.verify.tree.tree_rejection_path`
  given the uniforms of :func:`stream_uniforms`.

Randomness is counter based, as for seeded requests: sequence ``i`` draws uniform ``j`` (node
``j``'s test; ``n`` for the final token) from SplitMix64 keyed by ``(seeds[i], offsets[i])``
(:func:`stream_uniforms` is its reference), so a step needs one seed per request on the device
and nothing read back. One program per sequence (per verify row for :func:`row_choices`),
scanning the vocabulary in blocks; sampled rows work in float64 like their references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.noise import _MASK64, _signed, row_key, uniforms_reference
from specdec.types import PAD_TOKEN_ID

__all__ = [
    "chain_parents",
    "match_paths",
    "rejection_paths",
    "row_choices",
    "stream_uniforms",
]

_BLOCK_V = 1024


def _block(vocab: int) -> int:
    """Vocabulary block: 1024 lanes, fewer for a small vocabulary (tests, the interpreter)."""
    return min(_BLOCK_V, max(16, triton.next_power_of_2(vocab)))


def stream_uniforms(seed: int, offset: int, count: int) -> list[float]:
    """Reference: the ``count`` uniforms :func:`rejection_paths` draws for a sequence with
    ``seeds[i] = seed`` and ``offsets[i] = offset``."""
    return uniforms_reference(row_key(seed, offset), count)


def chain_parents(batch: int, width: int, device: torch.device | str) -> torch.Tensor:
    """``[batch, width]`` int64 parents of a chain: node ``j`` follows node ``j - 1``."""
    return (torch.arange(width, device=device) - 1).expand(batch, width).contiguous()


def as_int64_bits(values: list[int], device: torch.device | str) -> torch.Tensor:
    """Python ints (seeds, any sign, any size) as the int64 tensor of their low 64 bits."""
    return torch.tensor([_signed(v & _MASK64) for v in values], dtype=torch.int64, device=device)


# --- shared device functions ------------------------------------------------------------------


@triton.jit
def _mix(z):
    """SplitMix64's finaliser on uint64 (multiplication wraps modulo 2**64)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _row_key(seed, position):
    """:func:`specdec.noise.row_key` on the device: int64 seed and position -> uint64 key."""
    inner = _mix(seed.to(tl.uint64) + 0x9E3779B97F4A7C15)
    return _mix(inner + (position.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)


@triton.jit
def _uniform(key, counter):
    """Uniform ``counter`` (any int shape) of the stream ``key``, in (0, 1), float64."""
    bits = _mix(key + (counter.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
    return ((bits >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2 ** -53


# --- the target's own choice per row -----------------------------------------------------------


@triton.jit
def _row_choices(
    values_ptr,  # [batch, width + 1, vocab] logits (greedy) or processed probs (seeded)
    parents_ptr,  # [batch, width] int64
    counts_ptr,  # [batch] int64
    seeds_ptr,  # [batch] int64 (seeded)
    positions_ptr,  # [batch] int64, the output position of row 0's token (seeded)
    chosen_ptr,  # [batch, width + 1] int64 (out)
    width,
    vocab,
    SEEDED: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    seq = pid // (width + 1)
    row = pid % (width + 1)
    count = tl.load(counts_ptr + seq)
    base = values_ptr + pid.to(tl.int64) * vocab
    best = tl.full((), float("-inf"), dtype=tl.float64)
    best_id = tl.zeros((), dtype=tl.int64)
    if SEEDED:
        # The row's output position is row 0's plus its depth in the tree.
        depth = tl.zeros((), dtype=tl.int64)
        node = (row - 1).to(tl.int64)
        for _ in range(0, width):
            inside = node >= 0
            depth += inside.to(tl.int64)
            node = tl.load(parents_ptr + seq * width + node, mask=inside, other=-1)
        key = _row_key(tl.load(seeds_ptr + seq), tl.load(positions_ptr + seq) + depth)
        total = tl.zeros((), dtype=tl.float64)
        broken = tl.zeros((), dtype=tl.int32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < vocab
        values = tl.load(base + cols, mask=inside, other=0.0).to(tl.float64)
        if SEEDED:
            # argmax of w / E, E = -log U ~ Exp(1): a draw from w (race_sample).
            finite = (values == values) & (tl.abs(values) < float("inf"))
            broken = tl.maximum(broken, tl.max((inside & ~finite).to(tl.int32), axis=0))
            total += tl.sum(tl.where(inside & finite, values, 0.0), axis=0)
            scores = values / -tl.log(_uniform(key, cols))
        else:
            scores = values
        scores = tl.where(inside, scores, float("-inf"))
        block_best = tl.max(scores, axis=0)
        block_id = tl.min(tl.where(scores == block_best, cols, vocab), axis=0).to(tl.int64)
        better = block_best > best  # strict: an earlier block keeps a tie (lowest id)
        best_id = tl.where(better, block_id, best_id)
        best = tl.where(better, block_best, best)
    if SEEDED:
        best_id = tl.where((broken == 0) & (total > 0), best_id, -1)  # no distribution: -1
    tl.store(chosen_ptr + pid, tl.where(row <= count, best_id, -1))


def row_choices(
    values: torch.Tensor,  # [batch, width + 1, vocab] float
    parents: torch.Tensor,  # [batch, width] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64 on the device
    seeds: torch.Tensor | None = None,  # [batch] int64: seeded draws; None: argmax
    positions: torch.Tensor | None = None,  # [batch] int64, row 0's output position
) -> torch.Tensor:  # [batch, width + 1] int64, -1 past each sequence's rows
    """The target's token at every real verify row: the argmax of ``values`` (logits), or with
    ``seeds`` the seeded draw from ``values`` (processed probabilities; ``-1`` where a row is
    no distribution), row ``r`` using the noise at ``positions + depth(r)``."""
    batch, rows, vocab = values.shape
    seeded = seeds is not None
    if seeded and positions is None:
        raise ValueError("row_choices: seeds need positions (row 0's output position)")
    device = values.device
    dummy = torch.zeros(batch, dtype=torch.int64, device=device)
    chosen = torch.empty(batch, rows, dtype=torch.int64, device=device)
    _row_choices[(batch * rows,)](
        values.contiguous(),
        parents.to(torch.int64).contiguous(),
        num_draft_tokens.to(torch.int64).contiguous(),
        seeds.contiguous() if seeded else dummy,
        positions.to(torch.int64).contiguous() if seeded else dummy,
        chosen,
        rows - 1,
        vocab,
        SEEDED=seeded,
        BLOCK_V=_block(vocab),
    )
    return chosen


# --- the longest matching path -----------------------------------------------------------------


@triton.jit
def _store_path_tail(emitted_ptr, rows_ptr, seq, width, accepted, final, pad):
    """Write the final token after the path and pad both outputs."""
    for col in range(0, width + 1):
        out = seq * (width + 1) + col
        tl.store(emitted_ptr + out, final, mask=col == accepted)
        tl.store(emitted_ptr + out, pad, mask=col > accepted)
        tl.store(rows_ptr + out, pad, mask=col > accepted)


@triton.jit
def _match_paths(
    chosen_ptr,  # [batch, width + 1] int64, -1 matches nothing
    drafts_ptr,  # [batch, width] int64
    parents_ptr,  # [batch, width] int64
    counts_ptr,  # [batch] int64
    accepted_ptr,  # [batch] int64 (out)
    emitted_ptr,  # [batch, width + 1] int64 (out)
    rows_ptr,  # [batch, width + 1] int64 (out)
    width,
    pad,
    BLOCK_W: tl.constexpr,  # a power of two > width
):
    seq = tl.program_id(0)
    count = tl.load(counts_ptr + seq)
    idx = tl.arange(0, BLOCK_W)
    length = tl.zeros((BLOCK_W,), dtype=tl.int64)  # longest matching path below each row
    best = tl.full((BLOCK_W,), -1, dtype=tl.int64)  # the child that starts it
    # Nodes in reverse: a node's children (higher indices) are final before it is seen; among
    # children of equal length the lowest index comes last and wins (>=), as the reference.
    for t in range(0, width):
        j = width - 1 - t
        live = j < count
        row = tl.load(parents_ptr + seq * width + j, mask=live, other=-1) + 1
        want = tl.load(chosen_ptr + seq * (width + 1) + row, mask=live, other=-1)
        token = tl.load(drafts_ptr + seq * width + j, mask=live, other=pad)
        below = tl.sum(tl.where(idx == j + 1, length, 0), axis=0) + 1
        current = tl.sum(tl.where(idx == row, length, 0), axis=0)
        take = live & (want >= 0) & (token == want) & (below >= current)
        length = tl.where(take & (idx == row), below, length)
        best = tl.where(take & (idx == row), j, best)
    row = tl.zeros((), dtype=tl.int64)
    accepted = tl.zeros((), dtype=tl.int64)
    tl.store(rows_ptr + seq * (width + 1), row)
    for step in range(0, width):
        child = tl.sum(tl.where(idx == row, best, 0), axis=0)
        go = child >= 0  # once false it stays false: the row stops moving
        token = tl.load(drafts_ptr + seq * width + child, mask=go, other=pad)
        tl.store(emitted_ptr + seq * (width + 1) + step, token, mask=go)
        tl.store(rows_ptr + seq * (width + 1) + step + 1, child + 1, mask=go)
        accepted += go.to(tl.int64)
        row = tl.where(go, child + 1, row)
    final = tl.load(chosen_ptr + seq * (width + 1) + row)
    tl.store(accepted_ptr + seq, accepted)
    _store_path_tail(emitted_ptr, rows_ptr, seq, width, accepted, final, pad)


def _path_outputs(batch: int, width: int, device: torch.device):
    accepted = torch.empty(batch, dtype=torch.int64, device=device)
    emitted = torch.empty(batch, width + 1, dtype=torch.int64, device=device)
    rows = torch.empty(batch, width + 1, dtype=torch.int64, device=device)
    return accepted, emitted, rows


def match_paths(
    chosen: torch.Tensor,  # [batch, width + 1] int64
    draft_token_ids: torch.Tensor,  # [batch, width] int64
    parents: torch.Tensor,  # [batch, width] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64 on the device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(num_accepted, emitted, accepted_rows)`` as
    :func:`~specdec.verify.tree.tree_match_verify` returns them, on the device."""
    batch, width = draft_token_ids.shape
    accepted, emitted, rows = _path_outputs(batch, width, chosen.device)
    _match_paths[(batch,)](
        chosen.contiguous(),
        draft_token_ids.to(torch.int64).contiguous(),
        parents.to(torch.int64).contiguous(),
        num_draft_tokens.to(torch.int64).contiguous(),
        accepted,
        emitted,
        rows,
        width,
        PAD_TOKEN_ID,
        BLOCK_W=triton.next_power_of_2(width + 1),
    )
    return accepted, emitted, rows


# --- recursive rejection sampling ----------------------------------------------------------------


@triton.jit
def _load_row(dst_ptr, src_ptr, vocab, BLOCK_V: tl.constexpr):
    """dst[:] = float64(src[:])."""
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        values = tl.load(src_ptr + cols, mask=cols < vocab, other=0.0).to(tl.float64)
        tl.store(dst_ptr + cols, values, mask=cols < vocab)


@triton.jit
def _row_sum(ptr, vocab, BLOCK_V: tl.constexpr):
    total = tl.zeros((), dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        total += tl.sum(tl.load(ptr + cols, mask=cols < vocab, other=0.0), axis=0)
    return total


@triton.jit
def _offered(q_ptr, cols, inside, token, q_mass, HAS_Q: tl.constexpr):
    """The law sibling ``token`` was drawn from, over ``cols``: the draft's ``q`` when it has
    mass left, else (and without a draft) the point at ``token``."""
    d = tl.where(cols == token, 1.0, 0.0).to(tl.float64)
    if HAS_Q:
        q = tl.load(q_ptr + cols, mask=inside, other=0.0)
        d = tl.where(q_mass > 0, q, d)
    return d


@triton.jit
def _reject_sibling(r_ptr, q_ptr, token, q_mass, vocab, HAS_Q: tl.constexpr,
                    RESIDUAL: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    """After sibling ``token`` is rejected: ``r <- normalize(max(r - d, 0))`` (``r`` kept when
    that is all zero) and, with a draft ``q``, ``q <- d`` without ``token``, renormalised (all
    zero when nothing is left); ``d`` is ``q`` when ``q_mass > 0``, else the point at
    ``token`` (see :func:`~specdec.verify.tree.sibling_step_without_replacement`)."""
    residual_total = tl.zeros((), dtype=tl.float64)
    kept_total = tl.zeros((), dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < vocab
        d = _offered(q_ptr, cols, inside, token, q_mass, HAS_Q)
        if HAS_Q:
            kept_total += tl.sum(tl.where(inside & (cols != token), d, 0.0), axis=0)
        r = tl.load(r_ptr + cols, mask=inside, other=0.0)
        residual_total += tl.sum(tl.where(inside, tl.maximum(r - d, 0.0), 0.0), axis=0)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < vocab
        d = _offered(q_ptr, cols, inside, token, q_mass, HAS_Q)
        if HAS_Q:
            kept = tl.where(cols != token, d, 0.0)
            kept = tl.where(kept_total > 0, kept / tl.where(kept_total > 0, kept_total, 1.0), 0.0)
            tl.store(q_ptr + cols, kept, mask=inside)
        if RESIDUAL:  # (False only for the tests' negative control: recover from p itself)
            r = tl.load(r_ptr + cols, mask=inside, other=0.0)
            scale = tl.where(residual_total > 0, residual_total, 1.0)
            r = tl.where(residual_total > 0, tl.maximum(r - d, 0.0) / scale, r)
            tl.store(r_ptr + cols, r, mask=inside)


@triton.jit
def _inverse_cdf(ptr, u, vocab, BLOCK_V: tl.constexpr):
    """:func:`specdec.sampling.inverse_cdf` of one float64 row: the first token whose CDF
    exceeds ``u * total``, moved to the nearest positive-weight token after round-off; -1
    when the row is no distribution."""
    total = tl.zeros((), dtype=tl.float64)
    broken = tl.zeros((), dtype=tl.int32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        inside = cols < vocab
        w = tl.load(ptr + cols, mask=inside, other=0.0)
        finite = (w == w) & (tl.abs(w) < float("inf")) & (w >= 0)
        broken = tl.maximum(broken, tl.max((inside & ~finite).to(tl.int32), axis=0))
        total += tl.sum(w, axis=0)
    point = u * total
    index = tl.zeros((), dtype=tl.int64)
    prefix = tl.zeros((), dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        w = tl.load(ptr + cols, mask=cols < vocab, other=0.0)
        cdf = prefix + tl.cumsum(w, axis=0)
        index += tl.sum(((cdf <= point) & (cols < vocab)).to(tl.int64), axis=0)
        prefix += tl.sum(w, axis=0)
    index = tl.minimum(index, vocab - 1)
    before = tl.full((), -1, dtype=tl.int64)
    after = tl.full((), vocab, dtype=tl.int64)
    for start in range(0, vocab, BLOCK_V):
        cols = (start + tl.arange(0, BLOCK_V)).to(tl.int64)
        w = tl.load(ptr + cols, mask=cols < vocab, other=0.0)
        positive = (w > 0) & (cols < vocab)
        before = tl.maximum(before, tl.max(tl.where(positive & (cols <= index), cols, -1), axis=0))
        after = tl.minimum(after, tl.min(tl.where(positive & (cols > index), cols, vocab), axis=0))
    chosen = tl.where(tl.load(ptr + index) > 0, index, tl.where(before >= 0, before, after))
    return tl.where((broken == 0) & (total > 0), chosen, -1)


@triton.jit
def _rejection_paths(
    probs_ptr,  # [batch, width + 1, vocab] float, the target's processed distribution
    q_src_ptr,  # [batch, width, vocab] float, the draft's (HAS_Q)
    drafts_ptr,  # [batch, width] int64
    parents_ptr,  # [batch, width] int64
    counts_ptr,  # [batch] int64
    seeds_ptr,  # [batch] int64
    offsets_ptr,  # [batch] int64
    r_ptr,  # [batch, vocab] float64 scratch: the distribution offered to the next sibling
    q_ptr,  # [batch, vocab] float64 scratch: the law of the next sibling (HAS_Q)
    accepted_ptr,  # [batch] int64 (out)
    emitted_ptr,  # [batch, width + 1] int64 (out)
    rows_ptr,  # [batch, width + 1] int64 (out)
    width,
    vocab,
    pad,
    HAS_Q: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + seq)
    key = _row_key(tl.load(seeds_ptr + seq), tl.load(offsets_ptr + seq))
    r_row = r_ptr + seq * vocab
    q_row = q_ptr + seq * vocab
    row = tl.zeros((), dtype=tl.int64)
    accepted = tl.zeros((), dtype=tl.int64)
    done = tl.zeros((), dtype=tl.int32)  # set when a row rejects all its children
    tl.store(rows_ptr + seq * (width + 1), row)
    for _ in range(0, width + 1):  # each pass moves one level down or ends the walk
        if done == 0:
            _load_row(r_row, probs_ptr + (seq * (width + 1) + row) * vocab, vocab, BLOCK_V)
            kept = tl.full((), -1, dtype=tl.int64)
            siblings = tl.zeros((), dtype=tl.int32)  # children of `row` judged so far
            for c in range(0, width):
                node = c + tl.zeros((), dtype=tl.int64)
                parent = tl.load(parents_ptr + seq * width + node, mask=node < count, other=-2)
                if (parent + 1 == row) & (kept < 0):
                    token = tl.load(drafts_ptr + seq * width + node)
                    q_mass = tl.zeros((), dtype=tl.float64)
                    d_token = tl.full((), 1.0, dtype=tl.float64)
                    if HAS_Q:
                        if siblings == 0:  # the sibling group's law: its first node's draft row
                            q_src = q_src_ptr + (seq * width + node) * vocab
                            _load_row(q_row, q_src, vocab, BLOCK_V)
                        q_mass = _row_sum(q_row, vocab, BLOCK_V)
                        d_token = tl.where(q_mass > 0, tl.load(q_row + token), 1.0)
                    siblings += 1
                    r_token = tl.load(r_row + token)
                    ratio = tl.minimum(r_token / tl.maximum(d_token, 2.2250738585072014e-308), 1.0)
                    alpha = tl.where(r_token > 0, ratio, 0.0)
                    if _uniform(key, node) < alpha:
                        kept = node
                    else:
                        _reject_sibling(r_row, q_row, token, q_mass, vocab, HAS_Q, RESIDUAL,
                                        BLOCK_V)  # fmt: skip
            if kept >= 0:
                token = tl.load(drafts_ptr + seq * width + kept)
                tl.store(emitted_ptr + seq * (width + 1) + accepted, token)
                tl.store(rows_ptr + seq * (width + 1) + accepted + 1, kept + 1)
                accepted += 1
                row = kept + 1
            else:
                done += 1
    final = _inverse_cdf(r_row, _uniform(key, count), vocab, BLOCK_V)
    tl.store(accepted_ptr + seq, accepted)
    _store_path_tail(emitted_ptr, rows_ptr, seq, width, accepted, final, pad)


def rejection_paths(
    target_probs: torch.Tensor,  # [batch, width + 1, vocab] float
    draft_probs: torch.Tensor | None,  # [batch, width, vocab] float, or None: fixed siblings
    draft_token_ids: torch.Tensor,  # [batch, width] int64
    parents: torch.Tensor,  # [batch, width] int64
    num_draft_tokens: torch.Tensor,  # [batch] int64 on the device
    seeds: torch.Tensor,  # [batch] int64
    offsets: torch.Tensor,  # [batch] int64
    *,
    residual: bool = True,  # False: the negative control (recover from p, not the residual)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(num_accepted, emitted, accepted_rows)`` of
    :func:`~specdec.verify.tree.tree_rejection_path` for every sequence, with uniform ``j`` of
    sequence ``i`` taken from ``stream_uniforms(seeds[i], offsets[i], n + 1)[j]``."""
    batch, width = draft_token_ids.shape
    vocab = target_probs.shape[2]
    device = target_probs.device
    accepted, emitted, rows = _path_outputs(batch, width, device)
    scratch = torch.empty(2, batch, vocab, dtype=torch.float64, device=device)
    has_q = draft_probs is not None
    _rejection_paths[(batch,)](
        target_probs.contiguous(),
        draft_probs.contiguous() if has_q else scratch[1],
        draft_token_ids.to(torch.int64).contiguous(),
        parents.to(torch.int64).contiguous(),
        num_draft_tokens.to(torch.int64).contiguous(),
        seeds.to(torch.int64).contiguous(),
        offsets.to(torch.int64).contiguous(),
        scratch[0],
        scratch[1],
        accepted,
        emitted,
        rows,
        width,
        vocab,
        PAD_TOKEN_ID,
        HAS_Q=has_q,
        RESIDUAL=residual,
        BLOCK_V=_block(vocab),
    )
    return accepted, emitted, rows
