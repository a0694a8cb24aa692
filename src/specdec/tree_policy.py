"""Deprecated module: the tree sizer is :mod:`specdec.policy.tree`."""

from specdec.deprecation import moved_names

__getattr__ = moved_names(__name__, {"TreeSizer": "specdec.policy.tree:TreeSizer"})
