"""Counter-based noise for seeded sampling: a request's draws depend on (seed, position) only.

A seeded request chooses the token at position ``m`` (its index in prompt + output) as

    argmax_v  probs_m[v] / E_m[v],      E_m[v] = -log U_m[v],

where ``U_m`` is a SplitMix64 stream keyed by ``(seed, m)``: the exponential race, i.e. the
Gumbel-max trick, an exact draw from ``probs_m`` because the ``E_m[v]`` are independent Exp(1)
variables, fresh at every position. The noise being a function of ``(seed, m)`` alone, the
token at ``m`` depends on nothing but the request's own history: not on what shares its
batch, the order requests arrive in, preemption, the step's kind (prefill, plain, verify) or
how many tokens anyone drafted. A seeded request therefore emits exactly the tokens plain
decoding with that seed emits, with or without speculation: the verifier accepts drafts
while they equal these tokens (see :func:`specdec.verify.chain.coupled_verify`), and a
proposer that draws its drafts with the same noise agrees with them as often as its
distribution agrees with the target's.

The stream is plain integer arithmetic (no ``torch.Generator``), meant to be the same on every
device; :func:`uniforms_reference` is its pure-Python reference (the CPU path is tested
against it bit for bit; the CUDA path has not run yet).

Example:
    >>> noise = SeededNoise(seed=7, position=12)
    >>> race_sample(torch.tensor([[0.2, 0.8]]), [noise])  # [1] int64, a draw from [0.2, 0.8]
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

__all__ = ["SeededNoise", "exponential_noise", "race_sample", "row_key", "uniforms_reference"]

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (the golden ratio in 64 bits)
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix(z: int) -> int:
    """SplitMix64's finaliser on a Python int (the reference)."""
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def row_key(seed: int, position: int) -> int:
    """The unsigned 64-bit key of the noise at ``position`` of a request seeded with ``seed``."""
    return _mix((_mix((seed + _GAMMA) & _MASK64) + (position + 1) * _GAMMA) & _MASK64)


def uniforms_reference(key: int, vocab: int) -> list[float]:
    """Pure-Python reference of one row of :func:`exponential_noise`'s uniforms, in (0, 1)."""
    return [((_mix((key + (v + 1) * _GAMMA) & _MASK64) >> 11) + 0.5) * 2.0**-53 for v in range(vocab)]


def _srl(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _mix_tensor(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors; multiplication wraps modulo 2**64."""
    z = (z ^ _srl(z, 30)) * _signed(_MIX1)
    z = (z ^ _srl(z, 27)) * _signed(_MIX2)
    return z ^ _srl(z, 31)


@attrs.frozen
class SeededNoise:
    """The randomness of one seeded request, from token position ``position`` on.

    Passed wherever a row's ``torch.Generator`` would be (``ProposeContext.generators``, the
    sampler, the verifier): a row holding one chooses its token by :func:`race_sample` at
    ``position``; row ``j`` of a multi-row draw (verify rows, draft steps) at ``position + j``.
    """

    seed: int
    position: int  # index in prompt + output of the token this row chooses

    def shifted(self, offset: int) -> SeededNoise:
        """The same request ``offset`` tokens further on."""
        return SeededNoise(seed=self.seed, position=self.position + offset)

    def key(self, offset: int = 0) -> int:
        return row_key(self.seed, self.position + offset)


def exponential_noise(
    noises: Sequence[SeededNoise], count: int, vocab: int, device: torch.device | str
) -> torch.Tensor:
    """``[len(noises), count, vocab]`` float64 Exp(1) draws: row ``i``, step ``j`` is the
    noise at ``noises[i].position + j``."""
    keys = torch.tensor(
        [_signed(n.key(j)) for n in noises for j in range(count)], dtype=torch.int64, device=device
    )  # [rows * count]
    counters = torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _signed(_GAMMA)
    bits = _mix_tensor(keys[:, None] + counters[None, :])  # [rows * count, vocab] int64
    uniforms = (_srl(bits, 11).to(torch.float64) + 0.5) * 2.0**-53  # in (0, 1), never 0 or 1
    return (-torch.log(uniforms)).view(len(noises), count, vocab)


def race_sample(probs: torch.Tensor, noises: Sequence[SeededNoise]) -> torch.Tensor:
    """One token per row: ``argmax(probs / E)`` with the row's noise at its position.

    Args:
        probs: ``[rows, vocab]`` or ``[rows, count, vocab]`` float, non-negative weights
            (step ``j`` of a 3-d input uses the noise at ``position + j``).
        noises: one :class:`SeededNoise` per row.

    Returns:
        ``[rows]`` (or ``[rows, count]``) int64; ``-1`` for a row whose weights are not finite
        or all zero (there is no distribution to draw from).
    """
    squeeze = probs.dim() == 2
    weights = probs[:, None] if squeeze else probs  # [rows, count, vocab]
    rows, count, vocab = weights.shape
    if len(noises) != rows:
        raise ValueError(f"got {len(noises)} noises for {rows} rows")
    weights = weights.to(torch.float64)
    scores = weights / exponential_noise(noises, count, vocab, probs.device)
    tokens = scores.argmax(dim=-1)  # [rows, count]
    valid = torch.isfinite(weights).all(dim=-1) & (weights.sum(dim=-1) > 0)  # [rows, count]
    tokens = torch.where(valid, tokens, -1)
    return tokens[:, 0] if squeeze else tokens
