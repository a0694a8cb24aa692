"""Any transformers causal LM on specdec's engine: the model's own forward, specdec's paged KV.

The fallback for architectures with no native family (GPT-2, GPT-NeoX, Falcon, OPT, ...; see
docs/models.md). :class:`TransformersAdapter` wraps a ``PreTrainedModel`` **as it is**: no
copy, no cast, no fusing (the caller's tensors are the ones that run). Each pass calls the
model's own ``forward`` over the whole ragged batch as one row of tokens, with specdec's
positions as ``position_ids`` (tree rows: by depth), and swaps its attention for
:func:`paged_attention` through transformers' attention interface: that function writes each
layer's new keys and values into specdec's page pool and attends with specdec's backend and
plan, causal or tree-masked, exactly as the native decoders do. So paging, the prefix cache,
rollback of rejected drafts, tree verification and batching are the engine's as usual; the
projections, norms, position embeddings and MLPs are the model's own code.

Exact by construction where the model routes every attention through transformers'
``AttentionInterface`` with no bias of its own; what cannot be served is refused when the
adapter is built, by one probe pass over a single token: models whose attention does not go
through the interface (every layer must be seen once), attention biases added to the mask
(ALiBi: Falcon-RW, BLOOM, MPT), attention soft caps and sinks, head shapes that differ by
layer. Slower than a native family (transformers' per-module code, no fused CPU kernels, no
int8/q4, tensor parallelism or CUDA graphs): ``Generator.stats`` and the loader's log say
which path runs.

The attention implementation is switched to :data:`ATTENTION` for the duration of each pass
only and restored after it, so the caller's model keeps working as before between passes (do
not run the same object elsewhere *during* a generate call). Passes over one model object are
serialised by a lock kept with the object: two generators sharing a target
(``with_proposer``) may step in two threads, and the switch is the object's, not the thread's. The pass's page pool, backend
and plan reach :func:`paged_attention` through a context variable: transformers calls the
attention function by name from inside its modules, and not every model forwards keyword
arguments down to it (Falcon's layers do not); a context variable is scoped to the call, the
thread and the asyncio task.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import threading
from collections.abc import Iterator

import attrs
import torch

from specdec.attention.layered import layer_plan
from specdec.interfaces import AttentionBackend, AttentionSpec
from specdec.kv.paged import KVSpec, ModelKV
from specdec.types import BatchLayout, ModelOutput

__all__ = ["ATTENTION", "AdapterConfig", "TransformersAdapter", "paged_attention"]

ATTENTION = "specdec_paged"  # the name registered in transformers' AttentionInterface

# Config fields of local attention the probe cannot see (applied through the mask only, which
# this path does not build): refused unless the layer passes its window to the attention call.
_WINDOW_FIELDS = ("sliding_window", "attention_window_size", "window_size", "local_attention")


@attrs.define
class _Pass:
    """One pass's paged attention: what every layer's call needs, and which layers called."""

    kv: ModelKV | None
    backend: AttentionBackend | None
    plan: object
    spec: AttentionSpec | None
    seen: list[int] = attrs.field(factory=list)  # layer_idx of each attention call, in order
    # The probe's record per call: (layer, q heads, kv heads, head_dim, scaling, window).
    shapes: list[tuple[int, int, int, int, float | None, int | None]] = attrs.field(factory=list)


_CURRENT: contextvars.ContextVar[_Pass | None] = contextvars.ContextVar("specdec_paged_pass", default=None)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:  # ([1, T, Hq, D], no weights)
    """transformers' attention-function signature over specdec's paged KV: writes the pass's
    new K/V rows into layer ``module.layer_idx``'s pages and attends with the pass's plan."""
    call = _CURRENT.get()
    if call is None:
        raise RuntimeError(f"attn_implementation {ATTENTION!r} runs only inside a specdec pass")
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError(f"{type(module).__name__} has no layer_idx: the transformers adapter cannot place its KV")
    _check_call(module, attention_mask, kwargs)
    call.seen.append(layer)
    window = kwargs.get("sliding_window")
    if call.spec is None:  # the probe: record the shapes, attend to nothing
        call.shapes.append((layer, query.shape[1], key.shape[1], query.shape[3], scaling, window))
        return torch.zeros_like(query).transpose(1, 2), None
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    if scaling is not None and scaling != call.spec.sm_scale:  # per-layer scales (GPT-2 options)
        q = q * (scaling / call.spec.sm_scale)
    k_pages, v_pages = call.kv.layer(layer)
    k = key[0].transpose(0, 1).to(k_pages.dtype).contiguous()  # [T, Hkv, D]
    v = value[0].transpose(0, 1).to(v_pages.dtype).contiguous()
    out = call.backend.run(layer_plan(call.plan, layer), q.to(k_pages.dtype).contiguous(), k, v, k_pages, v_pages)
    return out.to(query.dtype).unsqueeze(0), None  # [1, T, Hq, D]


def _check_call(module: torch.nn.Module, attention_mask: torch.Tensor | None, kwargs: dict) -> None:
    """Refuse what the paged backend would silently drop: a bias in the mask, caps, sinks."""
    name = type(module).__name__
    if attention_mask is not None:
        raise ValueError(
            f"{name} adds a bias of its own to the attention mask (ALiBi or similar), which the "
            "transformers adapter cannot apply: this model is not supported"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError(f"{name} soft-caps its attention scores: not supported by the transformers adapter")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError(f"{name} uses attention sinks: not supported by the transformers adapter")


def _no_mask(*args: object, **kwargs: object) -> None:
    """The mask builder of :data:`ATTENTION`: the paged backend masks from the plan."""
    return None


def register_attention() -> None:
    """Make :data:`ATTENTION` known to transformers (idempotent; a name in its registry)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, paged_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


