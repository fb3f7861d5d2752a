import smp_pipeline


def test_version() -> None:
    assert smp_pipeline.__version__.count(".") == 2
