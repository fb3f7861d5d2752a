import smp_comm


def test_version() -> None:
    assert smp_comm.__version__.count(".") == 2