@contextlib.contextmanager
def _attention_implementation(config: object, call: _Pass) -> Iterator[None]:
    """Run the body with the model's attention switched to :data:`ATTENTION` and ``call`` as
    the pass; both restored after, even on error."""
    previous = config._attn_implementation
    token = _CURRENT.set(call)
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
        _CURRENT.reset(token)


@attrs.frozen(kw_only=True)
class AdapterConfig:
    """What the engine reads of a target or draft config, for a model run by the adapter.

    The head shapes, layer count, windows and scale come from the probe pass (what the model's
    attention calls actually carry), the rest from the transformers config."""

    architecture: str  # the transformers class name, e.g. "GPT2LMHeadModel"
    vocab_size: int  # the width of the model's logits
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float
    layer_windows: tuple[int | None, ...]  # empty: no windows
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    context_field: str = "max_position_embeddings"

    def kv_spec(self, name: str, dtype: torch.dtype) -> KVSpec:
        return KVSpec(name=name, num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                      head_dim=self.head_dim, dtype=dtype)  # fmt: skip

    @property
    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(num_qo_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim, sm_scale=self.sm_scale,
                             layer_windows=self.layer_windows)  # fmt: skip


class TransformersAdapter(torch.nn.Module):
    """A transformers ``PreTrainedModel`` run on specdec's engine (module docstring).

    Holds the caller's model, never a copy: ``adapter.hf_model is model``. Gives logits only:
    proposers that read the target's hidden states or LM head (MTP, EAGLE) need a native family.

    Example:
        >>> hf = AutoModelForCausalLM.from_pretrained("gpt2")
        >>> gen = Generator.from_pretrained(hf, tokenizer=tok)          # the adapter: no native GPT-2
        >>> gen = Generator.from_pretrained(hf, model_impl="transformers")  # forced, any family
    """

    def __init__(self, hf_model: torch.nn.Module) -> None:
        super().__init__()
        _check_model(hf_model)
        register_attention()
        self._lock = pass_lock(hf_model)
        self.hf_model = hf_model.eval()
        self._keeps_logits = "logits_to_keep" in inspect.signature(hf_model.forward).parameters
        self.config = _read_config(hf_model, _probe(hf_model))

    @property
    def dtype(self) -> torch.dtype:
        return self.hf_model.dtype

    @property
    def device(self) -> torch.device:
        return self.hf_model.device

    @property
    def attention_spec(self) -> AttentionSpec:
        return self.config.attention_spec

    def kv_spec(self, name: str) -> KVSpec:
        return self.config.kv_spec(name, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        layout: BatchLayout,
        kv: ModelKV,
        backend: AttentionBackend,
        plan: object,
        *,
        logits_indices: torch.Tensor | None = None,  # [rows] int64; None = every row
        return_hidden: bool = False,
        hidden_layers: tuple[int, ...] | None = None,
        head: object = None,
    ) -> ModelOutput:  # logits [rows, vocab] float32
        """One pass over ``layout`` as :meth:`LlamaModel.forward <specdec.models.llama.LlamaModel.forward>`
        (logits only)."""
        if return_hidden or hidden_layers or head is not None:
            raise ValueError(
                f"{self.config.architecture} runs on the transformers adapter, which gives logits only: "
                "proposers that read the target's hidden states or LM head (MTP, EAGLE) need a "
                "natively supported family (docs/models.md)"
            )
        call = _Pass(kv=kv, backend=backend, plan=plan, spec=self.config.attention_spec)
        kwargs = {}
        if logits_indices is not None and self._keeps_logits:
            kwargs["logits_to_keep"] = logits_indices
        with self._lock, _attention_implementation(self.hf_model.config, call):
            out = self.hf_model(input_ids=layout.token_ids[None], position_ids=layout.positions[None],
                                use_cache=False, **kwargs)  # fmt: skip
        if sorted(call.seen) != list(range(self.config.num_layers)):
            raise RuntimeError(f"{self.config.architecture}: attention calls {call.seen}, expected each of "
                               f"{self.config.num_layers} layers once")  # fmt: skip
        logits = out.logits[0]  # [rows or num_tokens, vocab]
        if logits_indices is not None and not self._keeps_logits:
            logits = logits.index_select(0, logits_indices)
        return ModelOutput(logits=logits if logits.dtype == torch.float64 else logits.float())


