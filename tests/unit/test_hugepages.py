"""Moving weights into the huge-page arena keeps every value, every tie and every output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from specdec.models.hugepages import huge_page_share, hugepage_buffer, move_to_hugepages


def _tied_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 64), nn.Linear(64, 300, bias=False))
    model[2].weight = model[0].weight  # tied, as LM heads often are
    model.register_buffer("table", torch.randn(128, 32))
    return model


def test_values_ties_and_outputs_survive_the_move():
    model = _tied_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 300, (5,))
    want = model(x)
    move_to_hugepages(model, min_bytes=1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model[2].weight is model[0].weight
    assert torch.equal(model(x), want)
    ptrs = sorted(t.data_ptr() for t in [*model.parameters(), *model.buffers()])
    assert ptrs[-1] - ptrs[0] < 2 * sum(t.numel() * t.element_size() for t in model.parameters()) + 2**20


def test_no_tensor_keeps_its_source_storage():
    """Small tensors (below the arena's 64 KiB) are copied as well: a model loaded from a
    memory-mapped file would otherwise keep the whole mapping resident next to the arena."""
    model = _tied_model()
    held = [*model.parameters(), *model.buffers()]  # alive: their addresses cannot be reused
    sources = {t.untyped_storage().data_ptr() for t in held}
    bias = model[1].bias.detach().clone()
    move_to_hugepages(model)  # only tensors of 64 KiB or more go to the arena
    assert torch.equal(model[1].bias, bias) and model[1].bias.requires_grad
    assert not sources & {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}


def test_buffer_is_aligned_and_zeroed():
    buf = hugepage_buffer(3 * 2**20 + 5)
    assert buf.numel() == 3 * 2**20 + 5 and buf.dtype == torch.uint8
    assert buf.data_ptr() % (2 << 20) == 0
    assert int(buf.max()) == 0


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs Linux /proc")
def test_buffer_is_private_memory_that_transparent_huge_pages_can_back():
    """A shared anonymous mapping (``mmap.mmap(-1, n)``'s default) is shmem: it follows
    ``shmem_enabled`` (often ``never``) rather than ``enabled = madvise``, and the weights got
    no huge page at all. The arena must be a private mapping."""
    buf = hugepage_buffer(4 << 20)
    address = buf.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        lo, hi = (int(v, 16) for v in span.split("-"))
        if lo <= address < hi:
            assert perms[3] == "p", f"arena mapped {perms} (shared), want private"
            return
    raise AssertionError("the arena's mapping is not in /proc/self/maps")


def test_huge_page_share_reads_the_mapping_holding_the_tensor(tmp_path):
    """Parsed from a smaps file: the mapping whose range holds the data, its AnonHugePages over
    its Size; None outside every mapping or without the file."""
    t = torch.zeros(4)
    a = t.data_ptr()
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"{a - 8192:x}-{a - 4096:x} rw-p 00000000 00:00 0\nSize:                  4 kB\nAnonHugePages:         4 kB\n"
        f"{a - 4096:x}-{a + 8192:x} rw-p 00000000 00:00 0\nSize:               8192 kB\nAnonHugePages:      2048 kB\n"
    )
    assert huge_page_share(t, str(smaps)) == 0.25
    assert huge_page_share(t, str(tmp_path / "missing")) is None
    smaps.write_text(f"{a + 4096:x}-{a + 8192:x} rw-p 00000000 00:00 0\nSize: 4 kB\nAnonHugePages: 0 kB\n")
    assert huge_page_share(t, str(smaps)) is None
    if Path("/proc/self/smaps").is_file():
        share = huge_page_share(hugepage_buffer(4 << 20))
        assert share is not None and 0.0 <= share <= 1.0
