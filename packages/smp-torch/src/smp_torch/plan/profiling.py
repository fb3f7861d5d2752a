"""Measure a :class:`smp_partition.plan.Profile` on one process, without launching a job.

A few forward/backward passes of the user's step on the sample batch give: the module graph
smp's automatic partition sees (``smp_pipeline`` trace, FLOP-counted shares), the forward
and backward wall-clock time (medians), the time of a one-sample slice (what a microbatch
costs beyond its samples), the bytes each module saves for backward (autograd's saved-tensor
hooks, attributed to the innermost running module), the optimizer's state bytes and step
time per parameter (and what FSDP2 sharding adds to it and to a forward+backward per
parameter tensor, on a one-rank mesh), and the process's fixed memory (resident set
before the model exists, plus what a whole step's peak leaves unexplained).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import smp_partition
import torch
import torch.distributed as dist
from smp_partition.plan import CommModel, Profile
from smp_pipeline.checkpointing import checkpoint_in_place
from smp_pipeline.partition import trace_dict
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_leaves, tree_map

from smp_torch.plan.tensor_parallel import gathered_input_bytes, tensor_parallel_divisors

StepFn = Callable[[nn.Module, Any], torch.Tensor]
#: The profile's default ``memory_margin``, on everything but the persistent tensors
#: (parameters, gradients, optimizer state: long-lived, of fixed sizes): what glibc keeps
#: resident beyond the live bytes, and the rank-to-rank spread. Fitted on bench_plan's
#: stored grids so that no rank is above its prediction: gpt2-small needs 15.6 %,
#: llama-tied 15.3 % (0.4 % more for the profile's run-to-run spread). (13 % before the
#: optimizer's temporaries and the largest gradient were counted per stage, 1 Dec: they
#: took the optimizer's share out of the fixed bytes, where it had been charged on every
#: stage, and a huge embedding's stages without the table were predicted 20-30 % over.)
#: Out of sample, wide-vocab's grid would need 23 % (the driver stage, which receives its
#: head's logits and runs the loss on them: glibc keeps freed logits-sized buffers once
#: its dynamic mmap threshold has risen; with the threshold fixed, those ranks peak under
#: the prediction without any margin — performance.md).
MEMORY_MARGIN = 0.16


def default_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(batch)`` (``model(*batch)`` for a tuple/list), summed to a scalar loss."""
    out = model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
    if isinstance(out, torch.Tensor):
        return out.float().sum() if out.dim() else out
    if isinstance(out, Mapping) and "loss" in out:
        return out["loss"]
    raise TypeError("the model's output is not a tensor: pass step_fn(model, batch) -> loss")


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor."""
    leaves = [batch] if isinstance(batch, torch.Tensor) else list(_tensors(batch))
    if not leaves or leaves[0].dim() == 0:
        raise TypeError("sample_batch must hold a tensor with a batch dimension")
    return int(leaves[0].shape[0])


def _tensors(obj: Any) -> Sequence[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def slice_batch(batch: Any, n: int) -> Any:
    """The first ``n`` samples of every batched tensor of ``batch``."""
    size = batch_size_of(batch)
    return tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size else t, batch)


def rss_bytes() -> int:
    """This process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_since_reset() -> int | None:
    """Peak resident set since :func:`_reset_peak` (Linux's VmHWM), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        return True
    except OSError:
        return False


def peak_step_allocation(run: Callable[[], Any], frees_at_end: bool = False) -> int:
    """Peak bytes torch allocates during ``run()`` above what it held before (the CPU
    allocations torch's profiler records, replayed in order).

    Each op's own allocations (``self_cpu_memory_usage``): an event's ``cpu_memory_usage``
    includes its children's, so summing those counts a nested op once per enclosing op
    (measured on bench_plan's gpt2-small: 198 MiB against the true 50 MiB at 32 samples).
    An event's own net bytes are placed at its start; ``frees_at_end``: a net free at its end
    instead. An enclosing event's own frees are those of temporaries its children made (the
    optimizer step's record function frees each parameter's ``sqrt`` and ``div`` results:
    placed at its start they cancel them, and the step's peak reads 0 instead of one
    parameter-sized temporary); at the end they can only make the peak higher (safe).
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return replay_peak(
        (e.time_range.end if frees_at_end and e.self_cpu_memory_usage < 0 else e.time_range.start,
         e.self_cpu_memory_usage)
        for e in prof.events()
    )  # fmt: skip


def replay_peak(allocations: Iterable[tuple[float, int]]) -> int:
    """The peak of a running sum of (time, bytes allocated (+) or freed (-)) records, in
    time order, above the starting point (0 when nothing is allocated)."""
    now = peak = 0
    for _, nbytes in sorted(a for a in allocations if a[1]):
        now += nbytes
        peak = max(peak, now)
    return peak


def saved_bytes_per_module(model: nn.Module, run: Callable[[], Any]) -> dict[str, int]:
    """Bytes of the distinct tensors autograd saves during ``run()``, each counted once, on
    the innermost module running when it was saved; parameters' storages left out."""
    names = {id(m): n for n, m in model.named_modules()}
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[str] = [""]
    seen: set[int] = set()
    out: dict[str, int] = {}

    def pre(mod: nn.Module, _args: Any) -> None:
        stack.append(names[id(mod)])

    def post(_mod: nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip and ptr not in seen:
            seen.add(ptr)
            out[stack[-1]] = out.get(stack[-1], 0) + storage.nbytes()
        return t

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in handles:
            h.remove()
    return out


def default_checkpoint_units(model: nn.Module) -> tuple[str, ...]:
    """The members of the model's longest ``nn.ModuleList``/``nn.Sequential`` (its layers),
    and of every other list as long that is not inside one already taken: an
    encoder-decoder's two stacks (T5's ``encoder.block`` and ``decoder.block``) are both its
    layers, while a list inside a layer (T5's ``decoder.block.0.layer``, its sublayers) is not.
    """
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    longest = max((len(m) for _, m in lists), default=0)
    taken: list[str] = []
    units: list[str] = []
    for name, m in lists:  # parents before children (named_modules is pre-order)
        if not longest or len(m) != longest or any(name.startswith(f"{t}.") or not t for t in taken):
            continue
        taken.append(name)
        prefix = f"{name}." if name else ""
        units += [f"{prefix}{k}" for k, _ in m.named_children()]
    return tuple(units)


def warm_up_torch() -> None:
    """A few training steps of a one-layer model with Adam (the calibration's model): torch's
    one-time costs of a first step, paid before anything of the user's model is measured."""
    layer = nn.Linear(8, 8)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-4)
    for _ in range(3):
        opt.zero_grad()
        layer(torch.ones(4, 8)).sum().backward()
        opt.step()


def _checkpoint_unit_overhead_s(
    model_fn: Callable[[], nn.Module],
    step: StepFn,
    one: Any,
    units: Sequence[str],
    plain_run: Callable[[], Any],
    forward_per_sample_s: float,
    repeats: int,
) -> float:
    """Seconds each checkpointed unit adds to a microbatch beyond recomputing its forward:
    a one-sample step of a fresh copy with smp's checkpointing (smp_pipeline's
    ``checkpoint_in_place``, as a rank applies it) on ``units``, less the plain one-sample
    step ``plain_run`` (timed in turn with it) and the recomputed forward, per unit."""
    if not units:
        return 0.0
    model = model_fn()
    names = dict(model.named_modules())
    missing = [u for u in units if u not in names]
    if missing:
        raise ValueError(f"checkpoint unit {missing[0]!r} is not a module of the model")
    checkpoint_in_place(model, {u: None for u in units})

    def run() -> None:
        model.zero_grad(set_to_none=False)
        step(model, one).backward()

    run()
    ck_s, one_s = _paired_best_s([run, plain_run], repeats)
    return max(0.0, (ck_s - one_s - forward_per_sample_s) / len(units))


def sharding_overheads_s(
    model_fn: Callable[[], nn.Module],
    step: StepFn,
    one: Any,
    optimizer_fn: Callable[[Any], torch.optim.Optimizer],
    repeats: int,
) -> tuple[float, float]:
    """(optimizer step, forward+backward) seconds that FSDP2 sharding adds per parameter
    tensor: a fresh copy of the model under ``fully_shard`` on a one-rank mesh (a process
    group of this process alone, made and destroyed here), against a plain copy, each
    trained on one sample. The mesh's one rank moves no bytes, so what remains is the
    work a rank does per tensor whatever the degree: the optimizer's ops dispatched on
    DTensors, the copies out of the gathered buffer and into the reduce-scatter's, the
    hooks. (0, 0) where a process group already exists here (a launched job: its ranks
    would all have to join a new one) or torch has no distributed support."""
    if not dist.is_available() or dist.is_initialized():
        return 0.0, 0.0
    from torch.distributed.fsdp import fully_shard

    def trained(shard: bool) -> tuple[Callable[[], Any], Callable[[], Any], int]:
        model = model_fn()
        if shard:
            fully_shard(model, mesh=DeviceMesh("cpu", [0]))
        opt = optimizer_fn(model.parameters())

        def run() -> None:
            model.zero_grad(set_to_none=False)
            step(model, one).backward()

        run()
        opt.step()  # (the optimizer's state exists from here on)
        return opt.step, run, sum(1 for _ in model.parameters())

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            # FSDP2's advice about the model's outputs concerns a job, not this measurement
            # (smp's own sharding gives it there)
            warnings.simplefilter("ignore")
            plain_step, plain_fb, tensors = trained(False)
            shard_step, shard_fb, _ = trained(True)
            plain_opt, shard_opt = _paired_best_s([plain_step, shard_step], repeats)
            plain_run, shard_run = _paired_best_s([plain_fb, shard_fb], repeats)
    finally:
        dist.destroy_process_group()
    n = max(tensors, 1)
    return max(0.0, (shard_opt - plain_opt) / n), max(0.0, (shard_run - plain_run) / n)


def _check_on_cpu(model: nn.Module, batch: Any) -> None:
    """The profile times on the CPU's clocks and reads the process's resident set: a model
    or batch elsewhere (a GPU's asynchronous kernels, its own allocator) would be profiled
    as nothing, silently. Say so instead."""
    for what, tensors in (("the model's parameters and buffers", [*model.parameters(), *model.buffers()]),
                          ("the sample batch", _tensors(batch))):  # fmt: skip
        devices = sorted({str(t.device) for t in tensors if t.device.type != "cpu"})
        if devices:
            raise ValueError(
                f"smp.plan profiles on the CPU, and {what} are on {', '.join(devices)}: build "
                "the model and the batch on the CPU (the predictions are then for CPU ranks; "
                "a profile on a GPU, its kernels synchronised and its peaks read from the CUDA "
                "allocator, is not built yet)"
            )


def _clock() -> Callable[[], float]:
    """CPU time where torch runs on one thread (what the process itself spent, so other
    processes on a shared machine do not inflate it; the calibration's ``compute_scale``
    turns it into a rank's wall time), else wall time."""
    return time.process_time if torch.get_num_threads() == 1 else time.perf_counter


def _best_s(fn: Callable[[], Any], repeats: int) -> float:
    """Fewest seconds of ``repeats`` runs of ``fn()`` (:func:`_clock`). Other processes
    only ever add to a run's time, CPU time included (a shared core's caches, a
    hyperthread sibling), so the fastest run is the closest to the model's own cost; the
    median moved by up to 1.5x between profiles on the shared 2-core machine at load 1-10
    (llama-tied's one-sample step 8.8-15.2 ms, performance.md)."""
    return _paired_best_s([fn], repeats)[0]


def _paired_best_s(fns: Sequence[Callable[[], Any]], repeats: int) -> list[float]:
    """:func:`_best_s` of each of ``fns``, run in turn ``repeats`` times over: what the
    profile takes a difference of (a sharded copy against a plain one, a checkpointed one
    against the plain step) is timed under the same load, not minutes apart."""
    clock = _clock()
    best = [math.inf] * len(fns)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            t0 = clock()
            fn()
            best[k] = min(best[k], clock() - t0)
    return best


def profile_model(
    model_fn: Callable[[], nn.Module],
    sample_batch: Any,
    step_fn: StepFn | None = None,
    *,
    optimizer_fn: Callable[[Any], torch.optim.Optimizer] | None = None,
    checkpoint_units: Sequence[str] | None = None,
    tp_divisors: Mapping[str, int] | None = None,
    comm: CommModel | None = None,
    base_bytes: int | None = None,
    runtime_bytes: int | None = None,
    compute_scale: float = 1.0,
    memory_margin: float = MEMORY_MARGIN,
    repeats: int = 5,
) -> Profile:
    """Profile ``model_fn()`` on ``sample_batch`` (the global batch of one step) here.

    ``step_fn(model, batch) -> loss`` defaults to :func:`default_step`; ``optimizer_fn``
    (parameters → optimizer) to Adam. ``checkpoint_units`` defaults to the longest layer
    lists (:func:`default_checkpoint_units`), ``tp_divisors`` to what :func:`tensor_parallel_divisors` finds (modules marked
    for tensor parallelism). ``base_bytes`` (fixed memory per rank) defaults to this
    process's resident set before the model is built plus what the measured peak of a whole
    step leaves unexplained by parameters, gradients, optimizer state and saved activations.
    """
    step = step_fn or default_step
    # torch's first training step in a process (autograd engine, kernel libraries, their
    # buffers) grows the resident set by ~80 MiB whatever the model; a rank's fixed bytes
    # (``runtime_bytes``: bench_plan's calibration rank, which trained a one-layer model)
    # already hold it. Pay it here first, so what the model's own first step leaves
    # unexplained below is the model's share only (measured: 88 -> 9 MiB on gpt2-small,
    # 92 -> 15 MiB on wide-vocab; counted twice, every stage was predicted ~80 MiB over).
    warm_up_torch()
    rss0 = rss_bytes()
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}")
    batch = sample_batch
    size = batch_size_of(batch)
    _check_on_cpu(model, batch)
    make_opt = optimizer_fn or (lambda ps: torch.optim.Adam(ps, lr=1e-4))
    opt = make_opt(model.parameters())

    def fwd() -> torch.Tensor:
        return step(model, batch)

    def fwd_bwd(b: Any = batch) -> None:
        model.zero_grad(set_to_none=False)
        step(model, b).backward()

    one = slice_batch(batch, 1)
    # The first step, on one sample, in a fresh process: what the resident set grows by
    # beyond the tensors (kernel caches, allocator arenas) is a fixed cost of the model.
    _reset_peak()
    fwd_bwd(one)  # grads now exist, so later steps allocate nothing new for them
    opt.step()
    first_peak = _peak_rss_since_reset()
    state_bytes = sum(
        t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()
    )
    numel = sum(p.numel() for p in model.parameters())
    fwd_bwd()  # warm-up at the full batch before timing
    opt_s = _best_s(opt.step, repeats)
    with torch.no_grad():
        fwd_s = _best_s(fwd, repeats)
    # backward = (forward with graph + backward) - forward without graph
    both_s = _best_s(fwd_bwd, repeats)
    one_s = _best_s(lambda: fwd_bwd(one), repeats) if size > 1 else both_s
    # t(b) = overhead + b * per_sample: the overhead is what a microbatch costs regardless
    per_sample = (both_s - one_s) / (size - 1) if size > 1 else both_s
    overhead = max(0.0, one_s - per_sample)
    compute = max(both_s - overhead, 1e-9)
    # split the per-sample part as the full batch splits into forward and backward
    share = min(1.0, fwd_s / both_s) if both_s > 0 else 1 / 3
    fwd_s, bwd_s = compute * share, compute * (1 - share)

    saved = saved_bytes_per_module(model, fwd)
    graph = smp_partition.ModuleGraph.from_dict(trace_dict(model, run=fwd, costs="flops"))
    units = tuple(default_checkpoint_units(model) if checkpoint_units is None else checkpoint_units)
    unit_overhead = _checkpoint_unit_overhead_s(model_fn, step, one, units, lambda: fwd_bwd(one), fwd_s / size, repeats)
    shard_opt_s, shard_run_s = sharding_overheads_s(model_fn, step, one, make_opt, repeats)
    saved = {k: v for k, v in saved.items() if k in graph}
    divisors = dict(tensor_parallel_divisors(model) if tp_divisors is None else tp_divisors)
    with torch.no_grad():
        gathered = {k: v for k, v in gathered_input_bytes(model, fwd, divisors).items() if k in graph}
    param_bytes = max((p.element_size() for p in model.parameters()), default=4)
    # Peak tensor bytes of a forward+backward beyond what persists, at one sample and at the
    # whole batch: a fixed part and a part growing with the samples (the saved activations
    # and the backward's temporaries, which the profile spreads like the saved bytes).
    alloc_one = peak_step_allocation(lambda: fwd_bwd(one))
    alloc_all = peak_step_allocation(fwd_bwd) if size > 1 else alloc_one
    grow = (alloc_all - alloc_one) / (size - 1) if size > 1 else alloc_all
    transient_fixed = max(0.0, alloc_one - grow)
    transient = max(0.0, grow * size - sum(saved.values()))
    # Of the fixed part, a module's parameter gradient made before it is added into .grad
    # (at most the largest module's, one at a time): each stage holds its own largest's.
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    gradient_part = min(transient_fixed, float(largest * param_bytes))
    # The optimizer step's temporaries (torch's foreach Adam: a parameter-sized one), per
    # parameter element: every rank steps its own parameters (measured on a huge
    # embedding: 64 MiB for 64 MiB of parameters, which the fixed bytes held before).
    opt_transient = math.ceil(peak_step_allocation(opt.step, frees_at_end=True) / numel - 0.05) if numel else 0
    if base_bytes is None:
        explained = numel * (2 * param_bytes + opt_transient) + state_bytes + alloc_one
        unexplained = max(0, (first_peak or 0) - rss0 - explained)
        base_bytes = (rss0 if runtime_bytes is None else runtime_bytes) + unexplained
    return Profile(
        graph=graph,
        batch_size=size,
        forward_s=fwd_s,
        backward_s=bwd_s,
        saved_bytes=saved,
        tp_divisors=divisors,
        tp_gathered_bytes=gathered,
        checkpoint_units=units,
        checkpoint_unit_overhead_s=unit_overhead,
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=math.ceil(state_bytes / numel) if numel else 0,
        optimizer_transient_bytes=opt_transient,
        optimizer_s_per_param=opt_s / numel if numel else 0.0,
        shard_optimizer_s_per_tensor=shard_opt_s,
        shard_microbatch_s_per_tensor=shard_run_s,
        base_bytes=int(base_bytes),
        microbatch_overhead_s=overhead,
        comm=comm or CommModel(),
        compute_scale=compute_scale,
        step_transient_bytes=transient,
        step_transient_fixed_bytes=transient_fixed,
        step_transient_gradient_bytes=gradient_part,
        memory_margin=memory_margin,
    )
