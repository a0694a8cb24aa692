"""Packed-bf16 linear kernel for AVX2 CPUs, beside the pure-torch functions it must match.

On CPUs without native bf16 matrix instructions, PyTorch's bf16 GEMM runs far below the FMA
peak and its cost grows linearly with the number of rows, which makes a (k+1)-row verify pass
cost k+1 decode steps. :func:`pack_weight` lays a ``[out, in]`` bf16 weight out once in panels
of 16 output features (same bytes, new order); :func:`packed_linear` multiplies float32
activations with it through a small C++ kernel built on first use; :func:`packed_linear_reference`
is the pure-torch specification (unpack, float32 matmul). When the kernel cannot be built
(no AVX2/FMA/F16C, no compiler, ``SPECDEC_DISABLE_CPU_KERNEL=1``) :func:`load_kernel` returns ``None``
and models keep ordinary ``nn.Linear`` layers. Nothing is compiled at import time.

On CPUs with AVX512-BF16 (Zen 4, Sapphire Rapids and later) bf16 activations take the kernel's
``vdpbf16ps`` path (see cpu_linear.cpp): the same packed weights, float32 sums in another fixed
order (so other last bits than the FMA path, still bitwise independent of the row count), and
multi-row passes at about the cost of one. ``SPECDEC_DISABLE_BF16_DOT=1`` keeps the FMA path;
``SPECDEC_DISABLE_AVX512=1`` keeps every kernel (bf16, int8, 4-bit) on its AVX2 path, as on a CPU
without AVX-512 (read once per process).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

__all__ = [
    "PANEL",
    "pack_weight",
    "unpack_weight",
    "packed_linear",
    "packed_linear_reference",
    "load_kernel",
    "kernel_available",
    "build_key",
    "build_environment",
    "avx512_disabled",
    "bf16_dot_available",
    "bf16_dot_mode",
    "vnni_mode",
    "kernel_linear",
]

PANEL = 16
_log = logging.getLogger("specdec.kernels")
# One extension: the bindings live in cpu_decoder.cpp.
# ninja compiles in this order, as many at once as there are cores: the slowest first (the
# bindings, ~33 s alone on this project's 2-core runner), so that on two cores the other five
# (9-12 s each, cpu_aten.h) fill the second; with the bindings last they ran after the others.
_SOURCES = (
    "cpu_decoder.cpp", "cpu_quantized.cpp", "cpu_attention.cpp", "cpu_linear.cpp", "cpu_moe.cpp",
    "cpu_layer_ops.cpp",
)
_HEADERS = ("cpu_aten.h", "cpu_linear_call.h", "cpu_moe.h")  # included by the sources: copied beside them, part of the key
# Position j of a packed panel row holds feature _PANEL_ORDER[j] (see cpu_linear.cpp: the two
# AVX2 unpack instructions then produce features 0..7 and 8..15 in order).
_PANEL_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` bf16 -> ``[ceil(out / 16), in, 16]`` bf16 panels (zero-padded)."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = weight.new_zeros(panels * PANEL, in_features)
    padded[:out_features] = weight
    order = torch.tensor(_PANEL_ORDER, device=weight.device)
    return padded.view(panels, PANEL, in_features)[:, order].transpose(1, 2).contiguous()


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_weight`: ``[panels, in, 16]`` -> ``[out_features, in]``."""
    panels, in_features, _ = packed.shape
    inverse = torch.argsort(torch.tensor(_PANEL_ORDER, device=packed.device))
    rows = packed.transpose(1, 2)[:, inverse].reshape(panels * PANEL, in_features)
    return rows[:out_features]


def packed_linear_reference(
    x: torch.Tensor,  # [rows, in_features]
    packed: torch.Tensor,  # [panels, in_features, 16] bfloat16
    out_features: int,
) -> torch.Tensor:  # [rows, out_features] float32
    """The specification: float32 product of float32 activations with the bf16 weights."""
    return x.float() @ unpack_weight(packed, out_features).float().T


