import doctest

import smp_partition


def test_version() -> None:
    assert smp_partition.__version__.count(".") == 2


def test_public_names_and_docstring_example() -> None:
    from smp_partition import ModuleGraph, PartitionResult, partition  # noqa: F401

    assert doctest.testmod(smp_partition).failed == 0
