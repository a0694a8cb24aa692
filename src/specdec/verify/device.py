"""Deprecated module: which verify kernels run is :mod:`specdec.verify.kernel_choice`."""

from specdec.deprecation import moved_names

_NEW = "specdec.verify.kernel_choice"
__getattr__ = moved_names(
    __name__,
    {name: f"{_NEW}:{name}" for name in ("KernelChoice", "check_kernel_choice", "stream_seeds", "seeded_keys", "use_triton")},
)