def _cpu_supports_avx2_fma_f16c() -> bool:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return {"avx2", "fma", "f16c"} <= flags


@functools.cache
def load_kernel() -> object | None:
    """Build (once per machine, kernel source and environment, cached on disk; a warning on the
    ``specdec.kernels`` logger says so before the ~40 s wait) and load the kernel."""
    if os.environ.get("SPECDEC_DISABLE_CPU_KERNEL") or not _cpu_supports_avx2_fma_f16c():
        return None
    try:  # everything, file I/O included: any failure falls back to the torch reference
        return _build_and_load()
    except Exception as err:  # noqa: BLE001
        warnings.warn(f"specdec CPU bf16 kernel unavailable, using torch: {err}", stacklevel=2)
        return None


_NAME = "specdec_cpu_kernels"
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-funroll-loops", "-fopenmp")
_LDFLAGS = ("-fopenmp",)


def build_key(sources: Sequence[bytes], environment: Mapping[str, str]) -> str:
    """12 hex digits naming one build: a pure function of the kernel sources' bytes and of
    ``environment`` (:func:`build_environment`), the same for the same inputs in any order of
    ``environment``'s items.

    >>> build_key([b"int f();"], {"python": "/venv-a/bin/python"}) == build_key(
    ...     [b"int f();"], {"python": "/venv-b/bin/python"})
    False
    """
    h = hashlib.sha256()
    for code in sources:
        h.update(hashlib.sha256(code).digest())  # per file: two files never read as one
    h.update(json.dumps(sorted(environment.items())).encode())
    return h.hexdigest()[:12]


def build_environment() -> dict[str, str]:
    """What makes two builds of the same sources differ: ``cpp_extension`` writes the
    interpreter's and torch's include and library paths, the compiler and the flags into the
    build folder's ``build.ninja``, and ninja rebuilds everything when that file changes. A
    folder shared by two virtual environments would be rebuilt (35-40 s) each time the other
    one loads it."""
    import sysconfig

    from torch.utils import cpp_extension

    return {
        "python": sys.executable,
        "prefix": sys.prefix,
        "python_include": sysconfig.get_paths()["include"],
        "torch": torch.__version__,
        "torch_include": os.pathsep.join(cpp_extension.include_paths()),
        "torch_lib": os.pathsep.join(cpp_extension.library_paths()),
        "cxx11_abi": str(torch.compiled_with_cxx11_abi()),
        "cxx": os.environ.get("CXX", "c++"),
        "cflags": " ".join(_CFLAGS),
        "ldflags": " ".join(_LDFLAGS),
    }


def _build_and_load() -> object:
    from torch.utils import cpp_extension

    from specdec.paths import kernel_builds_dir

    # Build from copies at a path keyed by the sources' content and the environment: every
    # checkout with the same kernel sources reuses one build per environment (ninja would
    # rebuild for a source at a new path, or for another environment's build.ninja), and
    # changed sources get a build of their own.
    here = Path(__file__).parent
    sources = [here / name for name in (*_SOURCES, *_HEADERS)]
    codes = [source.read_bytes() for source in sources]
    digest = build_key(codes, build_environment())
    build_dir = kernel_builds_dir() / f"cpu_kernels-{torch.__version__}-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    stable = []
    for source, code in zip(sources, codes):
        copy = build_dir / source.name
        if not copy.is_file() or copy.read_bytes() != code:
            # Written aside and renamed: a second process loading at the same moment (parallel
            # test workers, two servers starting) never compiles a half-written copy.
            tmp = build_dir / f".{source.name}.{os.getpid()}"
            tmp.write_bytes(code)
            os.replace(tmp, copy)
        if source.name in _SOURCES:
            stable.append(str(copy))
    built = (build_dir / f"{_NAME}.so").is_file()
    if not built:  # said before the wait, which may fall inside the caller's first generate()
        _log.warning(
            "building specdec CPU kernels (first use in this environment, about a minute) in %s", build_dir
        )
    start = time.perf_counter()
    kernel = cpp_extension.load(
        name=_NAME,
        sources=stable,
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )
    if not built:
        _log.warning("built specdec CPU kernels in %.1f s", time.perf_counter() - start)
    return kernel


