"""The leader's per-step message to the other ranks, as one int64 tensor (no pickling).

A message is ``[kind, n, len_0 .. len_{n-1}, words of field 0, ..., words of field n-1]``.
A forward message carries the step's :class:`~specdec.types.BatchLayout` (the batch's sequence
ids, tokens, positions, page CSR, slot mapping and tree mask) and the page-table operations
the leader's KV manager made since the previous message (see
:mod:`specdec.distributed.journal`), so every rank runs the same step on the same pages.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs
import torch

from specdec.types import BatchLayout

__all__ = ["MessageKind", "StepMessage", "encode", "decode", "layout_fields", "layout_from_fields"]


class MessageKind(enum.IntEnum):
    SETUP = 1  # the leader's KV cache shape: [num_pages, page_size] + the model's fingerprint
    FORWARD = 2  # run the target over a layout
    END_CALL = 3  # the leader's generate() returned
    SHUTDOWN = 4  # the leader closed its generator


@attrs.frozen(eq=False)
class StepMessage:
    kind: MessageKind
    fields: tuple[torch.Tensor, ...]  # each [n_i] int64


def encode(kind: MessageKind, fields: Sequence[torch.Tensor | Sequence[int]]) -> torch.Tensor:
    """``[kind, n, lengths..., words...]`` int64 on the CPU.

    Example:
        >>> decode(encode(MessageKind.SETUP, [[64, 16]])).fields[0].tolist()
        [64, 16]
    """
    parts = [torch.as_tensor(f, dtype=torch.int64).reshape(-1).cpu() for f in fields]
    header = torch.tensor([int(kind), len(parts), *(p.numel() for p in parts)], dtype=torch.int64)
    return torch.cat([header, *parts])  # [2 + n + sum(len_i)] int64


def decode(message: torch.Tensor) -> StepMessage:
    """The inverse of :func:`encode`; ValueError on a malformed message."""
    words = message.tolist()
    if len(words) < 2 or words[0] not in MessageKind._value2member_map_:
        raise ValueError(f"malformed tensor-parallel message header {words[:2]}")
    n = words[1]
    lengths = words[2 : 2 + n]
    if len(lengths) != n or 2 + n + sum(lengths) != len(words):
        raise ValueError("malformed tensor-parallel message: field lengths do not add up")
    fields, offset = [], 2 + n
    for length in lengths:
        fields.append(message[offset : offset + length])
        offset += length
    return StepMessage(kind=MessageKind(words[0]), fields=tuple(fields))


def layout_fields(layout: BatchLayout) -> list[torch.Tensor | list[int]]:
    """The words of a layout (10 fields), in the order :func:`layout_from_fields` reads them."""
    mask = layout.tree_mask
    return [
        list(layout.seq_ids),
        layout.token_ids,
        layout.positions,
        layout.qo_indptr,
        layout.kv_page_indptr,
        layout.kv_page_indices,
        layout.kv_last_page_len,
        layout.slot_mapping,
        [layout.page_size, *layout.q_lens, *layout.kv_lens],
        [] if mask is None else [1, *mask.to(torch.int64).tolist()],
    ]


def layout_from_fields(fields: Sequence[torch.Tensor], device: torch.device) -> BatchLayout:
    """The layout rebuilt from :func:`layout_fields`' words, on ``device``."""
    seq_ids, tokens, positions, qo, page_indptr, pages, last, slots, lens, mask = fields
    batch = len(seq_ids)
    page_size, *rest = lens.tolist()
    i32 = dict(dtype=torch.int32, device=device)
    layout = BatchLayout(
        token_ids=tokens.to(device),  # [num_tokens] int64
        positions=positions.to(device),  # [num_tokens] int64
        qo_indptr=qo.to(**i32),  # [batch + 1] int32
        kv_page_indptr=page_indptr.to(**i32),  # [batch + 1] int32
        kv_page_indices=pages.to(**i32),  # [num_used_pages] int32
        kv_last_page_len=last.to(**i32),  # [batch] int32
        slot_mapping=slots.to(device),  # [num_tokens] int64
        q_lens=tuple(rest[:batch]),
        kv_lens=tuple(rest[batch:]),
        page_size=page_size,
        tree_mask=None if mask.numel() == 0 else mask[1:].to(device=device, dtype=torch.bool),
        seq_ids=tuple(seq_ids.tolist()),
    )
    return layout
