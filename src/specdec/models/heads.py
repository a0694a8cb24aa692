"""Deprecated module: the MTP head's network is :mod:`specdec.models.mtp_head` (``MTPModule``,
``MTPModuleConfig``), its shared file code :mod:`specdec.models.head_io`."""

from specdec.deprecation import moved_names

_NEW = "specdec.models.mtp_head"
__getattr__ = moved_names(
    __name__,
    {
        "MTPHeadModel": f"{_NEW}:MTPModule",
        "MTPHeadConfig": f"{_NEW}:MTPModuleConfig",
        "DRAFT_VOCAB_FILE": f"{_NEW}:DRAFT_VOCAB_FILE",
        "load_draft_vocab": f"{_NEW}:load_draft_vocab",
        "load_mtp_head": f"{_NEW}:load_mtp_head",
        "save_draft_vocab": f"{_NEW}:save_draft_vocab",
        "save_mtp_head": f"{_NEW}:save_mtp_head",
        "_plain_state_dict": "specdec.models.head_io:plain_state_dict",
    },
)
