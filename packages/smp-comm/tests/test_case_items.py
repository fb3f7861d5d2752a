"""The per-case items of bundled MPI jobs (conftest.py) fail when they should."""

from __future__ import annotations

import pytest
from conftest import Job

# Two ranks' lines spliced together, as the launcher may print them.
OUT = "rank 0 CASE-OK [alpha]rank 1 CASE-OK [alpha]\n\nrank 0 CASE-OK [beta]\nrank 1 CASE-OK [beta-2]\n"


def test_reported_on_every_rank_passes(assert_case) -> None:
    assert_case(Job(OUT, None), "alpha", range(2))


def test_missing_rank_fails_naming_case_and_rank(assert_case) -> None:
    with pytest.raises(pytest.fail.Exception) as info:
        assert_case(Job(OUT, None), "beta", range(2))
    text = str(info.value)
    assert "case 'beta': ranks [1]" in text and "rank 0 CASE-OK [beta]" in text and OUT in text


def test_case_name_is_matched_whole(assert_case) -> None:
    with pytest.raises(pytest.fail.Exception):
        assert_case(Job(OUT, None), "bet", range(1))


def test_failed_job_fails_even_reported_cases(assert_case) -> None:
    with pytest.raises(pytest.fail.Exception) as info:
        assert_case(Job(OUT + "Traceback ...", "mpiexec ... exited 1; output:"), "alpha", range(2))
    assert "passed on every rank, but the job failed" in str(info.value)
    assert "exited 1" in str(info.value)
