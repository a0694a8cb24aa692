"""Deprecated names that still resolve: a module's ``__getattr__`` for names that moved or were
renamed, which warns and hands back the new object (never a copy of it).

Example, in a module whose contents moved::

    __getattr__ = moved_names(__name__, {"MTPHeadModel": "specdec.models.mtp_head:MTPModule"})
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping

__all__ = ["moved_names"]


def moved_names(
    module: str, targets: Mapping[str, str], use: Mapping[str, str] | None = None
) -> Callable[[str], object]:
    """A module-level ``__getattr__`` for ``module``: each old name in ``targets`` maps to
    ``"new.module:new_name"``; looking it up warns (``DeprecationWarning``) and imports the
    new object lazily (so old and new modules never import each other at load time).
    ``use``: what the warning tells users to use instead, where that is not the target itself
    (an old name kept as a thin variant of a new one)."""

    def __getattr__(name: str) -> object:
        target = targets.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        path, _, new_name = target.partition(":")
        instead = (use or {}).get(name, f"{path}.{new_name}")
        warnings.warn(f"{module}.{name} is deprecated; use {instead}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(path), new_name)

    return __getattr__