class _PassLock:
    """A re-entrant lock that a copy or a pickle of its model object does not share (a copied
    model is another object: it gets a lock of its own)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def __deepcopy__(self, memo: dict) -> _PassLock:
        return _PassLock()

    def __reduce__(self) -> tuple:
        return (_PassLock, ())


def pass_lock(hf_model: torch.nn.Module) -> _PassLock:
    """The lock serialising specdec passes over ``hf_model`` (kept in the object, so every
    adapter over it shares one)."""
    return hf_model.__dict__.setdefault("_specdec_pass_lock", _PassLock())


def _check_model(hf_model: torch.nn.Module) -> None:
    """A causal LM fully in memory whose attention implementation can be switched."""
    from transformers import PreTrainedModel

    if not isinstance(hf_model, PreTrainedModel):
        raise TypeError(f"the transformers adapter takes a PreTrainedModel, got {type(hf_model).__name__}")
    if any(p.is_meta for p in hf_model.parameters()):
        raise ValueError("the model has weights on the meta device (offloaded, e.g. by device_map='auto'): "
                         "load it fully into memory")  # fmt: skip
    if getattr(hf_model.config, "is_encoder_decoder", False):
        raise ValueError(f"{type(hf_model).__name__} is an encoder-decoder model: specdec serves causal LMs")
    if not hf_model._can_set_attn_implementation():
        raise ValueError(
            f"{type(hf_model).__name__} does not route its attention through transformers' "
            "AttentionInterface, which the transformers adapter needs: this model is not supported"
        )


def _probe(hf_model: torch.nn.Module) -> _Pass:
    """One pass over one token with attention recording its calls (and returning zeros)."""
    name = type(hf_model).__name__
    if getattr(hf_model.config.get_text_config(), "alibi", False):  # Falcon-RW: the bias rides in the mask
        raise ValueError(f"{name} uses ALiBi position biases (config.alibi), which the transformers adapter "
                         "cannot apply: this model is not supported")  # fmt: skip
    call = _Pass(kv=None, backend=None, plan=None, spec=None)
    ids = torch.zeros((1, 1), dtype=torch.int64, device=hf_model.device)
    try:
        with pass_lock(hf_model), torch.inference_mode(), _attention_implementation(hf_model.config, call):
            out = hf_model(input_ids=ids, position_ids=ids, use_cache=False)
    except ValueError:
        raise
    except Exception as err:  # the model's code expects something this path does not give
        raise ValueError(f"{name} does not run with specdec's paged attention ({type(err).__name__}: {err}): "
                         "not supported by the transformers adapter") from err
    call.shapes.append((-1, out.logits.shape[-1], 0, 0, None, None))  # the logits width, last
    return call


def _read_config(hf_model: torch.nn.Module, probe: _Pass) -> AdapterConfig:
    """The adapter's config from the probe's records and the transformers config; ValueError
    for what the paged backend cannot run."""
    name = type(hf_model).__name__
    *calls, (_, vocab, *_) = probe.shapes
    layers = [c[0] for c in calls]
    if not calls or sorted(layers) != list(range(len(layers))):
        raise ValueError(f"{name}: its attention layers called {layers}, expected 0..n-1 once each: "
                         "not supported by the transformers adapter")  # fmt: skip
    heads = {c[1:4] for c in calls}
    if len(heads) != 1:
        raise ValueError(f"{name}: attention head shapes differ by layer {sorted(heads)}: not supported")
    (num_heads, num_kv_heads, head_dim), scales = heads.pop(), {c[4] for c in calls}
    scale = scales.pop() if len(scales) == 1 else None
    windows = tuple(c[5] for c in sorted(calls))
    cfg = hf_model.config.get_text_config()
    if not any(windows):
        _refuse_hidden_windows(cfg, name)
    context = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"{name}: its config has no max_position_embeddings, which bounds specdec's KV sizing")
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    eos = getattr(cfg, "eos_token_id", None) if eos is None else eos
    return AdapterConfig(
        architecture=name,
        vocab_size=int(vocab),
        num_layers=len(calls),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        sm_scale=float(scale) if scale is not None else head_dim**-0.5,
        layer_windows=windows if any(windows) else (),
        max_position_embeddings=context,
        eos_token_ids=() if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos)),
    )


def _refuse_hidden_windows(cfg: object, name: str) -> None:
    """A config of local attention whose layers pass no window to the attention call would
    get it from the mask, which this path does not build."""
    layer_types = getattr(cfg, "layer_types", None) or ()
    local = [f for f in _WINDOW_FIELDS if getattr(cfg, f, None)]
    if any(t != "full_attention" for t in layer_types) or (local and getattr(cfg, "use_sliding_window", True)):
        raise ValueError(f"{name}: local attention ({', '.join(local) or 'layer_types'}) applied through the "
                         "attention mask is not supported by the transformers adapter")  # fmt: skip
