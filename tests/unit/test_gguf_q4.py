"""A GGUF file's 4-bit blocks become q4 codes that dequantize to what gguf-py's reference
dequantization gives (exactly for Q4_0 and Q4_1; within float16 rounding of the scales for
Q4_K), and llama.cpp's q/k row order is undone for Llama."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.kernels.cpu_q4 import dequantize_q4

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

from specdec.models.gguf_q4 import _DECODERS, _reverse_permute_rows  # noqa: E402

BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 256}


def _random_blocks(kind: str, n: int, seed: int) -> np.ndarray:
    """Random bytes with finite, moderate float16 scales where the format keeps them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, BYTES[kind]), dtype=np.uint8)
    scales = 2 if kind == "Q4_0" else 4
    halves = (rng.standard_normal((n, scales // 2)) * 0.01).astype(np.float16)
    blocks[:, :scales] = halves.view(np.uint8).reshape(n, scales)
    return blocks


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_decoded_codes_dequantize_like_gguf(kind):
    rows, cols = 6, 512
    blocks = _random_blocks(kind, rows * cols // WEIGHTS[kind], 0)
    q, d, c = _DECODERS[kind](blocks)
    ours = dequantize_q4(
        torch.from_numpy(q).view(rows, cols // 32, 32),
        torch.from_numpy(d).view(rows, -1),
        torch.from_numpy(c).view(rows, -1),
        cols,
    )
    want = torch.from_numpy(
        dequantize(blocks.reshape(rows, -1), getattr(gguf.GGMLQuantizationType, kind))
    ).view(rows, cols).float()
    assert int(q.max()) <= 15
    if kind == "Q4_K":  # d * sc and dmin * m rounded to float16
        torch.testing.assert_close(ours, want, rtol=0, atol=float(want.abs().max()) * 2**-10)
        assert not torch.equal(ours, want)  # the rounding is real; the bound above is what holds
    else:
        assert torch.equal(ours, want)


def test_llama_row_order_is_undone():
    """llama.cpp stores Llama's q/k rows per head as [even..., odd...] pairs permuted; the
    inverse applied to codes gives back the original row order."""
    heads, rows_per_head = 2, 8
    rows = heads * rows_per_head
    original = torch.arange(rows)
    # convert_hf_to_gguf's permute: reshape(heads, 2, r/2).swapaxes(1, 2)
    stored = original.view(heads, 2, rows_per_head // 2).transpose(1, 2).reshape(-1)
    codes = (stored.view(rows, 1, 1).expand(rows, 1, 32).to(torch.uint8), stored.view(rows, 1), stored.view(rows, 1))
    q, d, c = _reverse_permute_rows(codes, heads)
    assert torch.equal(d.view(-1), original) and torch.equal(q[:, 0, 0].long(), original)
