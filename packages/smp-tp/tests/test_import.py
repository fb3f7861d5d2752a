import smp_tp


def test_version() -> None:
    assert smp_tp.__version__.count(".") == 2
