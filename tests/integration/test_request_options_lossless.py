"""Request options stay lossless under speculation: the emitted distribution is the target's,
transformed by the option with each position's own history.

The pattern of tests/integration/test_lossless_engine.py (a float64 12-token target and a
noisy draft, 1024 requests a batch, chi-square tests of every position, of neighbouring pairs
and of positions 1-2-3 jointly), with the exact distribution of each position built here from
an independent reference of every option: plain Python over the transformers model's logits
of every prefix. Penalties, bias, allowed ids, bad words, min_tokens and user processors all
depend on the history, so a row transformed with the wrong history (the drafts before it left
out, or only the first verified row transformed) gives a different distribution; the negative
controls make exactly those bugs and must be rejected.
"""

from __future__ import annotations

import functools
import math
from unittest import mock

import pytest
import torch
from helpers import chi_square_pvalue
from test_lossless_engine import (
    PROMPT,
    VOCAB,
    _streams,
    build_head,
    build_models,
    statistics,
)

from specdec import CacheConfig, FixedPolicy, Generator, SamplingParams
from specdec.models.eagle_head import EagleHeadConfig, EagleHeadModel, EagleKind
from specdec.proposers import DraftModel, EAGLETree, MTPHead, PromptLookup

F64 = torch.float64
BATCH = 1024
NUM_BATCHES = 2
K = 3
POSITIONS = K + 2
EOS = 0
NEG_INF = -math.inf


class WordTokenizer:
    """Just enough tokenizer for ``bad_words`` on the 12-token vocabulary: "x" is the token
    pair (4, 6), " x" the single token 9."""

    table = {"x": [4, 6], " x": [9]}

    def encode(self, text, add_special_tokens=True):
        return list(self.table[text])

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(t) for t in ids)


def _ban_next(out, logits):
    """A user processor: the token after the last one is banned, and the token named by the
    sum of the history is pushed up (both depend on every earlier token)."""
    logits = logits.clone()
    logits[(out[-1] + 1) % VOCAB if out else 5] = -torch.inf
    logits[sum(out) % VOCAB] += 1.5
    return logits


def _with_prompt(prompt, out, logits):
    """The three-argument form: the prompt's length counts too."""
    logits = logits.clone()
    logits[(len(prompt) + 2 * len(out)) % VOCAB] += 2.0
    return logits


OPTIONS = {
    "repetition": dict(repetition_penalty=2.0),
    "frequency-presence": dict(frequency_penalty=1.5, presence_penalty=1.0),
    "logit-bias": dict(logit_bias={2: 2.0, 5: -3.0}),
    "allowed-ids": dict(allowed_token_ids=[0, 2, 3, 4, 5, 7, 8, 11]),
    "bad-words": dict(bad_words=["x"]),
    "min-tokens": dict(min_tokens=4, ignore_eos=False),
    "processor": dict(logits_processors=[_ban_next]),
    "processor-3": dict(logits_processors=[_with_prompt]),
    "all": dict(
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={2: 1.0},
        allowed_token_ids=[0, 1, 2, 3, 4, 5, 6, 8, 9, 10],
        bad_words=["x"],
        min_tokens=4,
        ignore_eos=False,
        logits_processors=[_ban_next],
    ),
}


def reference_row(options: dict, prompt: list[int], out: list[int], logits: list[float]) -> list[float]:
    """The option's logits at a position after ``prompt + out``, written from the definitions
    (docs/request-options.md), independently of specdec.logits."""
    o = dict(options)
    row = list(logits)
    history = prompt + out
    # 1. masks
    if o.get("allowed_token_ids") is not None:
        row = [v if t in o["allowed_token_ids"] else NEG_INF for t, v in enumerate(row)]
    if o.get("bad_words"):
        row[9] = NEG_INF  # " x"
        if history[-1] == 4:  # "x" = (4, 6)
            row[6] = NEG_INF
    if len(out) < o.get("min_tokens", 0):
        row[EOS] = NEG_INF
    # 2. penalties
    p = o.get("repetition_penalty", 1.0)
    if p != 1.0:
        row = [(v / p if v > 0 else v * p) if t in history else v for t, v in enumerate(row)]
    freq, pres = o.get("frequency_penalty", 0.0), o.get("presence_penalty", 0.0)
    row = [v - freq * out.count(t) - pres * (t in out) for t, v in enumerate(row)]
    # 3. bias
    for t, b in (o.get("logit_bias") or {}).items():
        row[t] += b
    # 4. processors
    for fn in o.get("logits_processors", ()):
        args = (tuple(out), torch.tensor(row, dtype=F64))
        if fn is _with_prompt:
            args = (tuple(prompt), *args)
        row = fn(*args).tolist()
    return row


@functools.cache
def _hf_logits(n: int) -> torch.Tensor:
    """[vocab] * (n - 1) + [n, vocab]: the raw logits after every prefix (later tokens of a
    row's prefix do not matter to the rows before them)."""
    hf_target = build_models()[0]
    prefixes = torch.cartesian_prod(*[torch.arange(VOCAB)] * (n - 1)).view(-1, n - 1)
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        logits = hf_target(ids).logits[:, -n:]
    return logits.reshape(*[VOCAB] * (n - 1), n, VOCAB)


