"""Which kernels the verifiers run: the Triton device path or the torch references.

:class:`~specdec.verify.chain.ChainVerifier` and :class:`~specdec.verify.tree.TreeVerifier`
take ``kernels="auto" | "torch" | "triton"``. ``"auto"`` uses the kernels of
:mod:`specdec.kernels.triton.tree_verify` on CUDA when Triton is installed and the torch
references everywhere else; ``"triton"`` insists (on a CPU the kernels run under
``TRITON_INTERPRET=1``, which is how CI tests this path). The rules are the references' own:

- greedy and seeded rows take exactly the references' tokens (the seeded draw is the same
  SplitMix64 race, bit for bit), so greedy and seeded output is the same on every path;
- other sampled rows use the references' rejection rules with counter-based uniforms keyed by
  one 63-bit seed per sequence and step, drawn from the row's generator (the default RNG on
  the device for ``None``) with no host sync. Their draws therefore differ from the torch
  path's (which takes uniforms straight from the generator), their law does not.

Imports of Triton are lazy: importing this module never needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from specdec.noise import SeededNoise
from specdec.sampling import generator_runs

__all__ = ["KernelChoice", "check_kernel_choice", "stream_seeds", "use_triton", "seeded_keys"]

KernelChoice = Literal["auto", "torch", "triton"]
_CHOICES = ("auto", "torch", "triton")
_SEED_LIMIT = 2**63 - 1


def check_kernel_choice(kernels: str) -> str:
    if kernels not in _CHOICES:
        raise ValueError(f"kernels must be one of {_CHOICES}, got {kernels!r}")
    return kernels


def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(kernels: str, device: torch.device) -> bool:
    """Whether a verifier built with ``kernels`` runs the Triton kernels on ``device``."""
    if kernels == "torch":
        return False
    if kernels == "triton":
        if not _triton_installed():
            raise ImportError(
                "kernels='triton' needs Triton: pip install 'specdec[gpu]' (or triton>=3.0)"
            )
        return True
    return device.type == "cuda" and _triton_installed()


def stream_seeds(
    generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:  # [batch] int64 on device
    """One fresh seed per sequence for the counter-based uniforms of a sampled step.

    Drawn from the row's own generator (on that generator's device), or from the default RNG
    on ``device`` for ``None``; consecutive rows sharing a generator draw in one call, as
    :func:`~specdec.sampling.draw_uniforms` does. No host sync: the seeds stay on the device.
    """
    pieces: list[torch.Tensor] = []
    for start, end in generator_runs(generators):
        generator = generators[start]
        where = device if generator is None else generator.device
        draws = torch.randint(
            0, _SEED_LIMIT, (end - start,), generator=generator, device=where, dtype=torch.int64
        )
        pieces.append(draws.to(device, non_blocking=True))
    if not pieces:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.cat(pieces)


def seeded_keys(
    noises: Sequence[SeededNoise], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # [batch] int64 seeds (low 64 bits), [batch] positions
    """The seeds and row-0 positions of seeded sequences, for
    :func:`~specdec.kernels.triton.tree_verify.row_choices` (a host-to-device copy only)."""
    from specdec.kernels.triton.tree_verify import as_int64_bits

    seeds = as_int64_bits([n.seed for n in noises], device)
    positions = torch.tensor([n.position for n in noises], dtype=torch.int64, device=device)
    return seeds, positions


def tree_kernels():
    """The kernel module (imported on first use)."""
    from specdec.kernels.triton import tree_verify

    return tree_verify
