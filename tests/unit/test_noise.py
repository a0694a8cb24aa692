"""Position-keyed noise for seeded sampling: the torch stream equals its pure-Python
reference, races draw from the right distribution, and rows without a distribution draw -1."""

from __future__ import annotations

import torch
from helpers import chi_square_pvalue

from specdec.noise import SeededNoise, exponential_noise, race_sample, row_key, uniforms_reference
from specdec.sampling import sample_from_probs

F64 = torch.float64


def test_torch_stream_equals_the_python_reference():
    noises = [SeededNoise(seed=0, position=0), SeededNoise(seed=2**64 - 1, position=12345)]
    got = exponential_noise(noises, 3, 37, "cpu")  # [2, 3, 37]
    for i, n in enumerate(noises):
        for j in range(3):
            u = torch.tensor(uniforms_reference(row_key(n.seed, n.position + j), 37), dtype=F64)
            torch.testing.assert_close(got[i, j], -torch.log(u), rtol=0, atol=0)


def test_noise_depends_on_seed_and_position_only():
    a = exponential_noise([SeededNoise(seed=5, position=9)], 1, 50, "cpu")
    b = exponential_noise([SeededNoise(seed=5, position=7)], 3, 50, "cpu")[:, 2]
    assert torch.equal(a[:, 0], b)  # position 7 + 2 == position 9
    c = exponential_noise([SeededNoise(seed=6, position=9)], 1, 50, "cpu")
    assert not torch.equal(a, c)


def test_race_sample_draws_from_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0], dtype=F64)
    n = 20000
    noises = [SeededNoise(seed=s, position=3) for s in range(n)]
    tokens = race_sample(probs.expand(n, -1), noises)
    counts = torch.bincount(tokens, minlength=6).to(F64)
    assert counts[5] == 0
    assert chi_square_pvalue(counts, probs) > 1e-3
    # Successive positions of one seed are independent: the joint of two positions factorises.
    pairs = race_sample(probs.expand(n, 2, -1), [SeededNoise(seed=s, position=0) for s in range(n)])
    joint = torch.zeros(6, 6, dtype=F64)
    joint.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(n, dtype=F64), accumulate=True)
    assert chi_square_pvalue(joint, probs[:, None] * probs[None, :]) > 1e-3


def test_rows_without_a_distribution_draw_minus_one():
    probs = torch.tensor([[0.5, 0.5], [float("nan"), 1.0], [0.0, 0.0]])
    noises = [SeededNoise(seed=1, position=0)] * 3
    assert race_sample(probs, noises)[1:].tolist() == [-1, -1]
    assert sample_from_probs(probs, [None, None, None])[1:].tolist() == [-1, -1]


def test_sample_from_probs_mixes_seeded_rows_and_streams():
    probs = torch.softmax(torch.randn(4, 30, dtype=F64), dim=-1)
    seeded = SeededNoise(seed=9, position=4)
    gen = torch.Generator().manual_seed(0)
    tokens = sample_from_probs(probs, [seeded, gen, seeded.shifted(1), None])
    assert tokens[0] == race_sample(probs[:1], [seeded])[0]
    assert tokens[2] == race_sample(probs[2:3], [seeded.shifted(1)])[0]
    assert ((tokens >= 0) & (tokens < 30)).all()
