"""Frozen per-step records passed between scheduler, engine, models, proposers and verifiers.

They hold tensors, so they are ``@attrs.frozen(eq=False)``. Host-side copies of small
per-sequence lengths (``q_lens``, ``kv_lens``, ``num_draft_tokens`` ...) travel beside the
tensors so that planning never has to synchronise with the device to read them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs
import torch

__all__ = [
    "PAD_TOKEN_ID",
    "BatchLayout",
    "LayoutHost",
    "ProposalKind",
    "DraftProposal",
    "RequestEnd",
    "VerifyRows",
    "VerifyResult",
    "ModelOutput",
    "StepOutput",
]

PAD_TOKEN_ID = -1
"""Fills unused slots of fixed-width token outputs."""


@attrs.frozen(eq=False)
class LayoutHost:
    """Host (CPU) copies of a layout's page CSR and tree mask, made where the layout is built.

    A backend's ``plan`` reads these: reading the layout's device tensors would synchronise the
    host with a GPU once per model and step.
    """

    kv_page_indptr: tuple[int, ...]  # [batch + 1]
    kv_page_indices: tuple[int, ...]  # [num_used_pages]
    kv_last_page_len: tuple[int, ...]  # [batch]
    tree_mask: torch.Tensor | None = None  # [sum(q_len_i ** 2)] bool on the CPU


@attrs.frozen(eq=False)
class BatchLayout:
    """A ragged batch for one model forward: flattened tokens plus paged-KV metadata.

    Sequence ``i`` contributes query rows ``qo_indptr[i]:qo_indptr[i+1]``. Its KV, *including*
    the new rows (they are written before attention), spans ``kv_lens[i]`` slots stored in
    pages ``kv_page_indices[kv_page_indptr[i]:kv_page_indptr[i+1]]``, the last page holding
    ``kv_last_page_len[i]`` of them (the CSR form FlashInfer takes). New row ``r`` of sequence
    ``i`` occupies KV slot ``kv_lens[i] - q_lens[i] + r`` of that sequence.

    Visibility: a causal row sees every slot up to its own. With ``tree_mask`` a row sees every
    slot before the new rows plus the new rows its mask marks (its tree ancestors and itself).
    """

    token_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, RoPE positions (depth-based for tree rows)
    qo_indptr: torch.Tensor  # [batch + 1] int32
    kv_page_indptr: torch.Tensor  # [batch + 1] int32
    kv_page_indices: torch.Tensor  # [num_used_pages] int32
    kv_last_page_len: torch.Tensor  # [batch] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot (page * page_size + offset) per new row
    q_lens: tuple[int, ...]  # host copy, one per sequence
    kv_lens: tuple[int, ...]  # host copy, one per sequence (includes the new rows)
    page_size: int
    tree_mask: torch.Tensor | None = None  # [sum(q_len_i ** 2)] bool, row-major [q_len, q_len] per sequence
    seq_ids: tuple[int, ...] = ()  # host copy: the sequence of each batch entry, when known
    host: LayoutHost | None = None  # host copies of the page CSR and tree mask, when known

    def host_copy(self) -> LayoutHost:
        """:attr:`host`, or one read back from the device tensors (a host sync on a GPU)."""
        if self.host is not None:
            return self.host
        return LayoutHost(
            kv_page_indptr=tuple(self.kv_page_indptr.tolist()),
            kv_page_indices=tuple(self.kv_page_indices.tolist()),
            kv_last_page_len=tuple(self.kv_last_page_len.tolist()),
            tree_mask=None if self.tree_mask is None else self.tree_mask.cpu(),
        )

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def last_row_indices(self) -> torch.Tensor:
        """[batch] int64: the flat index of each sequence's last query row."""
        return self.qo_indptr[1:].to(torch.int64) - 1


class ProposalKind(enum.Enum):
    CHAIN = "chain"
    TREE = "tree"


class RequestEnd(enum.Enum):
    """Why a request stopped being decoded, as a proposer that tracks requests is told
    (:class:`specdec.interfaces.TracksRequests`). Only ``PREEMPTED`` requests start again."""

    FINISHED = "finished"  # a stop token or string, max_new_tokens or the context limit
    CANCELLED = "cancelled"
    FAILED = "failed"  # its own error (non-finite numbers, a failing stop check) or its batch's
    PREEMPTED = "preempted"  # pages ran short: it waits, and is prefilled again when readmitted


