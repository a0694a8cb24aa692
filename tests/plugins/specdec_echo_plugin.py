"""A third-party proposer plug-in, outside the specdec package (tests/integration/test_proposer_plugin.py).

It registers ``echo`` through the ``specdec.proposers`` entry point: ``echo = specdec_echo_plugin:entry``.
"""

from __future__ import annotations

from pathlib import Path

from specdec.proposers import TokenListProposer
from specdec.proposers.registry import ProposerEntry, ProposerOption


class EchoProposer(TokenListProposer):
    """Drafts what followed the last earlier occurrence of the history's last token (a one-token
    lookup), and appends one line per draft call to ``log`` when given: proof that it ran."""

    def __init__(self, num_speculative_tokens: int = 4, *, log: str | None = None) -> None:
        super().__init__(num_speculative_tokens)
        self.log = None if log is None else Path(log)

    def draft(self, token_ids, k):
        tokens = list(token_ids)
        last = tokens[-1]
        for start in range(len(tokens) - 2, -1, -1):
            if tokens[start] == last:
                follow = tokens[start + 1 : start + 1 + k]
                break
        else:
            follow = [last] * k  # nothing to copy: guess a repeat (wrong drafts cost speed only)
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(f"{len(follow)}\n")
        return follow


def _build(options, context) -> EchoProposer:
    return EchoProposer(options["num_speculative_tokens"], log=options["echo_log"])


def entry() -> ProposerEntry:
    """The registry entry (a zero-argument callable, as the entry point may name)."""
    return ProposerEntry(
        name="echo",
        help="copies what followed the last token before (a test plug-in)",
        build=_build,
        num_speculative_tokens=3,
        options=(ProposerOption(name="echo_log", metavar="FILE", help="append one line per draft call to FILE"),),
    )


def clashing_entry() -> ProposerEntry:
    """An entry that takes a built-in's name: registering it must fail, naming both."""
    return ProposerEntry(name="draft", help="a second 'draft'", build=_build)


def broken_entry() -> object:
    """Not an entry at all: the registry must say which plug-in gave it."""
    return {"name": "broken"}
