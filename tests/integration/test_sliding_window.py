"""Mistral sliding-window attention against Hugging Face transformers, the reference.

The other parity tests run Mistral with ``sliding_window=None``, and the attention unit test
builds its reference from specdec's own visibility mask, so a wrong window (off by one, applied
to the wrong rows, dropped for single-row decode or multi-row verify passes) would go unseen
there. Here tiny float64 Mistral models with windows shorter than their prompts are compared
with transformers' eager attention, whose mask is transformers' own (a query sees the
``sliding_window`` most recent tokens, itself included):

- prefill: every prompt row's logits, one ragged forward over pages of 4 slots (the window
  crosses page boundaries), prompt lengths on both sides of the window;
- plain greedy decoding through the engine, single and batched: each emitted token is
  transformers' argmax, and each step's logits match transformers' and specdec's own prefill
  of the whole sequence;
- speculative greedy decoding (draft model, prompt lookup, a window narrower than the verify
  block): verify passes give the same tokens and the same per-step logits as plain decoding.

Transformers runs RMSNorm, RoPE and softmax in float32 even for float64 models, so comparisons
with it use float32-level tolerances; comparisons of specdec with itself use 1e-9.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_model
from helpers import perturbed, ragged_prefill_logits

from specdec import CacheConfig, Generator, SamplingParams
from specdec.models.llama import ModelConfig
from specdec.models.loading import model_from_state_dict
from specdec.proposers import DraftModel, PromptLookup

F64 = torch.float64
PAGE_SIZE = 4  # small pages: every window spans two or three of them
HF_TOL = dict(rtol=1e-5, atol=2e-5)  # transformers' float32 RMSNorm/RoPE/softmax
SELF_TOL = dict(rtol=0.0, atol=1e-9)  # specdec against itself, float64 end to end
NEW_TOKENS = 30
WINDOW = 5  # the window of the tests that need only one


@pytest.fixture(scope="module")
def mistral():
    """Factory: window -> (transformers eager model, specdec model with the same weights)."""
    cache: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}

    def build(window: int):
        if window not in cache:
            hf = make_hf_model(
                "mistral", seed=window, sliding_window=window, attn_implementation="eager"
            )
            # Eager attention adds the mask transformers builds itself; other kernels may
            # take the window as a kernel argument and apply it their own way.
            assert hf.config._attn_implementation == "eager"
            cfg = ModelConfig.from_hf_config(hf.config)
            assert cfg.sliding_window == window
            ours = model_from_state_dict(
                cfg, iter(hf.state_dict().items()), dtype=F64, device=torch.device("cpu")
            )
            cache[window] = (hf, ours)
        return cache[window]

    return build


def _random_ids(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    """transformers' logits for every position in one full forward (no KV cache: only
    transformers' mask and math are involved)."""
    with torch.no_grad():
        return hf(torch.tensor([ids]), use_cache=False).logits[0]


def _generate(model, prompts: list[list[int]], proposer=None, k: int | None = None):
    """Greedy outputs with every step's full log-softmax recorded (logprobs = vocab size)."""
    gen = Generator.from_components(
        model, proposer=proposer, policy=k, cache_config=CacheConfig(page_size=PAGE_SIZE)
    )
    params = SamplingParams(
        max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=model.config.vocab_size
    )
    return gen, gen.generate(prompts, params)


def _step_logprobs(out, vocab: int) -> torch.Tensor:  # [num_steps, vocab]
    """The full log-softmax of each decode step, rebuilt from the top-``vocab`` alternatives."""
    rows = torch.full((len(out.logprobs), vocab), float("nan"), dtype=F64)
    for i, step in enumerate(out.logprobs):
        ids, values = zip(*step.top)
        rows[i, list(ids)] = torch.tensor(values, dtype=F64)
    return rows


def _check_against_transformers(hf, model, prompt: list[int], out) -> None:
    """``out`` is transformers' greedy continuation of ``prompt``, with its logits.

    Checking that each emitted token is transformers' argmax given everything before it is
    the same as comparing with a greedy loop that recomputes the whole sequence each step:
    without a cache, position ``t`` of one full forward sees exactly tokens ``0..t``.
    """
    full = prompt + out.token_ids
    steps = slice(len(prompt) - 1, len(full) - 1)  # the rows that predicted each new token
    ref = _hf_logits(hf, full)[steps]
    assert out.token_ids == ref.argmax(-1).tolist()
    ours = _step_logprobs(out, model.config.vocab_size)
    torch.testing.assert_close(ours, ref.log_softmax(-1), **HF_TOL)
    # Decoding over the paged cache must give what a prefill of the whole sequence gives.
    own = ragged_prefill_logits(model, [full])[0][steps]
    torch.testing.assert_close(ours, own.log_softmax(-1), **SELF_TOL)


