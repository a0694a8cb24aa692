"""The models every system of a run shares, each loaded at most once, on first use."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.common import hf_model_ignoring_eos
from benchmarks.harness.runners import ForwardCounter

if TYPE_CHECKING:
    from benchmarks.harness.config import HarnessConfig


class ModelPool:
    """Every model loaded at most once per process, on first use, and the run's options.

    specdec and transformers hold separate copies (bf16 1.5B ~3.6 GB, 0.5B ~1.3 GB each).
    All specdec generators share one target ``LlamaModel`` per weight format; each has its own
    KV cache sized by ``cache_config``. System builders read their options (heads, tree shape,
    draft confidence) from ``config``.
    """

    def __init__(
        self, config: HarnessConfig, target: Path, draft: Path, cache_config, tokenizer
    ) -> None:
        self.config = config
        self.target_path = target
        self.draft_path = draft
        self.cache_config = cache_config
        self.tokenizer = tokenizer
        self._drafts: dict[str | None, object] = {}
        self._targets: dict[str | None, object] = {}

    @property
    def dtype(self) -> str:
        return self.config.dtype

    @functools.cached_property
    def specdec_plain(self):
        return self.specdec_target(None)

    def specdec_target(self, quantization: str | None):
        """The plain specdec generator of the target with ``quantization`` (``None``: ``dtype``
        weights), loaded once."""
        from specdec import Generator

        if quantization not in self._targets:
            self._targets[quantization] = Generator.from_pretrained(
                self.target_path, dtype=self.dtype, cache_config=self.cache_config,
                quantization=quantization,
            )  # fmt: skip
        return self._targets[quantization]

    def draft_model(self, quantization: str | None):
        """The specdec draft ``LlamaModel`` with ``quantization`` (``None``: ``dtype`` weights),
        loaded once."""
        from specdec.proposers import DraftModel

        if quantization not in self._drafts:
            self._drafts[quantization] = DraftModel.from_pretrained(
                self.draft_path, dtype=self.dtype, quantization=quantization
            ).model
        return self._drafts[quantization]

    @functools.cached_property
    def draft_vocab(self):
        """The ``config.draft_vocab`` tokens most frequent in Python's standard library sources
        (code and docstrings; no benchmark prompt is among them; ~45k distinct tokens), then
        unseen ones in id order: the -vocab systems' drafts."""
        from transformers import AutoConfig

        from benchmarks.common import code_token_ids
        from specdec.models.sub_vocab import frequent_token_ids

        vocab = AutoConfig.from_pretrained(self.draft_path).vocab_size  # no model loaded for it
        ids = code_token_ids(self.tokenizer)
        return frequent_token_ids([ids], self.config.draft_vocab, vocab, fill=True)

    def specdec_generator(self, proposer, policy=None, quantization: str | None = None):
        """A generator on the shared target (stored with ``quantization``) with ``proposer``
        (``None``: plain), its own KV and ``policy`` (``None``: the default adaptive policy)."""
        return self.specdec_target(quantization).with_proposer(
            proposer, cache_config=self.cache_config, policy=policy
        )

    @functools.cached_property
    def hf_target(self):
        return hf_model_ignoring_eos(self.target_path, self.dtype)

    @functools.cached_property
    def hf_counter(self) -> ForwardCounter:
        return ForwardCounter(self.hf_target)

    @functools.cached_property
    def hf_draft(self):
        # A separate object even when draft == target, so the counter sees target calls only.
        return hf_model_ignoring_eos(self.draft_path, self.dtype)

    def llamacpp_model(self, draft_model=None):
        """A llama.cpp context on --llamacpp-target (the GGUF is memory-mapped: contexts share
        its pages); ``draft_model``: llama-cpp-python's proposer, for its speculation."""
        try:
            from llama_cpp import Llama
        except ImportError as err:
            raise ImportError("llamacpp-plain needs llama-cpp-python: pip install 'specdec[llamacpp]'") from err
        if self.config.llamacpp_target is None:
            raise ValueError("llamacpp-plain needs --llamacpp-target FILE.gguf (the target as GGUF)")
        return Llama(model_path=str(self.config.llamacpp_target), n_ctx=4096, n_batch=512, n_threads=1,
                     n_threads_batch=1, verbose=False, draft_model=draft_model)  # fmt: skip

    @property
    def pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return 0 if pad is None else int(pad)