@functools.cache
def exact_joint(option: str, n: int = POSITIONS) -> torch.Tensor:
    """[vocab] * n float64: the probability of each output under the option at T = 1."""
    logits = _hf_logits(n)
    joint = torch.ones(())
    for m in range(1, n + 1):
        cond = torch.empty(*[VOCAB] * (m - 1), VOCAB, dtype=F64)
        for prefix in torch.cartesian_prod(*[torch.arange(VOCAB)] * (m - 1)).view(-1, m - 1).tolist() if m > 1 else [[]]:
            raw = logits[tuple(prefix) + (0,) * (n - m) + (m - 1,)]
            row = torch.tensor(reference_row(OPTIONS[option], PROMPT, prefix, raw.tolist()), dtype=F64)
            cond[tuple(prefix)] = torch.softmax(row, dim=-1)
        joint = joint[..., None] * cond if m > 1 else cond
    return joint


def _eagle(target):
    torch.manual_seed(5)
    head = EagleHeadModel(target, EagleHeadConfig.for_target(target.config, EagleKind.EAGLE1))
    head = head.to(F64).eval().requires_grad_(False)
    return EAGLETree.from_model(head, None, top_k=3, depth=3, num_verify_tokens=12)


def _generator(models, proposer: str, pages: str = "roomy") -> Generator:
    target = models[1]
    made = {
        "draft": lambda: DraftModel.from_model(models[2], num_speculative_tokens=K),
        "mtp": lambda: MTPHead.from_model(build_head(target), num_speculative_tokens=K),
        "lookup": lambda: PromptLookup(num_speculative_tokens=K),
        "eagle-tree": lambda: _eagle(target),
    }[proposer]()
    page_size, num_pages = (16, 2 * BATCH) if pages == "roomy" else (2, 2600)
    return Generator.from_components(
        target,
        WordTokenizer(),
        proposer=made,
        eos_token_ids=(EOS,),
        cache_config=CacheConfig(
            max_batch_size=BATCH, max_model_len=len(PROMPT) + POSITIONS, page_size=page_size, num_pages=num_pages
        ),
        policy=FixedPolicy(12 if proposer == "eagle-tree" else K),
    )


def _params(option: str, seed: int | None) -> SamplingParams:
    kwargs = dict(max_new_tokens=POSITIONS, temperature=1.0, ignore_eos=True, seed=seed)
    return SamplingParams(**{**kwargs, **OPTIONS[option]})


def sample(models, option: str, proposer: str, pages: str = "roomy", seeded: bool = False):
    gen = _generator(models, proposer, pages)
    sampled = []
    for b in range(NUM_BATCHES):
        params = [_params(option, b * BATCH + i if seeded else None) for i in range(BATCH)]
        with _streams(first=b * BATCH):
            outs = gen.generate([PROMPT] * BATCH, params)
        for out in outs:
            assert len(out.token_ids) == POSITIONS, out  # EOS is masked until it may end nothing
            sampled.append(out.token_ids)
    assert gen.kv_stats()["num_free_pages"] == gen.kv_stats()["num_total_pages"]
    if pages == "tight":
        assert gen.scheduler.num_preemptions > 0
    return torch.tensor(sampled), gen


def pvalues(models, option: str, proposer: str, **kwargs) -> tuple[dict[str, float], Generator]:
    n = POSITIONS
    joint = exact_joint(option)
    tokens, gen = sample(models, option, proposer, **kwargs)
    counts = torch.zeros(*[VOCAB] * n, dtype=F64)
    counts.index_put_(tuple(tokens.T), torch.ones(len(tokens), dtype=F64), accumulate=True)

    def marginal(t, keep):
        return t.sum(tuple(d for d in range(n) if d not in keep))

    out = {}
    for name in statistics(n):
        keep = tuple(int(x) - 1 for x in name.split()[1].split("-"))
        out[name] = chi_square_pvalue(marginal(counts, keep), marginal(joint, keep))
    return out, gen


CASES = [
    *((option, "draft", "roomy", False) for option in OPTIONS),
    ("all", "mtp", "roomy", False),
    ("all", "lookup", "roomy", False),
    ("all", "eagle-tree", "roomy", False),
    ("all", "draft", "tight", False),
    ("all", "draft", "roomy", True),
]
# Family-wise 1e-3 over every correct case, by Bonferroni.
ALPHA = 1e-3 / (len(CASES) * len(statistics(POSITIONS)))


@pytest.fixture(scope="module")
def models():
    return build_models()


@pytest.mark.parametrize(("option", "proposer", "pages", "seeded"), CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_an_option_keeps_the_target_distribution(models, option, proposer, pages, seeded):
    result, gen = pvalues(models, option, proposer, pages=pages, seeded=seeded)
    assert min(result.values()) > ALPHA, result
    m = gen.metrics
    assert m.num_accepted > 100 * NUM_BATCHES, (m.num_accepted, m.num_drafted)  # drafts were kept


def _only_first_row(real):
    """Bug: the option applied at the first verified row only (the others left raw)."""

    def transform(reqs, logits, histories, errors):
        out, dead = real(reqs, logits, [h[:1] for h in histories], errors)
        return out, dead

    return transform


def _without_drafts(real):
    """Bug: every row transformed with the committed history only (counts and bans ignore
    the drafts before the row)."""

    def transform(reqs, logits, histories, errors):
        return real(reqs, logits, [[[] for _ in h] for h in histories], errors)

    return transform


@pytest.mark.parametrize(
    ("bug", "option"),
    [("first-row-only", "repetition"), ("without-drafts", "frequency-presence"), ("without-drafts", "processor")],
)
def test_the_check_rejects_options_applied_with_the_wrong_history(models, bug, option):
    import specdec.engine as engine

    wrap = {"first-row-only": _only_first_row, "without-drafts": _without_drafts}[bug]
    with mock.patch.object(engine, "transform_rows", wrap(engine.transform_rows)):
        result, _ = pvalues(models, option, "draft")
    assert result["position 1"] > ALPHA  # the prefill's row has no drafts before it
    assert min(result.values()) < ALPHA, result
