"""A draft vocabulary's LM head: the full head's logits on its tokens, -inf elsewhere, in the
full head's storage format; the frequency count that picks the tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec.models.sub_vocab import SubVocabHead, check_token_ids, frequent_token_ids

VOCAB, HIDDEN = 300, 64
IDS = [7, 250, 3, 99, 0, 299, 120]


def _head(dtype=torch.float64, bias=False) -> nn.Linear:
    torch.manual_seed(0)
    head = nn.Linear(HIDDEN, VOCAB, bias=bias, dtype=dtype).requires_grad_(False)
    return head


@pytest.mark.parametrize("bias", [False, True])
def test_logits_are_the_full_heads_on_the_subset_and_minus_inf_elsewhere(bias):
    head = _head(bias=bias)
    sub = SubVocabHead(head, torch.tensor(IDS), VOCAB)
    x = torch.randn(5, HIDDEN, dtype=torch.float64)
    out, full = sub(x), head(x)
    assert out.shape == (5, VOCAB) and out.dtype == torch.float64
    torch.testing.assert_close(out[:, IDS], full[:, IDS], rtol=1e-13, atol=1e-13)  # BLAS blocking
    outside = [t for t in range(VOCAB) if t not in IDS]
    assert torch.isneginf(out[:, outside]).all()
    assert sub.linear.weight.shape == (len(IDS), HIDDEN)  # reads only the subset's rows


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("fmt", ["packed", "int8", "q4"])
def test_the_subset_keeps_the_heads_storage_format(fmt):
    """A packed bf16 / int8 / 4-bit head gives a sub-head of the same format whose logits are
    what that format computes for those rows (int8 and 4-bit quantize per output feature, so
    the rows' codes are the full head's)."""
    from specdec.models.packed import PackedLinear, pack_linears
    from specdec.models.quantized import Int8Linear, Q4Linear

    holder = nn.Sequential(_head(torch.bfloat16))
    if fmt == "packed":
        pack_linears(holder)
    else:
        cls = Int8Linear if fmt == "int8" else Q4Linear
        w = holder[0].weight.detach()
        holder[0] = cls(w, None, torch.float32)
    head = holder[0]
    sub = SubVocabHead(head, IDS, VOCAB)
    assert type(sub.linear) is {"packed": PackedLinear, "int8": Int8Linear, "q4": Q4Linear}[fmt]
    x = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    assert torch.equal(sub(x)[:, IDS], head(x).float()[:, IDS])  # each feature its own sum: exact


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([], "non-empty 1-D"),
        ([[1, 2]], "non-empty 1-D"),
        ([1.5, 2.0], "integer token ids"),
        ([3, VOCAB], rf"token ids in \[0, {VOCAB}\)"),
        ([-1, 3], rf"token ids in \[0, {VOCAB}\)"),
        ([4, 5, 4], "must not repeat"),
    ],
)
def test_bad_token_ids_are_named(ids, match):
    with pytest.raises(ValueError, match=match):
        check_token_ids(torch.tensor(ids) if ids and isinstance(ids[0], float) else ids, VOCAB)


def test_token_ids_of_the_wrong_type_are_named():
    with pytest.raises(TypeError, match="draft_vocab must be a 1-D sequence of token ids, got int"):
        check_token_ids(5, VOCAB)


def test_frequent_token_ids_counts_and_breaks_ties_by_id():
    seqs = [[5, 5, 9, 1], [9, 5, 2], [], [1, 9]]  # 5: 3, 9: 3, 1: 2, 2: 1
    assert frequent_token_ids(seqs, 3, 10).tolist() == [5, 9, 1]
    assert frequent_token_ids(seqs, 100, 10).tolist() == [5, 9, 1, 2]  # only ids seen
    assert frequent_token_ids(seqs, 7, 10, fill=True).tolist() == [5, 9, 1, 2, 0, 3, 4]
    with pytest.raises(ValueError, match="positive int"):
        frequent_token_ids(seqs, 0, 10)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        frequent_token_ids([[10]], 3, 10)
