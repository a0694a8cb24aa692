"""TreeShape's limits: a dynamic tree's expanded nodes need draft rows in the verify slots."""

from __future__ import annotations

import pytest

from specdec.proposers.tree_shape import TreeShape


@pytest.mark.parametrize(("top_k", "depth"), [(4, 5), (2, 5), (1, 3), (3, 1), (8, 2)])
def test_min_verify_tokens_is_the_smallest_shape_accepted(top_k, depth):
    n = TreeShape.min_verify_tokens(top_k, depth)
    assert TreeShape(top_k=top_k, depth=depth, num_verify_tokens=n).num_nodes == n
    if n > 1:
        with pytest.raises(ValueError, match="slots are reserved"):
            TreeShape(top_k=top_k, depth=depth, num_verify_tokens=n - 1)