@attrs.frozen(eq=False)
class DraftProposal:
    """What a proposer drafted for each sequence of a decode batch.

    Rows are padded to ``width``: ``draft_token_ids[i, :num_draft_tokens[i]]`` are real, the rest
    ``PAD_TOKEN_ID``. A sequence may draft nothing (``num_draft_tokens[i] == 0``): it then takes
    one ordinary target step inside the same verify pass.

    Chain: draft token ``j`` follows draft token ``j - 1`` (token ``0`` follows the last emitted
    token). Tree: ``parents[i, j]`` is the index of node ``j``'s parent among the drafts, ``-1``
    for children of the last emitted token; parents come before children.

    ``draft_probs`` holds the draft's *processed* distribution each token was drawn from (the
    verifier's rejection rule needs it); ``None`` means the drafts are deterministic (one-hot),
    as from n-gram lookup or a greedy draft.
    """

    kind: ProposalKind
    draft_token_ids: torch.Tensor  # [batch, width] int64, PAD_TOKEN_ID past num_draft_tokens
    num_draft_tokens: tuple[int, ...]  # host copy, one per sequence
    draft_probs: torch.Tensor | None = None  # [batch, width, vocab] float, or None for one-hot
    parents: torch.Tensor | None = None  # [batch, width] int64, TREE only

    @property
    def width(self) -> int:
        return int(self.draft_token_ids.shape[1])

    @property
    def batch_size(self) -> int:
        return int(self.draft_token_ids.shape[0])


@attrs.frozen(eq=False)
class VerifyRows:
    """How a proposal's drafts sit in the target's verify pass, per sequence (host lists).

    A chain's rows are causal at consecutive positions (``positions`` and ``tree_masks`` are
    ``None``); a tree's rows sit at ``start + depth`` and see their ancestors only.
    """

    positions: list[list[int]] | None  # per sequence: [num_draft + 1] RoPE positions, or None
    tree_masks: list[torch.Tensor] | None  # per sequence: [num_draft + 1, num_draft + 1] bool
    depths: list[int]  # per sequence: its deepest draft (a chain's: its length)


@attrs.frozen(eq=False)
class VerifyResult:
    """The verifier's decision for each sequence.

    ``emitted_token_ids[i, :num_emitted[i]]`` are the accepted drafts followed by one recovered
    or bonus token (so ``num_emitted == num_accepted + 1``). ``accepted_rows[i, :num_emitted[i]]``
    are the verify-pass rows whose KV and hidden states belong to the kept path (row 0 is the
    last emitted token's row); for a chain that is simply ``0 .. num_accepted``.
    """

    num_accepted: tuple[int, ...]  # host copy, one per sequence
    emitted_token_ids: torch.Tensor  # [batch, width + 1] int64, PAD_TOKEN_ID padded
    accepted_rows: torch.Tensor  # [batch, width + 1] int64, PAD_TOKEN_ID padded

    @property
    def num_emitted(self) -> tuple[int, ...]:
        return tuple(a + 1 for a in self.num_accepted)


@attrs.frozen(eq=False)
class ModelOutput:
    """A model forward's result: logits for the requested rows, hidden states on request.

    ``hidden_states`` holds, for each of the requested ``hidden_layers`` in order, the residual
    stream entering that decoder layer (``num_layers``: the last layer's output before the final
    norm, which is all ``return_hidden=True`` asks for), concatenated along the last dim.
    """

    logits: torch.Tensor  # [num_logit_rows, vocab] float
    hidden_states: torch.Tensor | None = None  # [num_tokens, len(hidden_layers) * hidden], pre-norm


@attrs.frozen(eq=False)
class StepOutput:
    """What one engine step produced, per sequence that took part in it."""

    seq_ids: tuple[int, ...]
    new_token_ids: tuple[tuple[int, ...], ...]  # tokens emitted this step, per sequence
    num_drafted: tuple[int, ...]  # draft tokens verified this step (0 on plain steps)
    num_accepted: tuple[int, ...]  # of which accepted
    speculative: bool  # whether this step verified drafts
    new_logprobs: tuple[tuple[object, ...], ...] = ()  # per sequence, per token, when requested
    failed_seq_ids: tuple[int, ...] = ()  # requests that failed in this step (their error is on the request)

    @staticmethod
    def empty() -> StepOutput:
        return StepOutput(
            seq_ids=(), new_token_ids=(), num_drafted=(), num_accepted=(), speculative=False
        )


def pad_rows(rows: Sequence[Sequence[int]], width: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Pack ragged int rows into a ``[len(rows), width]`` int64 tensor padded with PAD_TOKEN_ID."""
    out = torch.full((len(rows), width), PAD_TOKEN_ID, dtype=torch.int64)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.int64)
    return out.to(device)
