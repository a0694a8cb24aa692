"""``prompt_logprobs``: the log-probability of each prompt token under the target, given the
tokens before it, with the ``n`` likeliest alternatives.

The prefill computes every prompt row anyway; for a request that asks, the engine keeps the
logits of all its rows (not just the last) and :func:`record_prompt_logprobs` turns row ``s``
into the entry of prompt token ``s + 1``. The first prompt token has no entry (``None``), as in
vLLM. The distribution is the raw model's (``log_softmax`` of the logits): options such as
penalties describe how *new* tokens are chosen, not how likely the given prompt was. A request
prefilled again after preemption keeps the entries it has.

Example:
    >>> SamplingParams(prompt_logprobs=2)  # out.prompt_logprobs: [None, TokenLogprob, ...]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.request import Request, TokenLogprob

__all__ = ["logits_rows", "record_prompt_logprobs", "wants_prompt_rows"]


def wants_prompt_rows(req: Request) -> bool:
    """Whether this prefill step must keep every row's logits for ``req``."""
    return req.params.prompt_logprobs is not None and req.prompt_logprobs is None


def logits_rows(reqs: Sequence[Request], q_lens: Sequence[int]) -> tuple[list[int], list[int]]:
    """Flat rows whose logits the pass keeps (every row of a request that wants its prompt
    logprobs, else its last) and, per request, where its last row lies among them."""
    rows, last, start = [], [], 0
    for req, q in zip(reqs, q_lens):
        rows.extend(range(start, start + q) if wants_prompt_rows(req) else [start + q - 1])
        last.append(len(rows) - 1)
        start += q
    return rows, last


def record_prompt_logprobs(
    req: Request,
    logits: torch.Tensor,  # [q, vocab] the rows of this step, slot ``first_slot`` on
    first_slot: int,
) -> None:
    """Fill ``req.prompt_logprobs`` once the step's rows cover the whole prompt."""
    prompt = req.prompt_ids
    if first_slot != 0:
        return  # a prefill in pieces is not recorded (the engine prefills prompts whole)
    num = len(prompt) - 1  # rows 0 .. P-2 predict prompt tokens 1 .. P-1
    logprobs = torch.log_softmax(logits[:num].to(torch.float32), dim=-1)  # [P-1, vocab]
    ids = torch.tensor(prompt[1:], dtype=torch.int64, device=logprobs.device)
    own = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()  # [P-1]
    top = torch.topk(logprobs, min(req.params.prompt_logprobs, logprobs.shape[1]), dim=-1)
    top_ids, top_lp = top.indices.tolist(), top.values.tolist()
    req.prompt_logprobs = [None] + [
        TokenLogprob(token_id=t, logprob=lp, top=tuple(zip(i, v)))
        for t, lp, i, v in zip(prompt[1:], own, top_ids, top_lp)
    ]
