"""What :func:`smp_tp.parallelize` did to each module, and why: one record per decision.

``parallelize(model, record=decisions)`` appends a :class:`TPDecision` for every module it
replaced and for every module holding parameters that it left whole (replicated on every
tensor-parallel rank), with the reason. A caller that passes a list also takes over telling
the user (smp-torch's report warns once, on rank 0, naming the remedy); without a list,
``parallelize`` warns itself, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Treatment", "Cause", "TPDecision"]


class Treatment(str, Enum):
    """How tensor parallelism treats one module."""

    #: A Megatron column → row block (``tp_register_block``): one collective pair per block.
    BLOCK = "block"
    #: The vocabulary-parallel embedding or output head (``tp_register_vocab_parallel``).
    VOCAB = "vocab-parallel"
    #: A whole layer replaced by a registered distributed implementation
    #: (``tp_register``, a built-in transformer layer, an ``nn.Embedding``/``nn.LayerNorm``).
    LAYER = "layer"
    #: An ``nn.Linear`` replaced alone: one collective per linear (the slow fallback).
    PER_LINEAR = "per-linear"
    #: Left whole: every tensor-parallel rank holds and computes all of it.
    REPLICATED = "replicated"


class Cause(str, Enum):
    """Why a module holding parameters stayed replicated."""

    #: It shares a parameter with a module outside it (a tied embedding and head), or is
    #: used at several places.
    SHARED = "shared"
    #: It subclasses a replaceable type (``nn.Embedding``...): smp-tp replaces exact types
    #: only, since a subclass may change the maths (Gemma2's scaled embedding).
    SUBCLASS = "subclass"
    #: Its class has a distributed implementation, which declined this instance (the reason
    #: is the converter's warning: GPT-2 with cross-attention, say).
    DECLINED = "declined"
    #: Its class has no distributed implementation (an RMSNorm, say): nothing to split.
    NO_MAPPING = "no-mapping"
    #: It is not marked for tensor parallelism.
    UNMARKED = "unmarked"


@dataclass(frozen=True)
class TPDecision:
    """One module's tensor-parallel treatment (paths as in the model ``parallelize`` returns)."""

    path: str
    #: The class name of the module before replacement.
    module_type: str
    treatment: Treatment
    #: In words; for a fallback, what the user can register to avoid it.
    reason: str
    #: Set for :attr:`Treatment.REPLICATED` only.
    cause: Cause | None = None
    #: For a fallback: the registration that avoids it (``"tp_register_block"``,
    #: ``"tp_register_vocab_parallel"``, ``"tp_register_with_module"``); None otherwise.
    remedy: str | None = None
