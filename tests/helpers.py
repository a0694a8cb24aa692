"""Helpers shared by several test modules (importable because tests/ holds conftest.py)."""

from __future__ import annotations

import random
from collections import Counter

import torch

from specdec.interfaces import SpeculationContext
from specdec.policy import FixedPolicy

F64 = torch.float64


def chi_square_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; bins expecting < 5 are pooled. 0.0 if a
    zero-probability category was observed."""
    observed, probs = observed.to(F64).flatten(), probs.to(F64).flatten()
    if bool((observed[probs == 0] > 0).any()):
        return 0.0
    expected = observed.sum() * probs
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    if obs.numel() < 2:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((obs.numel() - 1) / 2, dtype=F64), stat / 2))


def perturbed(model, scale: float = 0.3, seed: int = 1):
    """A noisy copy of ``model``: a draft that agrees with it often but not always."""
    from benchmarks.common import noisy_copy

    return noisy_copy(model, scale, seed)


def ragged_prefill_logits(model, prompts: list[list[int]], page_size: int = 4) -> list[torch.Tensor]:
    """Every row's logits for a batch of prompts prefilled in one ragged paged forward."""
    from specdec.attention import TorchAttentionBackend
    from specdec.kv import KVCacheManager, PageAllocator

    kv_manager = KVCacheManager(PageAllocator(256), page_size)
    kv = kv_manager.add_pool(model.config.kv_spec("target", model.dtype), "cpu")
    for i, p in enumerate(prompts):
        kv_manager.add_sequence(i)
        kv_manager.reserve(i, len(p))
    backend = TorchAttentionBackend()
    layout = kv.layout(list(range(len(prompts))), prompts, [0] * len(prompts))
    out = model(layout, kv, backend, backend.plan(layout, model.config.attention_spec))
    return list(out.logits.split([len(p) for p in prompts]))


def random_prompts(
    vocab: int, n: int, seed: int, max_len: int = 30, min_len: int = 1
) -> list[list[int]]:
    """``n`` seeded random token-id prompts of lengths min_len..max_len - 1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lengths]


def word_tokenizer(size: int, prefix: str = "t"):
    """A real transformers tokenizer of ``size`` tokens ``{prefix}0 .. {prefix}{size - 1}`` (one
    per whitespace-separated word), for models whose tokenizer must be smaller than their
    embedding table or must differ from another's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"{prefix}{i}": i for i in range(size)}, unk_token=f"{prefix}0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def random_head(target, seed: int = 0, *, use_input_norms: bool = True, scale: float = 1.0):
    """An MTP head with random weights (non-trivial norms) in the target's dtype."""
    from specdec.models.mtp_head import MTPModule as MTPHeadModel
    from specdec.models.mtp_head import MTPModuleConfig as MTPHeadConfig

    torch.manual_seed(seed)
    head = MTPHeadModel(target, MTPHeadConfig.for_target(target.config, use_input_norms=use_input_norms))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.mul_(scale)
    return head.to(target.dtype).eval().requires_grad_(False)


class ScriptedPolicy(FixedPolicy):
    """Random k per request per step (0 included), and a record of every choice made."""

    def __init__(self, seed: int, k: int) -> None:
        super().__init__(k)
        self.rng = random.Random(seed)
        self.chosen: Counter[int] = Counter()
        self.contexts: list[tuple[SpeculationContext, tuple[int, ...]]] = []

    def choose(self, ctx: SpeculationContext) -> tuple[int, ...]:
        ks = tuple(self.rng.randint(0, min(ctx.max_k, cap)) for cap in ctx.caps)
        self.chosen.update(ks)
        self.contexts.append((ctx, ks))
        return ks


