"""A draft model whose embedding rows differ from its target's only by padding.

Checkpoints pad their embedding table and LM head past the tokenizer's real size, each model
to its own multiple: Qwen2.5 0.5B has 151,936 rows, 7B 152,064, and both one tokenizer of
151,665 tokens. The rows at and past ``len(tokenizer)`` are no token the tokenizer produces,
so a draft that differs from its target there only still speaks the target's language:
:func:`check_padded_vocab` accepts it when both models come with the same tokenizer and both
tables cover it, and refuses it otherwise.

The verifier compares the draft's distribution with the target's, so the draft's must span the
target's vocabulary: :func:`fit_logits` drops a longer draft's extra logits and gives a shorter
draft's missing ids ``-inf`` (probability 0: the draft never proposes them, which any draft may
do, so the output stays the target's). The target may still emit an id the shorter draft has no
row for (a padding id, or any id of a prompt given as ids): :func:`draft_input_ids` reads it as
the draft's last row, padding as well. That changes only what the draft proposes next.

Example:
    >>> check_padded_vocab(151936, 152064, draft_tokenizer, target_tokenizer)
    >>> fit_logits(torch.zeros(2, 151936), 152064).shape
    torch.Size([2, 152064])
"""

from __future__ import annotations

import torch

__all__ = ["check_padded_vocab", "draft_input_ids", "fit_logits", "same_tokenizer"]


def same_tokenizer(a: object, b: object) -> bool:
    """Whether tokenizers ``a`` and ``b`` map the same strings to the same ids (their
    ``get_vocab()``, added tokens included); a tokenizer without ``get_vocab`` is not known to
    be the same."""
    if a is b:
        return True
    vocab_a, vocab_b = getattr(a, "get_vocab", None), getattr(b, "get_vocab", None)
    if vocab_a is None or vocab_b is None or len(a) != len(b):
        return False
    return vocab_a() == vocab_b()


def check_padded_vocab(
    draft_rows: int,
    target_rows: int,
    draft_tokenizer: object | None,
    target_tokenizer: object | None,
) -> None:
    """ValueError unless a draft of ``draft_rows`` embedding rows may speak for a target of
    ``target_rows``: the same number, or one tokenizer (both given, :func:`same_tokenizer`)
    whose ``len`` both tables cover, so that they differ only by padding rows."""
    if draft_rows == target_rows:
        return
    head = (
        f"proposer: the draft model's vocabulary has {draft_rows} tokens but the target's has "
        f"{target_rows}; a draft model must share the target's tokenizer, and their embedding "
        "rows may differ only by padding past its length, "
    )
    missing = [
        name
        for name, tok in (("the draft", draft_tokenizer), ("the target", target_tokenizer))
        if tok is None
    ]
    if missing:
        raise ValueError(
            head + f"which needs both models' tokenizers to check, and {' and '.join(missing)} "
            f"{'have' if len(missing) > 1 else 'has'} none "
            "(DraftModel.from_pretrained reads the draft's from its directory, DraftModel.from_model "
            "takes tokenizer=; the target's is the Generator's); a draft of another tokenizer "
            "drafts through text: specdec.proposers.CrossTokenizerDraft"
        )
    if not same_tokenizer(draft_tokenizer, target_tokenizer):
        raise ValueError(
            head + f"but the draft's tokenizer ({len(draft_tokenizer)} tokens) is not the target's "
            f"({len(target_tokenizer)} tokens); a draft of another tokenizer drafts through text: "
            "specdec.proposers.CrossTokenizerDraft"
        )
    size = len(target_tokenizer)
    if size > min(draft_rows, target_rows):
        raise ValueError(
            head
            + f"but their tokenizer has {size} tokens, more than the {min(draft_rows, target_rows)} "
            "rows of the smaller table: the rows they differ by are not padding"
        )


def fit_logits(
    logits: torch.Tensor,  # [rows, draft_rows] the draft's logits over its own table
    vocab_size: int,  # the target's rows
) -> torch.Tensor:  # [rows, vocab_size]
    """The draft's logits over the target's ids: extra columns dropped, missing ones ``-inf``.

    Example:
        >>> fit_logits(torch.tensor([[1.0, 2.0]]), 3)
        tensor([[1., 2., -inf]])
        >>> fit_logits(torch.tensor([[1.0, 2.0, 3.0]]), 2)
        tensor([[1., 2.]])
    """
    rows, width = logits.shape
    if width >= vocab_size:
        return logits[:, :vocab_size]
    pad = logits.new_full((rows, vocab_size - width), float("-inf"))
    return torch.cat([logits, pad], dim=1)


def draft_input_ids(token_ids: list[int], draft_rows: int) -> list[int]:
    """``token_ids`` (the target's ids) as a draft of ``draft_rows`` rows can embed them: ids
    past its table read its last row (padding, as every id past the tokenizer is).

    Example:
        >>> draft_input_ids([5, 9, 12], 10)
        [5, 9, 9]
    """
    last = draft_rows - 1
    return [t if t <= last else last for t in token_ids]
