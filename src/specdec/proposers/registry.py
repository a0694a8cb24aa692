"""The proposer registry: names that build proposers, from the CLI, a benchmark or a plug-in.

An entry (:class:`ProposerEntry`) names a proposer, says in one line what it does, lists the
options it takes (:class:`ProposerOption`: each becomes a ``specdec generate`` flag) and builds
the proposer from their values and a :class:`BuildContext` (device, dtype, the target). The
built-in entries wrap the public constructors (``DraftModel.from_pretrained``, ...); installed
packages add theirs through the ``specdec.proposers`` entry-point group, no file of specdec
edited. :func:`load_registry` builds the registry on demand: nothing is kept in a global.

Example:
    >>> registry = load_registry()
    >>> registry.names()  # the built-ins, then installed plug-ins
    ('draft', 'mtp', 'eagle', 'prompt-lookup', 'suffix')
    >>> lookup = registry.build("prompt-lookup", {"num_speculative_tokens": 3})

A plug-in's ``pyproject.toml``::

    [project.entry-points."specdec.proposers"]
    echo = "specdec_echo:entry"   # a ProposerEntry, or a zero-argument callable returning one
"""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from specdec.interfaces import Proposer

__all__ = [
    "ENTRY_POINT_GROUP",
    "BuildContext",
    "PluginError",
    "ProposerEntry",
    "ProposerOption",
    "ProposerRegistry",
    "builtin_entries",
    "load_registry",
    "plugin_entries",
    "positive_int_arg",
]

ENTRY_POINT_GROUP = "specdec.proposers"
# Names an entry's options may not take: the options every proposer shares (``-k``), and the
# CLI's own names that a flag of the same name would overwrite in argparse's namespace.
RESERVED_OPTIONS = ("num_speculative_tokens", "proposer", "command", "debug")


class PluginError(ValueError):
    """A proposer plug-in that cannot be loaded or clashes with another entry."""


def positive_int_arg(text: str) -> int:
    """Parses an option's text: an int >= 1 (``0`` is refused, not taken as 'all')."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


@attrs.frozen(kw_only=True)
class BuildContext:
    """What a builder may need beyond its own options: where the target lives and how it is
    loaded. Heads that borrow the target's weights get them later, through ``attach``."""

    target: str | None = None  # the target's path or name, as given to Generator.from_pretrained
    device: str = "cpu"
    dtype: str = "bfloat16"
    quantization: str | None = None  # the target's weight format: None, "int8" or "q4"


@attrs.frozen(kw_only=True)
class ProposerOption:
    """One option of a proposer: ``name`` is its key in the options a builder gets and, with
    dashes, its CLI flag (``tree_top_k`` -> ``--tree-top-k``).

    ``type`` parses the flag's text (``bool``: a flag that takes no value). ``selects``: giving
    the flag alone selects its entry, so ``--draft PATH`` means ``--proposer draft --draft PATH``.
    """

    name: str = attrs.field(validator=attrs.validators.matches_re(r"[a-z][a-z0-9_]*"))
    help: str = attrs.field(validator=attrs.validators.min_len(1))
    type: Callable[[str], object] = attrs.field(default=str, validator=attrs.validators.is_callable())
    default: object = None
    choices: tuple | None = None
    metavar: str | None = None
    required: bool = False
    selects: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def parse(self, value: object) -> object:
        """``value`` as the builder takes it: text is parsed by ``type`` (options may come as
        strings from a file or a command line), anything else passes as it is."""
        if isinstance(value, str) and self.type not in (str, bool):
            try:
                value = self.type(value)
            except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
                raise ValueError(f"option {self.name}: {exc}") from None
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"option {self.name} must be one of {list(self.choices)}, got {value!r}")
        return value


@attrs.frozen(kw_only=True)
class ProposerEntry:
    """A named way to build a proposer: ``build(options, context) -> Proposer``.

    ``options`` holds a value for every option of the entry (its default when not given) and
    ``num_speculative_tokens`` (``-k``; this entry's default when not given).
    """

    name: str = attrs.field(validator=attrs.validators.matches_re(r"[a-z0-9][a-z0-9_-]*"))
    help: str = attrs.field(validator=attrs.validators.min_len(1))
    build: Callable[[Mapping[str, object], BuildContext], Proposer] = attrs.field(
        validator=attrs.validators.is_callable()
    )
    options: tuple[ProposerOption, ...] = attrs.field(default=(), converter=tuple)
    num_speculative_tokens: int = 4  # the width when -k is not given
    origin: str = "built-in"  # where it came from, for error messages


