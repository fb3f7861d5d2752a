import smp_partition


def test_version() -> None:
    assert smp_partition.__version__.count(".") == 2
