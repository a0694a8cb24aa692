"""Deprecated module: the EAGLE head's network is :mod:`specdec.models.eagle_head`, its files
(specdec's and the public EAGLE checkpoints) :mod:`specdec.models.eagle_checkpoints`."""

from specdec.deprecation import moved_names

_HEAD, _FILES = "specdec.models.eagle_head", "specdec.models.eagle_checkpoints"
__getattr__ = moved_names(
    __name__,
    {
        "EagleKind": f"{_HEAD}:EagleKind",
        "EagleHeadConfig": f"{_HEAD}:EagleHeadConfig",
        "EagleHeadModel": f"{_HEAD}:EagleHeadModel",
        "EagleLayer": f"{_HEAD}:EagleLayer",
        "default_target_layers": f"{_HEAD}:default_target_layers",
        "load_eagle_head": f"{_FILES}:load_eagle_head",
        "save_eagle_head": f"{_FILES}:save_eagle_head",
    },
)
