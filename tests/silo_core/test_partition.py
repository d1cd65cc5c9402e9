import numpy as np
import pytest

from silo_core.partition import (
    make_partition,
    partition_classes,
    partition_dirichlet,
    partition_iid,
    split_labeled_per_class,
)

# 10 classes of unequal size (50..95 items), shuffled, like a real pool after the hub's labels were taken out.
LABELS = np.random.default_rng(123).permutation(np.repeat(np.arange(10), np.arange(50, 100, 5)))


def assert_disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == n, "every item assigned exactly once"
    assert np.array_equal(np.sort(joined), np.arange(n))


def test_split_labeled_per_class_is_stratified_and_disjoint():
    labeled, rest = split_labeled_per_class(LABELS, 7, seed=0)
    assert np.bincount(LABELS[labeled]).tolist() == [7] * 10
    assert len(rest) == len(LABELS) - 70
    assert_disjoint_cover([labeled, rest], len(LABELS))
    again, _ = split_labeled_per_class(LABELS, 7, seed=0)
    other, _ = split_labeled_per_class(LABELS, 7, seed=1)
    assert np.array_equal(labeled, again)
    assert not np.array_equal(labeled, other)


def test_split_labeled_per_class_too_few():
    with pytest.raises(ValueError, match="class 0 has only 50 items"):
        split_labeled_per_class(LABELS, 51, seed=0)


def test_iid_sizes_differ_by_at_most_one():
    parts = partition_iid(1003, 10, seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1003
    assert_disjoint_cover(parts, 1003)
    assert all(np.array_equal(a, b) for a, b in zip(parts, partition_iid(1003, 10, seed=0), strict=True))
    assert not np.array_equal(parts[0], partition_iid(1003, 10, seed=1)[0])


def test_iid_impossible():
    with pytest.raises(ValueError, match="5 silos"):
        partition_iid(4, 5, seed=0)
    with pytest.raises(ValueError, match="at least 1"):
        partition_iid(4, 0, seed=0)


@pytest.mark.parametrize("num_silos,k", [(10, 2), (7, 3), (5, 2), (30, 1), (4, 10)])
def test_classes_exactly_k_per_silo_and_every_class_used(num_silos, k):
    parts = partition_classes(LABELS, num_silos, k, seed=0)
    assert_disjoint_cover(parts, len(LABELS))
    per_silo = [np.unique(LABELS[p]) for p in parts]
    assert all(len(c) == k for c in per_silo)
    assert set(np.concatenate(per_silo).tolist()) == set(range(10))
    # class popularity is balanced: every class is held by floor or ceil(num_silos * k / 10) silos
    holders = np.bincount(np.concatenate(per_silo), minlength=10)
    assert holders.max() - holders.min() <= 1


def test_classes_deterministic_and_varied():
    a = partition_classes(LABELS, 20, 2, seed=0)
    b = partition_classes(LABELS, 20, 2, seed=0)
    c = partition_classes(LABELS, 20, 2, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(not np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    pairs = {tuple(np.unique(LABELS[p])) for p in a}
    assert len(pairs) > 5, "silos do not all repeat the same few class pairs"


def test_classes_impossible_requests():
    with pytest.raises(ValueError, match="cannot cover all 10 classes"):
        partition_classes(LABELS, 4, 2, seed=0)
    with pytest.raises(ValueError, match="classes_per_silo"):
        partition_classes(LABELS, 4, 11, seed=0)
    tiny = np.array([0, 0, 1, 1])
    with pytest.raises(ValueError, match="class .* has 2 items but 3 silos"):
        partition_classes(tiny, 3, 2, seed=0)


def test_dirichlet_cover_min_size_and_determinism():
    parts = partition_dirichlet(LABELS, 10, alpha=0.3, seed=0, min_size=5)
    assert_disjoint_cover(parts, len(LABELS))
    assert min(len(p) for p in parts) >= 5
    again = partition_dirichlet(LABELS, 10, alpha=0.3, seed=0, min_size=5)
    other = partition_dirichlet(LABELS, 10, alpha=0.3, seed=1, min_size=5)
    assert all(np.array_equal(x, y) for x, y in zip(parts, again, strict=True))
    assert any(not np.array_equal(x, y) for x, y in zip(parts, other, strict=True))


def class_share_of_top_class(parts: list[np.ndarray]) -> float:
    """Mean over silos of the fraction of the silo's items that belong to its most common class."""
    return float(np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts]))


def test_dirichlet_alpha_controls_skew():
    skewed = class_share_of_top_class(partition_dirichlet(LABELS, 10, alpha=0.1, seed=0))
    mild = class_share_of_top_class(partition_dirichlet(LABELS, 10, alpha=100.0, seed=0))
    iid = class_share_of_top_class(partition_iid(len(LABELS), 10, seed=0))
    # uniform over 10 classes would put ~0.1-0.2 in the top class; alpha=0.1 silos are dominated by one class
    assert skewed > 0.4 and skewed > 2 * iid
    assert mild < 0.25 and iid < 0.25


def test_dirichlet_impossible():
    with pytest.raises(ValueError, match="alpha must be positive"):
        partition_dirichlet(LABELS, 3, alpha=0.0, seed=0)
    with pytest.raises(ValueError, match="exceeds"):
        partition_dirichlet(LABELS, 10, alpha=1.0, seed=0, min_size=100)


def test_make_partition_dispatch():
    assert_disjoint_cover(make_partition(LABELS, 6, "iid", 0), len(LABELS))
    parts = make_partition(LABELS, 6, "classes", 0, classes_per_silo=3)
    assert all(len(np.unique(LABELS[p])) == 3 for p in parts)
    assert_disjoint_cover(make_partition(LABELS, 6, "dirichlet", 0, alpha=0.5), len(LABELS))
    with pytest.raises(ValueError, match="'shards'"):
        make_partition(LABELS, 6, "shards", 0)