def test_reference_applies_the_window(mistral):
    """The convention the other tests hold specdec to: in transformers' eager Mistral a query
    sees ``sliding_window`` tokens, itself included, so the first ``sliding_window`` rows
    equal those of the same model without a window and every later row differs."""
    hf, _ = mistral(WINDOW)
    unwindowed = make_hf_model("mistral", seed=WINDOW, attn_implementation="eager")
    ids = _random_ids([24], hf.config.vocab_size, seed=0)[0]
    gap = (_hf_logits(hf, ids) - _hf_logits(unwindowed, ids)).abs().amax(-1)
    assert gap[:WINDOW].max() < 1e-9
    assert gap[WINDOW:].min() > 1e-2


@pytest.mark.parametrize("window", [3, 5, 7])
def test_prefill_logits_match_transformers(mistral, window):
    """A ragged batch, lengths below, at and just above the window, and far beyond it."""
    hf, ours = mistral(window)
    lengths = [window - 1, window, window + 1, 2 * window + 3, 37]
    prompts = _random_ids(lengths, ours.config.vocab_size, seed=window)
    for p, logits in zip(prompts, ragged_prefill_logits(ours, prompts)):
        torch.testing.assert_close(logits, _hf_logits(hf, p), **HF_TOL)


@pytest.mark.parametrize("length", [WINDOW - 1, WINDOW, WINDOW + 1, 23])
def test_single_sequence_decode_matches_transformers(mistral, length):
    """Batch of one: prompts of window - 1, window and window + 1 tokens cross the window
    boundary on the first decode steps (single-row passes the backend may plan unmasked)."""
    hf, ours = mistral(WINDOW)
    prompt = _random_ids([length], ours.config.vocab_size, seed=length)[0]
    _, (out,) = _generate(ours, [prompt])  # a list in, a list out
    _check_against_transformers(hf, ours, prompt, out)


@pytest.mark.parametrize("window", [3, 7])
def test_batched_decode_matches_transformers(mistral, window):
    """Prompts of different lengths in one generate call: ragged, padded, masked passes."""
    hf, ours = mistral(window)
    lengths = [1, window - 1, window, window + 1, 20, 33]
    prompts = _random_ids(lengths, ours.config.vocab_size, seed=100 + window)
    _, outs = _generate(ours, prompts)
    for prompt, out in zip(prompts, outs):
        _check_against_transformers(hf, ours, prompt, out)


def _check_speculative(mistral, window: int, prompts: list[list[int]], proposer, k: int):
    """Speculative greedy output and per-step logits equal plain decoding's and transformers'."""
    hf, ours = mistral(window)
    _, plain = _generate(ours, prompts)
    gen, spec = _generate(ours, prompts, proposer, k)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    vocab = ours.config.vocab_size
    for prompt, s, p in zip(prompts, spec, plain):
        # Verify-pass rows and single-row decode steps see the same window: same logits.
        torch.testing.assert_close(_step_logprobs(s, vocab), _step_logprobs(p, vocab), **SELF_TOL)
        _check_against_transformers(hf, ours, prompt, s)
    return gen.metrics, spec


@pytest.mark.parametrize(("window", "k"), [(5, 3), (5, 4), (3, 4)])
def test_draft_model_speculation_matches_transformers(mistral, window, k):
    """Window 3 with k = 4: a verify pass of 5 rows is wider than the window itself."""
    _, ours = mistral(window)
    # A lightly perturbed copy agrees often enough that every draft position is accepted
    # sometimes, so verify rows of every depth commit KV and logits that later steps use.
    draft = DraftModel.from_model(perturbed(ours, 0.05, seed=k), num_speculative_tokens=k)
    prompts = _random_ids([window + 1, 17, 29], ours.config.vocab_size, seed=200 + k)
    m, _ = _check_speculative(mistral, window, prompts, draft, k)
    assert m.num_accepted < m.num_drafted  # rejections exercised
    assert len(m.accepted_per_position) == k and min(m.accepted_per_position) > 0


@pytest.mark.parametrize("window", [3, 5])
def test_prompt_lookup_speculation_matches_transformers(mistral, window):
    """Prompt lookup on a prompt whose continuation it finds in the prompt, and on a
    repetitive one whose repeats the model does not follow."""
    _, ours = mistral(window)
    base, motif = _random_ids([12, 6], ours.config.vocab_size, seed=300 + window)
    _, (cont,) = _generate(ours, [base])
    # Two layers of window w see at most 2 * (w - 1) + 1 tokens back, fewer than ``base``
    # holds, and RoPE is relative: after ``base`` again the model must repeat ``cont``, which
    # lookup finds in the prompt and drafts. The repeated motif's drafts are mostly rejected.
    echo = base + cont.token_ids + base
    prompts = [echo, motif * 4]
    lookup = PromptLookup(num_speculative_tokens=4)
    m, (echoed, _) = _check_speculative(mistral, window, prompts, lookup, 4)
    assert 0 < m.num_accepted < m.num_drafted
    assert echoed.token_ids == cont.token_ids  # nothing beyond the window leaks in
