"""Module-server pipeline runtime for arbitrary PyTorch module hierarchies."""

from smp_pipeline.__about__ import __version__
from smp_pipeline.actions import (
    Action,
    ActionKind,
    Phase,
    format_program,
    parse_program,
    validate_programs,
)
from smp_pipeline.checkpointing import add_checkpoint_context
from smp_pipeline.errors import (
    PipelineConfigError,
    PipelineError,
    PipelineInterruptedError,
    PipelineRemoteError,
    PipelineTimeoutError,
)
from smp_pipeline.executor import device_work
from smp_pipeline.microbatch import split_microbatches
from smp_pipeline.offload import ActivationOffloader, OffloadStats
from smp_pipeline.order import OrderChannel
from smp_pipeline.partition import static_graph_dict, trace, trace_dict
from smp_pipeline.runtime import PipelineRuntime, shutdown_runtimes
from smp_pipeline.schedule import Scheduler
from smp_pipeline.timeline import plot_timeline, to_chrome_trace, write_chrome_trace

__all__ = [
    "Action",
    "ActionKind",
    "Phase",
    "ActivationOffloader",
    "OffloadStats",
    "OrderChannel",
    "PipelineConfigError",
    "PipelineError",
    "PipelineInterruptedError",
    "PipelineRemoteError",
    "PipelineRuntime",
    "PipelineTimeoutError",
    "Scheduler",
    "__version__",
    "add_checkpoint_context",
    "device_work",
    "format_program",
    "parse_program",
    "plot_timeline",
    "shutdown_runtimes",
    "split_microbatches",
    "static_graph_dict",
    "to_chrome_trace",
    "trace",
    "trace_dict",
    "validate_programs",
    "write_chrome_trace",
]