def kernel_available() -> bool:
    return load_kernel() is not None


def bf16_dot_available() -> bool:
    """Whether bf16 activations take the kernel's AVX512-BF16 path on this machine."""
    kernel = load_kernel()
    return kernel is not None and bf16_dot_mode() == -1 and kernel.packed_has_bf16_dot()


@functools.cache
def avx512_disabled() -> bool:
    """Whether ``SPECDEC_DISABLE_AVX512`` asks every kernel for its AVX2 path: how a CPU without
    AVX-512 (this project's AVX2-only machines) decodes, reproducible on one that has it."""
    return bool(os.environ.get("SPECDEC_DISABLE_AVX512"))


@functools.cache
def bf16_dot_mode() -> int:
    """The kernel's ``bf16_dot`` argument: -1 (by the CPU) unless the environment disables it."""
    return 0 if os.environ.get("SPECDEC_DISABLE_BF16_DOT") or avx512_disabled() else -1


def vnni_mode() -> int:
    """The int8 / 4-bit kernels' ``use_vnni`` argument: -1 (by the CPU), 0 under
    ``SPECDEC_DISABLE_AVX512``."""
    return 0 if avx512_disabled() else -1


def kernel_linear(
    kernel: object | None,
    name: str,
    reference: Callable[..., torch.Tensor],
    x: torch.Tensor,  # [rows, in_features]
    weights: tuple[torch.Tensor, ...],
    out_features: int,
    bias: torch.Tensor | None,  # [out_features] float32
    out_dtype: torch.dtype,
    mode: int,
) -> torch.Tensor:  # [rows, out_features] out_dtype
    """``x @ W.T (+ bias)`` rounded to ``out_dtype`` through ``kernel`` (what :func:`load_kernel`
    returns), its function ``name(x, *weights, out_features, bias, out_bf16, mode)``: one call
    from Python, bias and rounding in C++; or, where the kernel is None or ``out_dtype`` neither
    float32 nor bfloat16, through ``reference(x, *weights, out_features)`` (float32) and torch."""
    if kernel is None or out_dtype not in (torch.float32, torch.bfloat16):
        out = reference(x, *weights, out_features)
        return (out if bias is None else out + bias).to(out_dtype)
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    call = getattr(kernel, name)
    return call(x.contiguous(), *weights, out_features, bias, out_dtype == torch.bfloat16, mode)


def packed_linear(
    x: torch.Tensor,  # [rows, in_features]
    packed: torch.Tensor,  # [panels, in_features, 16] bfloat16
    out_features: int,
    bias: torch.Tensor | None = None,  # [out_features] float32
    out_dtype: torch.dtype = torch.float32,
    bf16_dot: int | None = None,
) -> torch.Tensor:  # [rows, out_features] out_dtype
    """``x @ W.T (+ bias)`` in float32, rounded to ``out_dtype``, through the kernel (one call
    from Python: bias and rounding happen in C++) or the reference when it is unavailable.

    ``bf16_dot``: None follows the machine (the AVX512-BF16 path for bf16 ``x`` where the CPU
    has it, unless ``SPECDEC_DISABLE_BF16_DOT`` is set), 0 forces the FMA path, 1 the AVX512-BF16
    one (bf16 ``x``; an error on CPUs without it)."""
    if bf16_dot not in (None, 0, 1):
        raise ValueError(f"bf16_dot must be None, 0 or 1, got {bf16_dot!r}")
    kernel = load_kernel()
    if kernel is None and bf16_dot == 1:
        raise RuntimeError("bf16_dot=1 needs the CPU kernel, which is unavailable here")
    mode = bf16_dot_mode() if bf16_dot is None else bf16_dot
    return kernel_linear(
        kernel, "packed_linear_layer", packed_linear_reference,
        x, (packed,), out_features, bias, out_dtype, mode,
    )  # fmt: skip
