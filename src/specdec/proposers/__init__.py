"""Proposers: draft models, MTP and EAGLE heads, prompt lookup, suffix decoding (alone or with
a model, chosen per request: SuffixHybrid), drafts of another tokenizer (CrossTokenizerDraft),
and the base for user-defined ones."""

from specdec.proposers.base import TokenListProposer
from specdec.proposers.cross_tokenizer import CrossTokenizerDraft
from specdec.proposers.draft_model import DraftModel
from specdec.proposers.eagle import EAGLETree
from specdec.proposers.hybrid import SuffixHybrid
from specdec.proposers.mtp import MTPHead
from specdec.proposers.ngram import PromptLookup
from specdec.proposers.suffix import SuffixDecoding

__all__ = [
    "CrossTokenizerDraft", "DraftModel", "EAGLETree", "MTPHead", "PromptLookup", "SuffixDecoding", "SuffixHybrid",
    "TokenListProposer",
]
