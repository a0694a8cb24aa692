"""The float32 CPU attention kernel against the float64 torch reference, and its batch invariance.

Invariance is the kernel's reason to exist: a row of a multi-row verify pass must be bitwise
equal to the same row decoded alone, or speculative greedy decoding of a bf16 model drifts from
plain greedy decoding at near-ties. The negative control shows the invariance check catches
float32 ``scaled_dot_product_attention``, which is not invariant.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from specdec.attention import TorchAttentionBackend, cpu_backend
from specdec.attention.cpu_backend import CpuAttentionBackend
from specdec.interfaces import AttentionSpec
from specdec.kernels.cpu_linear import load_kernel
from specdec.kv import KVCacheManager, KVSpec, PageAllocator

pytestmark = pytest.mark.usefixtures("kernel")

# Root (row 0) with children 1 and 2; row 3 is a child of 1.
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
# (cached prefix, new rows, tree mask): a prefill, a decode, a verify chain, a tree, a 1-row prefill.
MIXED = ((0, 13), (21, 1), (9, 5), (10, 4, TREE), (0, 1))
# Common head dims, plus 21 and 40 for the kernel's other code paths (blocks of 16, of 8, a
# scalar tail).
HEAD_DIMS = (8, 21, 40, 64, 128)
# (Hq, Hkv): the kernel attends up to 3 query heads of a KV head together; GQA groups of 2, 1
# and 5 (= 3 + 2) cover every chunk size it uses.
HEADS = ((4, 2), (3, 3), (10, 2))
# Dtype of pages and q -> (rtol, atol) against float64: the final rounding plus float32 math.
TOLERANCES = {
    torch.bfloat16: (1e-2, 1e-4),
    torch.float16: (1.5e-3, 1e-4),
    torch.float32: (1e-5, 1e-5),
}


@attrs.frozen(eq=False)
class Scene:
    """Pages with random cached prefixes and one step's new rows, all float64."""

    kv: object  # ModelKV over a fragmented float64 pool
    spec: AttentionSpec
    shapes: tuple  # (prefix, new_rows[, tree]) per sequence, sequence id = position
    q: torch.Tensor  # [num_tokens, Hq, D] float64, the rows of the step over every sequence
    k: torch.Tensor  # [num_tokens, Hkv, D] float64
    v: torch.Tensor  # [num_tokens, Hkv, D] float64

    def layout(self, seq_ids=None):
        """The step over ``seq_ids`` (default all): each sequence's new rows, its tree if any."""
        seq_ids = list(range(len(self.shapes))) if seq_ids is None else seq_ids
        shapes = [self.shapes[s] for s in seq_ids]
        return self.kv.layout(
            seq_ids,
            [[0] * s[1] for s in shapes],
            [s[0] for s in shapes],
            positions=[list(range(s[0], s[0] + s[1])) for s in shapes],
            tree_masks=[s[2] if len(s) > 2 else None for s in shapes],
        )

    def rows(self, seq_id: int) -> slice:
        """Where ``seq_id``'s new rows sit among the step's rows."""
        start = sum(s[1] for s in self.shapes[:seq_id])
        return slice(start, start + self.shapes[seq_id][1])