def skip_device_call_repatching(monkeypatch) -> None:
    """Speed up Triton's interpreter (``TRITON_INTERPRET=1``) for kernels with many device calls.

    The interpreter re-patches ``triton.language`` (``inspect.getmembers`` over it, about
    0.25 ms) at every call of a ``@triton.jit`` device function, ``tl.sum`` and ``tl.max``
    included, although the launch already patched it for the whole grid; the re-patch sets
    the same attributes again. Calling the rewritten function directly keeps the semantics
    and makes the sampled-verification kernels about 5x faster to interpret. A no-op when the
    interpreter's internals differ from what this expects (the tests just run slower).
    """
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    cls = getattr(interpreter, "InterpretedFunction", None)
    needed = ("rewrite", "_patch_lang", "InterpreterError")
    if cls is None or not all(hasattr(cls if n == "rewrite" else interpreter, n) for n in needed):
        return
    patch = interpreter._patch_lang

    def patched(fn) -> bool:  # the language modules fn sees already point at the interpreter
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        return all(not tl.core.is_builtin(lang.where) for lang in langs)

    def call(self, *args, **kwargs):
        if not patched(self.fn):
            patch(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as the interpreter itself reports a device call's failure
            raise interpreter.InterpreterError(repr(e)) from e

    monkeypatch.setattr(cls, "__call__", call)


def record_drafts(proposer) -> list[int]:
    """Patch ``proposer.propose`` (on the instance) to append every drafted token id, each
    sequence's first ``num_draft_tokens``, to the returned list."""
    drafted: list[int] = []
    original = proposer.propose

    def recording(ctx):
        out = original(ctx)
        drafted.extend(t for row, n in zip(out.draft_token_ids.tolist(), out.num_draft_tokens) for t in row[:n])
        return out

    proposer.propose = recording
    return drafted


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """``specdec`` with ``args`` in this process: (exit code, stdout, stderr); argparse's usage
    errors (``SystemExit``) count as their exit code."""
    from specdec.cli import main

    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


class running_server:
    """Context manager: ``generator`` served over HTTP on 127.0.0.1 (a free port) on a thread;
    yields the server's base URL (``http://127.0.0.1:PORT``). The app is ``.app``, its state
    (engine driver, metrics) ``.state``."""

    def __init__(self, generator, config) -> None:
        from specdec.server import make_server

        self.server = make_server(generator, config, log_level="warning")
        self.app = self.server.config.app
        self.state = self.app.state.specdec

    def __enter__(self) -> str:
        import socket
        import threading
        import time

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(60)


def coin_rule(seed: int):
    """A SuffixHybrid rule choosing the suffix tree or the model by coin flips (any rule must
    keep the output and its distribution), learning like the cost rule otherwise."""
    import random

    from specdec.proposers.hybrid import CostRule

    class CoinRule(CostRule):
        def prefer_suffix(self, seq_id, tree, k, lag=0, remaining=None) -> bool:
            return bool(tree.tokens) and rng.random() < 0.5

    rng = random.Random(seed)
    return CoinRule()


def saved_checkpoints(tmp_path_factory, make, prefix: str = ""):
    """A module fixture's factory: ``(kind, role) -> (directory saved by transformers, its
    model)``, each built once by ``make(kind, draft_of=None)``; role ``"draft"`` is
    ``make(kind, draft_of=<that kind's target>)``, a noisy copy of the target."""
    cache: dict[tuple[str, str], tuple] = {}

    def build(kind: str = "base", role: str = "target"):
        if (kind, role) not in cache:
            base = build(kind)[1] if role == "draft" else None
            hf = make(kind, draft_of=base)
            path = tmp_path_factory.mktemp(f"{prefix}{kind}-{role}")
            hf.save_pretrained(path, safe_serialization=True)
            cache[kind, role] = (path, hf)
        return cache[kind, role]

    return build


def gguf_writer(path, arch: str, cfg, *, head_dim: bool = False):
    """A ``gguf.GGUFWriter`` for ``arch`` holding the keys every family's file has, read from the
    transformers config ``cfg`` (name, context, widths, block and head counts, RMSNorm eps;
    ``head_dim``: the key and value lengths too); the caller adds the family's own keys."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if head_dim:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return writer


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens after ``prompt`` (``n`` of them, EOS not special; the
    model's generation_config is left as it is)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def hf_logits(hf, ids: list[int], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """transformers' logits of ``ids`` in one pass without a cache: [len(ids), vocab]."""
    with torch.no_grad():
        return hf(torch.tensor([ids]), use_cache=False).logits[0].to(dtype)


def bf16_reference(hf):
    """transformers' model with its weights rounded to bf16, computed in float32."""
    import copy

    ref = copy.deepcopy(hf).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return ref


def bf16_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |ours - ref| relative to the reference's logit range (bf16 noise is ~1%)."""
    return float((ours.float() - ref.float()).abs().max() / (ref.max() - ref.min()))


def cpu_prefill_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every row's logits of a ragged prefill through the CPU backend (its attention kernel)."""
    from specdec.attention.cpu_backend import CpuAttentionBackend
    from specdec.kv.allocator import PageAllocator
    from specdec.kv.paged import KVCacheManager

    manager = KVCacheManager(PageAllocator(256), 4)
    kv = manager.add_pool(model.kv_spec("target"), "cpu")
    for i, p in enumerate(prompts):
        manager.add_sequence(i)
        manager.reserve(i, len(p))
    backend = CpuAttentionBackend()
    layout = kv.layout(list(range(len(prompts))), prompts, [0] * len(prompts))
    out = model(layout, kv, backend, backend.plan(layout, model.attention_spec))
    return list(out.logits.split([len(p) for p in prompts]))  # each [len(p), vocab]


def assert_greedy_as_transformers(target, hf, drafts, k: int, prompts, new_tokens: int,
                                  *, expect_accepted: bool) -> None:  # fmt: skip
    """Greedy output of ``target`` (with ``drafts``, at fixed ``k``, or plain) equals
    transformers' greedy on every prompt; with drafts, verify passes ran (and drafts were
    accepted where ``expect_accepted``); every KV page is free afterwards."""
    from specdec import Generator, SamplingParams

    drafted = record_drafts(drafts) if drafts is not None else None
    gen = Generator.from_components(target, proposer=drafts, policy=k if drafts else None)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, p, new_tokens)
    if drafts is not None:
        assert drafted and gen.metrics.num_verify_steps > 0  # verify passes of several rows ran
    if expect_accepted:
        assert gen.metrics.num_accepted > 0
    assert gen.kv_stats()["num_free_pages"] == gen.kv_stats()["num_total_pages"]