@attrs.frozen
class ProposerRegistry:
    """Entries by name, in order (built-ins first). Names and option names are unique: the
    CLI's flags of all entries share one namespace."""

    entries: tuple[ProposerEntry, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        _check_unique(self.entries)

    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def entry(self, name: str) -> ProposerEntry:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise ValueError(f"unknown proposer {name!r}; known: {', '.join(self.names())}")

    def resolve(
        self, name: str, options: Mapping[str, object] | None = None, *, parsed: bool = False
    ) -> dict[str, object]:
        """The full options ``build`` of entry ``name`` gets: ``options`` (parsed by each
        option's type unless already ``parsed``, as a command line's are), with defaults for
        the rest; ``None`` means not given. Unknown or missing required options are a
        ``ValueError``."""
        entry = self.entry(name)
        given = dict(options or {})
        known = {o.name for o in entry.options} | {"num_speculative_tokens"}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"proposer {name!r} takes no option {unknown[0]!r}; it takes: {', '.join(sorted(known))}")
        resolved: dict[str, object] = {}
        for option in entry.options:
            if given.get(option.name) is None:
                if option.required:
                    raise ValueError(f"proposer {name!r} needs option {option.name!r} ({option.help})")
                # A flag (bool) not given is off unless declared on: never None.
                resolved[option.name] = bool(option.default) if option.type is bool else option.default
            else:
                value = given[option.name]
                resolved[option.name] = value if parsed else option.parse(value)
        k = given.get("num_speculative_tokens")
        if isinstance(k, str) and not parsed:
            k = _parse_k(k)
        # The constructors validate k (one rule for every proposer, in specdec.config).
        resolved["num_speculative_tokens"] = entry.num_speculative_tokens if k is None else k
        return resolved

    def build(
        self,
        name: str,
        options: Mapping[str, object] | None = None,
        context: BuildContext | None = None,
        *,
        parsed: bool = False,
    ) -> Proposer:
        """The proposer of entry ``name`` from a dict of options (see :meth:`resolve`).

        >>> load_registry().build("draft", {"draft": "path/to/draft", "draft_quantization": "int8"})
        """
        resolved = self.resolve(name, options, parsed=parsed)
        return self.entry(name).build(resolved, context or BuildContext())


def _parse_k(text: str) -> int:
    try:
        return positive_int_arg(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"option num_speculative_tokens: {exc}") from None


def _check_unique(entries: tuple[ProposerEntry, ...]) -> None:
    """Two entries of one name, or one option (= one CLI flag) in two entries, are an error
    naming both, so an installed plug-in never silently shadows another proposer."""
    names: dict[str, ProposerEntry] = {}
    options: dict[str, ProposerEntry] = {}
    for entry in entries:
        if entry.name in names:
            raise PluginError(
                f"two proposers named {entry.name!r}: {names[entry.name].origin} and {entry.origin}"
            )
        names[entry.name] = entry
        for option in entry.options:
            if option.name in RESERVED_OPTIONS:
                raise PluginError(f"proposer {entry.name!r} ({entry.origin}) declares option "
                                  f"{option.flag}, which specdec itself owns")
            other = options.setdefault(option.name, entry)
            if other is not entry:
                raise PluginError(
                    f"option {option.flag} is declared by proposer {other.name!r} ({other.origin}) "
                    f"and by proposer {entry.name!r} ({entry.origin})"
                )


def load_registry() -> ProposerRegistry:
    """The built-in entries and those of installed plug-ins (read now, not cached)."""
    return ProposerRegistry((*builtin_entries(), *plugin_entries()))


