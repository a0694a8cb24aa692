"""The harness's prompt sets, tokenized once by the target's tokenizer."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from benchmarks.common import PROSE_PROMPTS, humaneval_prompts


@attrs.frozen
class PromptSet:
    """A named list of prompts; ``chat`` ones go through the target's chat template; ids count
    from ``first`` (a slice's place in its source)."""

    name: str
    id_prefix: str
    load: Callable[[int | None], list[str]]
    chat: bool
    first: int = 0


def _prose_prompts(n: int | None) -> list[str]:
    return PROSE_PROMPTS[:n] if n else list(PROSE_PROMPTS)


HELDOUT_FIRST = 100  # no policy or kernel was tuned on HumanEval 100 onwards (2026-12-05)


def _heldout_prompts(n: int | None) -> list[str]:
    rest = humaneval_prompts()[HELDOUT_FIRST:]
    return rest[:n] if n else rest


PROMPT_SETS = {
    s.name: s
    for s in (
        PromptSet("humaneval", "HumanEval/", humaneval_prompts, chat=False),
        PromptSet("prose", "prose/", _prose_prompts, chat=True),
        PromptSet("humaneval-heldout", "HumanEval/", _heldout_prompts, chat=False,
                  first=HELDOUT_FIRST),  # fmt: skip
    )
}


@attrs.frozen
class Prompt:
    """One prompt's token ids, named by its set and place in it (``HumanEval/3``)."""

    prompt_set: str
    prompt_id: str
    token_ids: tuple[int, ...]


def tokenize_prompts(tokenizer, prompt_set: PromptSet, n: int | None) -> list[Prompt]:
    """Token ids of the set's first ``n`` prompts, by the target tokenizer, computed once.

    Completion prompts (HumanEval) are encoded raw; chat prompts get the chat template with the
    generation prompt (or stay raw when the tokenizer has no template, e.g. stories260K).
    """
    out = []
    for i, text in enumerate(prompt_set.load(n)):
        if prompt_set.chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(text)
        name = f"{prompt_set.id_prefix}{prompt_set.first + i}"
        out.append(Prompt(prompt_set.name, name, tuple(ids)))
    return out
