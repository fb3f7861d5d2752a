"""Kept for import compatibility: these names live in :mod:`smp_pipeline.partition`."""

from smp_pipeline.partition import (
    BALANCE_SLACK,
    auto_assignment,
    check_shared_parameters,
    resolve_assignment,
)

__all__ = ["BALANCE_SLACK", "auto_assignment", "check_shared_parameters", "resolve_assignment"]