def plugin_entries() -> tuple[ProposerEntry, ...]:
    """Entries of the installed packages' ``specdec.proposers`` entry points."""
    return tuple(_load_plugin(ep) for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _load_plugin(ep: importlib.metadata.EntryPoint) -> ProposerEntry:
    dist = getattr(ep, "dist", None)
    origin = f"entry point '{ep.name} = {ep.value}'" + (f" of {dist.name} {dist.version}" if dist else "")
    try:
        loaded = ep.load()
        entry = loaded if isinstance(loaded, ProposerEntry) or not callable(loaded) else loaded()
    except Exception as exc:  # noqa: BLE001 - any failure inside a plug-in is reported as its own
        raise PluginError(f"proposer plug-in {origin} failed to load: {type(exc).__name__}: {exc}") from exc
    if not isinstance(entry, ProposerEntry):
        raise PluginError(f"proposer plug-in {origin} gave a {type(entry).__name__}, not a "
                          "specdec.proposers.registry.ProposerEntry")
    if entry.name != ep.name:
        raise PluginError(f"proposer plug-in {origin} names its entry {entry.name!r}, not {ep.name!r}")
    return attrs.evolve(entry, origin=origin)


def builtin_entries() -> tuple[ProposerEntry, ...]:
    """specdec's own proposers, built by their public constructors."""
    return (
        ProposerEntry(
            name="draft",
            help="a smaller draft model of the same tokenizer drafts a chain",
            build=_build_draft,
            options=(
                ProposerOption(name="draft", metavar="PATH", required=True, selects=True,
                               help="the draft model: HF directory, .gguf file or model name"),
                ProposerOption(name="draft_quantization", choices=("int8", "q4"),
                               help="store the draft model's linear layers as int8 or 4-bit (CPU; "
                               "faster drafting, same output)"),
                ProposerOption(name="draft_confidence", type=float, default=0.0, metavar="C",
                               help="end a chain after a draft token the draft gives less than this "
                               "probability (0 <= c < 1; -k is then a ceiling; 0 always drafts -k)"),
            ),
        ),
        ProposerEntry(
            name="mtp",
            help="a trained MTP head on the target's hidden states drafts a chain",
            build=_build_mtp,
            options=(
                ProposerOption(name="mtp_head", metavar="DIR", required=True, selects=True,
                               help="the MTP head directory"),
            ),
        ),
        ProposerEntry(
            name="eagle",
            help="an EAGLE head drafts a tree; -k is the number of tree nodes verified",
            build=_build_eagle,
            num_speculative_tokens=16,
            options=(
                ProposerOption(name="eagle_head", metavar="DIR", required=True, selects=True,
                               help="the EAGLE-1/2 or EAGLE-3 head directory"),
                ProposerOption(name="tree_top_k", type=positive_int_arg, default=4, metavar="N",
                               help="children per expanded node of the tree"),
                ProposerOption(name="tree_depth", type=positive_int_arg, default=5, metavar="N",
                               help="tree depth"),
            ),
        ),
        ProposerEntry(
            name="prompt-lookup",
            help="n-gram lookup in the prompt and the text so far drafts a chain (no model)",
            build=_build_prompt_lookup,
            options=(
                ProposerOption(name="prompt_lookup", type=bool, selects=True,
                               help="speculate by prompt lookup (n-grams)"),
            ),
        ),
        ProposerEntry(
            name="suffix",
            help="suffix decoding: trees from suffix indexes of the prompt and of earlier outputs "
            "(no model); -k is the most tree nodes verified",
            build=_build_suffix,
            num_speculative_tokens=16,
            options=(
                ProposerOption(name="suffix_max_depth", type=positive_int_arg, default=24, metavar="N",
                               help="longest context suffix matched"),
                ProposerOption(name="suffix_spec_factor", type=float, default=1.0, metavar="X",
                               help="tree nodes per matched token (the speculation grows with the match)"),
                ProposerOption(name="suffix_min_token_prob", type=float, default=0.1, metavar="P",
                               help="draft no node whose estimated path probability is below P"),
                ProposerOption(name="suffix_draft", metavar="PATH",
                               help="also a draft model (SuffixHybrid): per request and step the suffix "
                               "tree or the draft's chain, whichever is expected to be faster"),
                ProposerOption(name="suffix_draft_quantization", choices=("int8", "q4"),
                               help="store --suffix-draft's linear layers as int8 or 4-bit (CPU)"),
                ProposerOption(name="suffix_draft_k", type=positive_int_arg, default=4, metavar="N",
                               help="longest chain --suffix-draft drafts"),
            ),
        ),
    )


def _build_draft(options: Mapping[str, object], context: BuildContext) -> Proposer:
    from specdec.proposers.draft_model import DraftModel

    return DraftModel.from_pretrained(
        options["draft"],
        num_speculative_tokens=options["num_speculative_tokens"],
        dtype=context.dtype,
        device=context.device,
        quantization=options["draft_quantization"],
        confidence_threshold=options["draft_confidence"],
    )


def _build_mtp(options: Mapping[str, object], context: BuildContext) -> Proposer:
    from specdec.proposers.mtp import MTPHead

    return MTPHead.from_pretrained(options["mtp_head"], num_speculative_tokens=options["num_speculative_tokens"])


def _build_eagle(options: Mapping[str, object], context: BuildContext) -> Proposer:
    from specdec.proposers.eagle import EAGLETree

    return EAGLETree.from_pretrained(
        options["eagle_head"],
        top_k=options["tree_top_k"],
        depth=options["tree_depth"],
        num_verify_tokens=options["num_speculative_tokens"],
    )


def _build_suffix(options: Mapping[str, object], context: BuildContext) -> Proposer:
    from specdec.proposers.suffix import SuffixDecoding

    suffix = SuffixDecoding(
        num_speculative_tokens=options["num_speculative_tokens"],
        max_depth=options["suffix_max_depth"],
        spec_factor=options["suffix_spec_factor"],
        min_token_prob=options["suffix_min_token_prob"],
    )
    if options.get("suffix_draft") is None:
        if options.get("suffix_draft_quantization") is not None:
            raise ValueError("suffix_draft_quantization needs suffix_draft (--suffix-draft PATH)")
        return suffix
    from specdec.proposers.draft_model import DraftModel
    from specdec.proposers.hybrid import SuffixHybrid

    draft = DraftModel.from_pretrained(options["suffix_draft"], num_speculative_tokens=options["suffix_draft_k"],
                                       dtype=context.dtype, device=context.device,
                                       quantization=options["suffix_draft_quantization"])  # fmt: skip
    return SuffixHybrid(draft, suffix)


def _build_prompt_lookup(options: Mapping[str, object], context: BuildContext) -> Proposer:
    from specdec.proposers.ngram import PromptLookup

    return PromptLookup(num_speculative_tokens=options["num_speculative_tokens"])