def _scene(shapes, *, page_size=4, hq=4, hkv=2, d=8, window=None, seed=0) -> Scene:
    """A fragmented pool with random prefixes for ``shapes`` and the step's own K/V written."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-(s[0] + s[1]) // page_size) for s in shapes) + 8
    allocator = PageAllocator(num_pages)
    manager = KVCacheManager(allocator, page_size)
    kv = manager.add_pool(
        KVSpec(name="t", num_layers=1, num_kv_heads=hkv, head_dim=d, dtype=torch.float64)
    )
    # Take every page and give them back shuffled, so page tables are out of order.
    pages = allocator.allocate(num_pages)
    allocator.free([pages[i] for i in torch.randperm(num_pages, generator=g).tolist()])
    k_pages, v_pages = kv.layer(0)
    for sid, (prefix, new, *_) in enumerate(shapes):
        manager.add_sequence(sid)
        manager.reserve(sid, prefix + new)
        slots = torch.tensor(manager.slot_ids(sid, list(range(prefix))), dtype=torch.int64)
        k_pages.view(-1, hkv, d)[slots] = torch.randn(
            prefix, hkv, d, generator=g, dtype=torch.float64
        )
        v_pages.view(-1, hkv, d)[slots] = torch.randn(
            prefix, hkv, d, generator=g, dtype=torch.float64
        )
    total = sum(s[1] for s in shapes)
    # Scores of a few units: softmax weights spread over several slots, not one-hot.
    q = 2 * torch.randn(total, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(total, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(total, hkv, d, generator=g, dtype=torch.float64)
    spec = AttentionSpec(
        num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, sm_scale=d**-0.5, sliding_window=window
    )
    scene = Scene(kv=kv, spec=spec, shapes=tuple(shapes), q=q, k=k, v=v)
    # The step's own K/V too: a later step over some of its rows finds the earlier ones.
    slots = scene.layout().slot_mapping
    k_pages.view(-1, hkv, d)[slots] = k
    v_pages.view(-1, hkv, d)[slots] = v
    return scene


def _run(
    backend, scene: Scene, dtype: torch.dtype, *, seq_ids=None, rows=None, compute=None
) -> torch.Tensor:
    """One step of ``backend`` on the scene rounded to ``dtype`` (then cast to ``compute``).

    Pages are copied, so the scene stays as it is; it already holds the step's K/V, so a step
    over part of the rows sees the same earlier rows as the whole step.
    """
    compute = compute or dtype
    layout = scene.layout(seq_ids)
    rows = slice(None) if rows is None else rows
    k_pages, v_pages = (p.to(dtype).to(compute) for p in scene.kv.layer(0))
    q, k, v = (t[rows].to(dtype).to(compute) for t in (scene.q, scene.k, scene.v))
    return backend.run(backend.plan(layout, scene.spec), q, k, v, k_pages, v_pages)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
@pytest.mark.parametrize("window", [None, 6])
def test_mixed_batch_matches_float64_reference(dtype, d, page_size, hq, hkv, window):
    """Prefill, decode, verify-chain and tree rows in one call, fragmented pages."""
    scene = _scene(
        MIXED, page_size=page_size, hq=hq, hkv=hkv, d=d, window=window, seed=d + page_size
    )
    out = _run(CpuAttentionBackend(), scene, dtype)
    assert out.dtype == dtype and out.shape == scene.q.shape
    ref = _run(TorchAttentionBackend(), scene, dtype, compute=torch.float64)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)


def test_single_decode_row_without_mask_matches_reference():
    """batch 1, one row, no window: the plan has no mask and the kernel sees every slot."""
    scene = _scene([(300, 1)], hq=12, hkv=2, d=128, page_size=16, seed=3)
    assert CpuAttentionBackend().plan(scene.layout(), scene.spec).torch_plan.mask is None
    out = _run(CpuAttentionBackend(), scene, torch.bfloat16)
    ref = _run(TorchAttentionBackend(), scene, torch.bfloat16, compute=torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-4)


def _decode_mismatches(backend, dtype: torch.dtype, *, d: int, window: int | None = None) -> int:
    """How many rows of a verify pass differ bitwise from the same rows decoded one at a time.

    Sequence 2 (9 cached slots, 5 new rows) is verified inside a mixed batch; then each of its
    rows runs alone as a decode step: batch 1, one row, kv_len = its slot + 1.
    """
    scene = _scene(MIXED, hq=10, hkv=2, d=d, window=window, seed=11)
    seq, rows = 2, scene.rows(2)
    verify = _run(backend, scene, dtype)[rows]
    prefix = scene.shapes[seq][0]
    mismatches = 0
    for r in range(scene.shapes[seq][1]):
        one_row = attrs.evolve(
            scene,
            shapes=tuple((prefix + r, 1) if i == seq else s for i, s in enumerate(scene.shapes)),
        )
        row = rows.start + r
        alone = _run(backend, one_row, dtype, seq_ids=[seq], rows=slice(row, row + 1))
        mismatches += int(not torch.equal(alone[0], verify[r]))
    return mismatches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("window", [None, 6])
def test_verify_rows_bitwise_equal_decoded_rows(dtype, d, window):
    assert _decode_mismatches(CpuAttentionBackend(), dtype, d=d, window=window) == 0


def test_float32_sdpa_is_not_batch_invariant():
    """Negative control: the same check fails for float32 SDPA (the torch backend's float32 path),
    so the bitwise equality above is a property of the kernel, not of the setup."""
    assert _decode_mismatches(TorchAttentionBackend(), torch.float32, d=64) > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sequence_alone_equals_sequence_in_batch(dtype):
    """Each sequence's rows (trees included) are bitwise the same alone and in the mixed batch."""
    scene = _scene(MIXED, d=64, seed=5)
    batched = _run(CpuAttentionBackend(), scene, dtype)
    for sid in range(len(MIXED)):
        alone = _run(CpuAttentionBackend(), scene, dtype, seq_ids=[sid], rows=scene.rows(sid))
        assert torch.equal(alone, batched[scene.rows(sid)]), f"sequence {sid}"


def test_thread_count_does_not_change_results():
    scene = _scene(MIXED, d=128, hq=8, hkv=2, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(CpuAttentionBackend(), scene, torch.bfloat16)
        torch.set_num_threads(2)
        two = _run(CpuAttentionBackend(), scene, torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


class _Refusing:
    """Stands in for the kernel module where the kernel must not be called."""

    def paged_attention(self, *args):
        raise AssertionError("the kernel was called")


def test_float64_falls_back_to_reference(monkeypatch):
    scene = _scene(MIXED, seed=2)
    expected = _run(TorchAttentionBackend(), scene, torch.float64)
    monkeypatch.setattr(cpu_backend, "load_kernel", lambda: _Refusing())
    assert torch.equal(_run(CpuAttentionBackend(), scene, torch.float64), expected)


def test_missing_kernel_falls_back_to_reference(monkeypatch):
    scene = _scene(MIXED, seed=2)
    expected = _run(TorchAttentionBackend(), scene, torch.bfloat16)
    monkeypatch.setattr(cpu_backend, "load_kernel", lambda: None)
    assert torch.equal(_run(CpuAttentionBackend(), scene, torch.bfloat16), expected)


def test_kernel_writes_new_rows_into_pages():
    scene = _scene(MIXED, seed=4)
    layout = scene.layout()
    k_pages, v_pages = (p.to(torch.bfloat16) for p in scene.kv.layer(0))
    backend = CpuAttentionBackend()
    q, k, v = (t.to(torch.bfloat16) for t in (scene.q, scene.k, scene.v))
    backend.run(backend.plan(layout, scene.spec), q, k, v, k_pages, v_pages)
    hkv, d = scene.spec.num_kv_heads, scene.spec.head_dim
    assert torch.equal(k_pages.view(-1, hkv, d)[layout.slot_mapping], k)
    assert torch.equal(v_pages.view(-1, hkv, d)[layout.slot_mapping], v)


def _kernel_args(**changes):
    """Valid arguments for one sequence of 3 new rows over 5 slots, with ``changes`` applied
    (in the kernel's positional order)."""
    args = dict(
        q=torch.randn(3, 4, 8),
        k_slots=torch.randn(10, 2, 8),
        v_slots=torch.randn(10, 2, 8),
        row_seq=torch.zeros(3, dtype=torch.int64),
        row_index=torch.arange(3),
        kv_gather=torch.tensor([[9, 1, 4, 2, 7]]),
        kv_lens=torch.tensor([5]),
        mask=torch.ones(1, 1, 3, 5, dtype=torch.bool).tril(2),
        sm_scale=0.3,
    )
    args.update(changes)
    return args


def test_valid_kernel_arguments_run():
    out = load_kernel().paged_attention(*_kernel_args().values())
    assert out.shape == (3, 4, 8) and torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        (dict(q=torch.randn(3, 4, 8, dtype=torch.float64)), TypeError, "q must be float32"),
        (dict(v_slots=torch.randn(10, 2, 8).bfloat16()), TypeError, "share a dtype"),
        (dict(q=torch.randn(3, 3, 8)), ValueError, r"Hq \(3\) must be a multiple of Hkv \(2\)"),
        (dict(q=torch.randn(3, 4, 6)), ValueError, "head_dim of q"),
        (dict(v_slots=torch.randn(11, 2, 8)), ValueError, "must have the shape of k_slots"),
        (dict(row_seq=torch.zeros(3, dtype=torch.int32)), TypeError, "row_seq must be int64"),
        (dict(row_index=torch.arange(2)), ValueError, "one entry per query row"),
        (
            dict(row_seq=torch.tensor([0, 1, 0])),
            ValueError,
            r"row_seq\[1\] = 1 must lie in \[0, 1\)",
        ),
        (dict(kv_lens=torch.tensor([6])), ValueError, r"kv_lens\[0\] = 6 must lie in \[1, 5\]"),
        (
            dict(kv_gather=torch.tensor([[9, 1, 10, 2, 7]])),
            ValueError,
            "outside the pool of 10 slots",
        ),
        (dict(mask=torch.ones(1, 1, 3, 4, dtype=torch.bool)), ValueError, "mask must be"),
        (dict(mask=torch.ones(1, 1, 3, 5)), TypeError, "mask must be bool"),
        (dict(row_index=torch.tensor([0, 1, 3])), ValueError, "below the mask's max_q"),
        (
            dict(mask=torch.ones(1, 1, 3, 5, dtype=torch.bool).tril(-1)),
            ValueError,
            "row 0\\) sees no KV slot",
        ),
        (dict(sm_scale=float("nan")), ValueError, "sm_scale must be finite"),
    ],
)
def test_bad_kernel_arguments_raise(changes, error, message):
    with pytest.raises(error, match=message):
        load_kernel().paged_attention(*_kernel_args(**changes).values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tree_row_bitwise_equals_its_path_decoded(dtype):
    """A tree node's row sees the committed prefix and its ancestors, which sit in slots after
    siblings (tree order), not next to each other; once its path is committed the same keys are
    contiguous. The row's output must be bitwise what plain decoding of that path gives, or a
    bf16 greedy tree step flips near-ties (found on Qwen2.5-Coder-1.5B: an 8-node tree diverged
    from plain greedy at token 67, logits 0.01 apart)."""
    torch.manual_seed(5)
    hq, hkv, d, prefix = 12, 2, 128, 37
    mismatches = 0
    for _ in range(24):
        n = prefix + 9  # the prefix, then 9 tree rows; the node at tree row 8 has ancestors 1, 4
        k_slots = torch.randn(n, hkv, d).to(dtype)
        v_slots = torch.randn(n, hkv, d).to(dtype)
        q = torch.randn(1, hq, d).to(dtype)
        path = [*range(prefix + 1), prefix + 1, prefix + 4, prefix + 8]  # root's slot is prefix
        visible = torch.zeros(1, 1, 1, n, dtype=torch.bool)
        visible[0, 0, 0, path] = True
        args = dict(row_seq=torch.zeros(1, dtype=torch.int64), row_index=torch.zeros(1, dtype=torch.int64))
        tree = load_kernel().paged_attention(
            q, k_slots, v_slots, args["row_seq"], args["row_index"], torch.arange(n)[None],
            torch.tensor([n]), visible, 0.088,
        )  # fmt: skip
        decoded = load_kernel().paged_attention(
            q, k_slots, v_slots, args["row_seq"], args["row_index"], torch.tensor([path]),
            torch.tensor([len(path)]), None, 0.088,
        )  # fmt: skip
        mismatches += int(not torch.equal(tree, decoded))
    assert mismatches == 0
