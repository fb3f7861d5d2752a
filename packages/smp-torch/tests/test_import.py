import smp_torch


def test_version() -> None:
    assert smp_torch.__version__.count(".") == 2
