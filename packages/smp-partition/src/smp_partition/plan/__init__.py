"""The planner's pure part: from a measured :class:`Profile` to a ranked :class:`Plan` of
configurations (pipeline, tensor, data and sharded-data degrees, microbatches, activation
checkpointing) with predicted step time and peak memory per stage. No torch; smp_torch.plan
measures the profile.
"""

from smp_partition.plan.estimate import Candidate, Estimate
from smp_partition.plan.profile import CommModel, Profile, synthetic_profile
from smp_partition.plan.search import PIN_KEYS, Plan, candidates, format_bytes, search

__all__ = [
    "PIN_KEYS",
    "Candidate",
    "CommModel",
    "Estimate",
    "Plan",
    "Profile",
    "candidates",
    "format_bytes",
    "search",
    "synthetic_profile",
]
