"""Single-process tests: flattening, microbatch splitting, schedules, tracing."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from no_peers import NoPeers
from smp_pipeline import PipelineConfigError, Scheduler, split_microbatches, trace_dict
from smp_pipeline.messages import flatten, pack, unflatten, unpack_leaves
from smp_pipeline.timeline import to_chrome_trace
from torch import nn


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: object


def test_flatten_roundtrip_nested() -> None:
    t1, t2 = torch.randn(2), torch.randn(3, requires_grad=True)
    obj = {"x": (t1, [Pair(t2, "s"), 3]), "y": None}
    skel, tensors = flatten(obj)
    assert len(tensors) == 2 and tensors[1] is t2
    back = unflatten(skel, tensors)
    assert back["x"][0] is t1 and isinstance(back["x"][1][0], Pair) and back["x"][1][0].b == "s"
    packed = pack(obj, grad_enabled=True)
    assert packed.flags == [False, True]
    rebuilt, leaves = unpack_leaves(packed)
    assert len(leaves) == 1 and leaves[0].is_leaf and leaves[0].requires_grad


def step(x, y, meta):
    return x, y, meta


def test_split_microbatches() -> None:
    x = torch.arange(8).reshape(4, 2)
    y = {"t": torch.arange(12).reshape(2, 6)}
    mbs = split_microbatches(
        step, (x, y), {"meta": torch.ones(3)}, 2,
        non_split_inputs=["meta"], input_split_axes={"y": 1},
    )
    assert len(mbs) == 2
    (x0, y0), kw0 = mbs[0]
    assert x0.tolist() == [[0, 1], [2, 3]] and y0["t"].shape == (2, 3)
    assert kw0["meta"].shape == (3,)


def test_split_errors_name_the_input() -> None:
    # The one splitter (smp.step's too): each error names the argument and the remedy.
    with pytest.raises(
        PipelineConfigError,
        match=r"input 'x': size 3 along axis 0 is not divisible by microbatches=2; name it in "
        r"non_split_inputs",
    ):
        split_microbatches(step, (torch.zeros(3, 2), 1, 2), None, 2)
    with pytest.raises(PipelineConfigError, match=r"input 'y': split axis 2 is out of range"):
        split_microbatches(step, (torch.zeros(4), torch.zeros(4, 2), 2), None, 2, (), {"y": 2})
    with pytest.raises(PipelineConfigError, match="'nope' in non_split_inputs"):
        split_microbatches(step, (torch.zeros(4), 1, 2), None, 2, non_split_inputs=["nope"])


def test_split_walks_mappings_and_keeps_tuple_types() -> None:
    # A tokenizer's BatchEncoding is a UserDict, not a dict: its tensors are split too (they
    # used to go whole to every microbatch), and it comes back as its own type.
    batch = collections.UserDict(ids=torch.arange(4), size=torch.Size([4]))
    mbs = split_microbatches(step, (batch, 1, 2), None, 2)
    first = mbs[0][0][0]
    assert type(first) is collections.UserDict and first["ids"].tolist() == [0, 1]
    assert type(first["size"]) is torch.Size


def drain(s: Scheduler, script: list[str]) -> list[tuple[int, str]]:
    """Run a scheduler where every forward reaches backward at once and backward completes."""
    order = []
    while not s.done():
        a = s.next_action()
        assert a is not None, order
        order.append(a)
        mb, phase = a
        if phase == "forward":
            s.ready_for_backward(mb)
        else:
            s.completed_microbatch(mb)
    return order


def test_schedules() -> None:
    simple = drain(Scheduler("simple", 3, 5), [])
    assert simple == [(0, "forward"), (1, "forward"), (2, "forward"),
                      (0, "backward"), (1, "backward"), (2, "backward")]
    inter = drain(Scheduler("interleaved", 3, 5), [])
    assert inter == [(0, "forward"), (0, "backward"), (1, "forward"), (1, "backward"),
                     (2, "forward"), (2, "backward")]
    custom = [(0, "forward"), (1, "forward"), (1, "backward"), (0, "backward")]
    assert drain(Scheduler(custom, 2, 1), []) == custom
    with pytest.raises(PipelineConfigError, match="lacks"):
        Scheduler([(0, "forward")], 1, 1)
    with pytest.raises(PipelineConfigError, match="unknown schedule"):
        Scheduler("gpipe", 1, 1)


def test_next_backward_only_for_interleaved() -> None:
    """What may start before a preempted forward resumes: a ready backward, never a forward,
    and only where the policy would start that backward next anyway."""
    inter = Scheduler("interleaved", 3, 3)
    assert inter.next_backward() is None  # nothing ready: no forward either
    assert inter.next_action() == (0, "forward") and inter.next_action() == (1, "forward")
    inter.ready_for_backward(1)
    assert inter.next_backward() == (1, "backward")
    assert inter.next_backward() is None
    simple = Scheduler("simple", 2, 2)
    simple.next_action()
    simple.ready_for_backward(0)
    assert simple.next_backward() is None  # simple: backwards wait for the forwards
    custom = Scheduler([(0, "forward"), (1, "forward"), (0, "backward"), (1, "backward")], 2, 2)
    custom.next_action()
    custom.ready_for_backward(0)
    assert custom.next_backward() is None  # custom: the listed order only


def test_active_bound() -> None:
    s = Scheduler("interleaved", 4, 2)
    assert s.next_action() == (0, "forward") and s.next_action() == (1, "forward")
    assert s.next_action() is None  # two in flight
    s.ready_for_backward(0)
    assert s.next_action() == (0, "backward")
    s.completed_microbatch(0)
    assert s.next_action() == (2, "forward")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(3, 3)
        self.a = nn.Linear(3, 3)
        self.unused = nn.Linear(3, 3)
        self.head = nn.Linear(3, 3, bias=False)
        self.head.weight = self.a.weight

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def test_trace_order_times_and_tied_keys() -> None:
    g = trace_dict(Tiny(), (torch.randn(2, 3),))
    mods = {m["name"]: m for m in g["modules"]}
    assert mods[""]["children"] == ["a", "b", "head", "unused"]
    assert mods["head"]["params"] == {"a.weight": 9}
    assert mods["a"]["activation_bytes"] == 2 * 3 * 4
    assert mods[""]["forward_ms"] >= mods["a"]["forward_ms"] >= 0
    meta = trace_dict(Tiny(), (torch.randn(2, 3),), device="meta")
    assert all(m["forward_ms"] is None for m in meta["modules"])


class WithList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3, 3)
        self.blocks = nn.ModuleList([nn.Linear(3, 3) for _ in range(2)])
        self.embed = nn.Linear(3, 3)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_trace_places_module_lists_by_their_members() -> None:
    g = trace_dict(WithList(), (torch.randn(2, 3),))
    mods = {m["name"]: m for m in g["modules"]}
    assert mods[""]["children"] == ["embed", "blocks", "head"]
    blocks = mods["blocks"]["forward_ms"]
    assert blocks == pytest.approx(mods["blocks.0"]["forward_ms"] + mods["blocks.1"]["forward_ms"])


def test_static_graph_runs_nothing() -> None:
    from smp_pipeline import static_graph_dict

    g = static_graph_dict(Tiny())
    mods = {m["name"]: m for m in g["modules"]}
    assert mods[""]["children"] == ["b", "a", "unused", "head"]  # definition order
    assert mods["head"]["params"] == {"a.weight": 9} and mods["a"]["forward_ms"] is None


def test_trace_builds_partition_graph() -> None:
    smp_partition = pytest.importorskip("smp_partition")
    from smp_pipeline import trace

    graph = trace(Tiny(), (torch.randn(2, 3),))
    res = smp_partition.partition(graph, num_devices=2)
    assert res.assignment["a"] == res.assignment["head"]  # tied weight stays together


def test_chrome_trace() -> None:
    tr = to_chrome_trace([(0, 1, "blocks.0", "forward", 1.0, 1.5), (1, 1, "x", "backward", 1.2, 2.0)])
    spans = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert spans[0]["ts"] == 0 and spans[0]["dur"] == pytest.approx(5e5)
    assert spans[1]["tid"] == 1 and spans[1]["cat"] == "backward"


def test_single_rank_runtime_matches_plain_training() -> None:
    """pp=1: the runtime runs everything locally; microbatching + checkpointing keep grads."""
    pytest.importorskip("smp_comm")
    import copy

    import torch.nn.functional as F
    from smp_pipeline import PipelineRuntime

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    F.mse_loss(ref(x), y).backward()
    rt = PipelineRuntime(model, NoPeers(), 0, 1, assignment={}, checkpointing={"": "group_2"},
                         timeline=True)

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        rt.backward(loss)
        return loss

    for schedule in ("simple", "interleaved"):
        for p in model.parameters():
            p.grad = None
        losses = rt.run_step(step, (x, y), num_microbatches=4, schedule=schedule)
        assert torch.allclose(torch.stack(losses).mean(), F.mse_loss(ref(x), y))
        for (n, p), rp in zip(rt.named_local_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, rp.grad, rtol=1e-5, atol=1e-6), n
    assert rt.owned_modules() == [name for name, _ in model.named_modules()]
    sd = {k: v + 1 for k, v in ref.state_dict().items()}
    assert sorted(rt.load_state_dict_local(sd)) == sorted(sd)
    assert torch.equal(model[0].weight, sd["0.weight"])
    with pytest.raises(Exception, match="backward"):
        rt.backward(torch.ones(()))  # outside a step
    events = rt.timeline_events()
    assert {e[3] for e in events} == {"forward", "backward"}
    rt.close()


def test_timeline_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from smp_pipeline import plot_timeline

    events = [(r, mb, "m", ph, 0.01 * (mb + r), 0.01 * (mb + r) + 0.005)
              for r in range(2) for mb in range(3) for ph in ("forward", "backward")]
    path = tmp_path / "t.png"
    plot_timeline(events, str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_interrupt_ends_a_wait_for_a_rank_that_never_answers() -> None:
    """``PipelineRuntime.interrupt`` (another thread) ends the driver's wait for a stage that
    never serves, at once, with the reason given, and sends nothing to the other rank."""
    pytest.importorskip("smp_comm")
    import threading
    import time

    from smp_comm import CommTimeoutError
    from smp_comm.testing import LoopbackWorld
    from smp_pipeline import PipelineInterruptedError, PipelineRuntime
    from smp_pipeline.frames import decode
    from smp_pipeline.protocol import FwdReq

    world = LoopbackWorld(2)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    rt = PipelineRuntime(model, world.communicator(0), 0, 2, assignment={"": 0, "1": 1})

    def step(x):
        return model(x).sum()

    timer = threading.Timer(0.2, rt.interrupt, args=("rank 1 failed: it was killed",))
    timer.start()
    start = time.monotonic()
    with pytest.raises(PipelineInterruptedError, match="rank 1 failed: it was killed"):
        rt.run_step(step, (torch.randn(2, 4),))
    assert time.monotonic() - start < 5
    # The runtime stays interrupted; only the forward request ever reached rank 1.
    with pytest.raises(PipelineInterruptedError):
        rt.run_step(step, (torch.randn(2, 4),))
    peer = world.communicator(1)
    obj, _, _ = peer.irecv().wait(timeout=1)
    assert isinstance(decode(obj), FwdReq)
    with pytest.raises(CommTimeoutError):  # nothing else arrives: no abort was broadcast
        peer.irecv().wait(timeout=0.2)
    rt.close()
    world.close()


def test_late_contribution_warns_and_turns_early_folds_off() -> None:
    """A gradient of a microbatch that was already folded (its rank judged its backward
    complete too early) is still added, but warns, and from then on folds wait for the
    driver (``complete``): ``complete_locally`` and streaming are ignored."""
    from smp_pipeline.accumulation import ALL_PARAMETERS, GradAccumulator

    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    mb: list[int | None] = [None]
    acc = GradAccumulator(lambda: mb[0], streamable=lambda: ALL_PARAMETERS)
    acc.track([w])
    acc.begin(1)
    mb[0] = 0
    (w * 3.0).sum().backward()  # microbatch 0, streamed (single run, nothing earlier)
    assert torch.equal(w.grad, torch.tensor([3.0, 3.0]))
    acc.complete_locally(1, 0)
    with pytest.warns(RuntimeWarning, match="after it was folded"):
        (w * 0.5).sum().backward()  # microbatch 0 again: late
    assert not acc.early and torch.equal(w.grad, torch.tensor([3.5, 3.5]))
    mb[0] = 1
    (w * 2.0).sum().backward()  # no streaming any more: buffered until complete()
    assert torch.equal(w.grad, torch.tensor([3.5, 3.5]))
    acc.complete_locally(1, 1)
    assert torch.equal(w.grad, torch.tensor([3.5, 3.5]))
    acc.complete(1, 1)
    assert torch.equal(w.grad, torch.tensor([5.5, 5.5]))
    acc.end()


def test_streaming_keeps_each_parameters_microbatch_order() -> None:
    """Where every microbatch is one engine run, a parameter's contribution goes straight
    into ``.grad`` once its contributions of all earlier unfolded microbatches did: here
    microbatch 1 reaches ``a`` after microbatch 0 did (streamed before 0 is complete) but
    ``b`` before microbatch 0 did (buffered, folded when 1 completes). Fold hooks see each
    parameter's microbatches in order; the sums equal adding them in microbatch order."""
    from smp_pipeline.accumulation import ALL_PARAMETERS, GradAccumulator

    a, b = nn.Parameter(torch.tensor([1.0])), nn.Parameter(torch.tensor([2.0]))
    mb: list[int | None] = [None]
    acc = GradAccumulator(lambda: mb[0], streamable=lambda: ALL_PARAMETERS)
    acc.track([a, b])
    seen: list[tuple[str, float]] = []
    acc.register_fold_hook(a, lambda p: seen.append(("a", p.grad.item())))
    acc.register_fold_hook(b, lambda p: seen.append(("b", p.grad.item())))
    acc.begin(1)
    mb[0] = 0
    (a * 0.1).sum().backward()  # a of 0: streamed
    mb[0] = 1
    (a * 0.2).sum().backward()  # a of 1: streamed (a of 0 is in .grad)
    (b * 0.3).sum().backward()  # b of 1: buffered (b of 0 is not)
    assert seen == [("a", pytest.approx(0.1)), ("a", pytest.approx(0.3))] and b.grad is None
    mb[0] = 0
    (b * 0.4).sum().backward()  # b of 0: streamed
    acc.complete(1, 0)
    acc.complete(1, 1)  # b of 1 folded
    acc.end()
    assert [n for n, _ in seen] == ["a", "a", "b", "b"]
    assert torch.equal(a.grad, torch.tensor([0.1]) + torch.tensor([0.2]))
    assert torch.equal(b.grad, torch.tensor([0.4]) + torch.tensor([0.3]))
    assert acc.early


def test_streamed_contributions_are_added_by_autograd_itself() -> None:
    """A streamed contribution is added to ``.grad`` by AccumulateGrad (the pre-hook leaves
    ``.grad`` in place), not taken aside and added in Python: no ``_add_to_grad`` call for
    it, fold hooks still run once per microbatch, and the sum is bitwise the in-order one. A
    buffered contribution still goes aside (folded by ``_add_to_grad``)."""
    from smp_pipeline.accumulation import ALL_PARAMETERS, GradAccumulator

    w = nn.Parameter(torch.tensor([1.0, 2.0]))
    mb: list[int | None] = [None]
    acc = GradAccumulator(lambda: mb[0], streamable=lambda: ALL_PARAMETERS if mb[0] != 2 else frozenset())
    acc.track([w])
    added: list[float] = []
    add = acc._add_to_grad
    acc._add_to_grad = lambda p, g: (added.append(g.sum().item()), add(p, g))  # type: ignore[method-assign]
    folds: list[float] = []
    acc.register_fold_hook(w, lambda p: folds.append(p.grad.sum().item()))
    acc.begin(1)
    for k, c in enumerate((0.1, 0.2, 0.3)):
        mb[0] = k
        (w * c).sum().backward()  # 0 and 1 streamed; 2 is not one engine run: buffered
    assert added == [] and folds == [pytest.approx(0.2), pytest.approx(0.6)]
    acc.complete(1, 0)
    acc.complete(1, 1)
    acc.complete(1, 2)
    acc.end()
    assert added == [pytest.approx(0.6)] and len(folds) == 3
    want = torch.full((2,), 0.1) + torch.full((2,), 0.2) + torch.full((2,), 0.3)
    assert torch.equal(w.grad, want)


def test_streamable_parameters_of_a_microbatch() -> None:
    """To which parameters a context's backward gives their only contribution of its
    microbatch here (CallRecords.streamable): all where it is the microbatch's only context;
    with several served calls (one request per block of a ModuleList loop), the parameters of
    its modules no other call holds; none where its backward is not one engine run, or the
    step function runs here too (it may use any parameter)."""
    from smp_pipeline.accumulation import ALL_PARAMETERS
    from smp_pipeline.autograd import CallRecords, IncomingCall

    def call(records: CallRecords, n: int, params: set[int], mb: int = 0) -> IncomingCall:
        rec = IncomingCall(1, mb, (0, n), f"h.{n}", [])
        rec.params, rec.once = frozenset(params), True
        records.add_incoming(rec)
        return rec

    records = CallRecords(1)
    alone = call(records, 0, {1, 2}, mb=1)
    assert records.streamable(alone) is ALL_PARAMETERS  # the only call: every parameter
    a, b, c = call(records, 1, {3, 4}), call(records, 2, {4, 5}), call(records, 3, {6})
    c.once = False  # asked more than once (its caller's backward is not one engine run)
    # 4: a parameter both a and b hold (tied, or a module both run).
    assert records.streamable(a) == {3} and records.streamable(b) == {5}
    assert not records.streamable(c)
    a.params = frozenset({3, 4, 5})
    assert records.streamable(a) == {3}  # kept: asked once, after the forward
    driver = CallRecords(0)
    root = driver.new_root(1, 0)
    assert driver.streamable(root) is ALL_PARAMETERS  # the driver's own step
    served = call(driver, 0, {1})
    root.streams = None
    assert not driver.streamable(root) and not driver.streamable(served)


def test_frame_roundtrip_every_message_kind() -> None:
    """A message whose tensors fit goes as one byte frame (smp-comm's fast path) and comes
    back equal: fields, skeleton, flags, and every tensor's dtype, shape and values (each
    its own tensor, not a view of another); one that does not fit stays a tuple."""
    from smp_pipeline.frames import decode, encode, wire_code
    from smp_pipeline.messages import Packed
    from smp_pipeline.protocol import (
        Abort,
        BwdReq,
        BwdResp,
        FwdReq,
        FwdResp,
        MbDone,
        StallQuery,
        StepEnd,
        has_payload,
        to_wire,
    )  # fmt: skip

    tensors = [
        torch.randn(3, 5),
        torch.arange(6, dtype=torch.int64).reshape(2, 3).t(),  # not contiguous
        torch.randn(4, dtype=torch.float64),
        torch.randn(2, 3).to(torch.bfloat16),
        torch.tensor(2.5),  # 0-d
        torch.empty(0, 4),
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.complex64),
        torch.randn(7).half(),
    ]
    skeleton, _ = flatten(((tuple(tensors), "s", 3), {"k": None}))
    packed = Packed(skeleton, tensors, [i % 2 == 0 for i in range(len(tensors))])
    messages = [
        FwdReq(1, (1, 7), "a.b", 3, 2, True, [("cpu", "bfloat16")], False, ("a.b.0", "a.b.1"),
               ((2, ("a.b.2",)), (3, ("a.b.3", "a.b.4"))), (("a.c", True), ("a.d", False)), packed),
        FwdResp(0, (1, 7), 3, 2, packed),
        BwdReq(1, (1, 7), 4, "a.b", 3, 2, True, False, packed),
        BwdResp(0, (1, 7), 4, 3, 2, packed),
        MbDone(0, 3, 2),
        StepEnd(0, 3, packed),
        Abort(2, 5, "error", "boom\ntraceback"),
        StallQuery(1, 9),
    ]  # fmt: skip
    for msg in messages:
        frame = encode(msg)
        assert isinstance(frame, torch.Tensor) and frame.dtype == torch.uint8
        want = to_wire(msg)
        assert wire_code(frame) == want[0]
        back = decode(frame.clone())  # (a received frame is a copy)
        assert type(back) is type(msg)
        got = to_wire(back)
        if not has_payload(want[0]):
            assert got == want
            continue
        assert got[:-1] == want[:-1]
        (skel, ts, flags), (skel0, ts0, flags0) = got[-1], want[-1]
        assert skel == skel0 and flags == flags0 and len(ts) == len(ts0)
        for a, b in zip(ts, ts0):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        ts[0].add_(1)  # in place on one received tensor: the others' versions stay
        assert all(t._version == 0 for t in ts[1:])
    # Too large for the frame, or not a CPU tensor of a known kind: the plain tuple.
    big = FwdResp(0, (1, 7), 3, 2, Packed(None, [torch.zeros(2048)], [False]))
    assert type(encode(big)) is not tuple  # 8 KiB: within the default limit
    assert type(encode(big, limit=4096)) is tuple and type(decode(encode(big, limit=4096))) is FwdResp
    big = FwdResp(0, (1, 7), 3, 2, Packed(None, [torch.zeros(65537)], [False]))
    assert type(encode(big)) is tuple and type(decode(encode(big))) is FwdResp
    assert type(encode(MbDone(0, 3, 2), limit=0)) is tuple
    sparse = FwdResp(0, (1, 7), 3, 2, Packed(None, [torch.eye(2).to_sparse()], [False]))
    assert type(encode(sparse)) is tuple


def test_local_subtrees_match_their_definition() -> None:
    from smp_pipeline.dispatch import local_subtrees

    shared = nn.Linear(2, 2)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(2, 2), shared),  # "0": shared child owned by "0.1"'s rank
        nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), shared)),  # "1"
        nn.Linear(2, 2),  # "2"
    )
    paths = [p for p, _ in model.named_modules()]
    for owners in ({"1": 1, "1.0": 1, "1.1": 1, "1.1.0": 1}, {"1.1.0": 1, "2": 1}, {"0.1": 1}):
        assignment = {p: owners.get(p, 0) for p in paths}
        for rank in (0, 1):
            modules = dict(model.named_modules())
            canon = {id(m): p for p, m in reversed(list(model.named_modules()))}
            want = {p for p, m in modules.items()
                    if all(assignment[canon[id(s)]] == rank for s in m.modules())}
            assert local_subtrees(model, assignment, rank) == want, (owners, rank)


def test_sequential_plan_relays() -> None:
    """fast_mode's plan: consecutive runs on several other ranks are one relay (a rank at
    most once in it), a lone run between local children stays a request, and with relays
    off every run goes through the container's rank."""
    from smp_pipeline import seqruns
    from smp_pipeline.seqruns import Relay, plan_sequential
    from torch import nn

    seq = nn.Sequential(*(nn.Linear(2, 2) for _ in range(9)))
    canon = {id(c): str(i) for i, c in enumerate(seq)}
    owners = [0, 1, 1, 2, 3, 1, 0, 2, 2]
    assignment = {str(i): r for i, r in enumerate(owners)}

    def plan() -> list:
        return plan_sequential(seq, canon, assignment, 0, lambda _c, _p: False).flat

    items = plan()
    assert items[0] is seq[0] and items[3] is seq[6]
    # 1,2 on rank 1 -> 3 on rank 2 -> 4 on rank 3; then rank 1 again starts a new request.
    assert items[1] == Relay(((1, ("1", "2")), (2, ("3",)), (3, ("4",))))
    assert items[2] is seq[5]  # a lone remote child: its own request
    assert items[4] == (2, ("7", "8"))
    seqruns.RELAY = False
    try:
        items = plan()
    finally:
        seqruns.RELAY = True
    assert not any(isinstance(i, Relay) for i in items)
    assert items[1] == (1, ("1", "2")) and items[2] is seq[3] and items[3] is seq[4]


def test_device_queue_runs_blocks_in_queue_order() -> None:
    """Device work runs in the order it was queued (one stream), not in the order the OS
    wakes the waiting threads: waiters queued 0..7 and started in reverse order take the
    device 0..7. Each waiter then holds it a moment, so a lock handing it to any waiter
    would show up as another order."""
    import threading
    import time

    from smp_pipeline.worker import DeviceQueue

    device = DeviceQueue()
    assert device.queue() is None  # free: now this thread's
    order: list[int] = []
    places = [device.queue() for _ in range(8)]
    assert all(p is not None for p in places)

    def run(i: int) -> None:
        DeviceQueue.wait(places[i])
        order.append(i)
        time.sleep(0.002)
        device.leave()

    threads = [threading.Thread(target=run, args=(i,)) for i in reversed(range(8))]
    for t in threads:
        t.start()
    time.sleep(0.05)  # every waiter blocked on its place
    assert order == []
    device.leave()
    for t in threads:
        t.join(timeout=10)
    assert order == list(range(8))
    assert device.queue() is None  # the last one left: free again


def test_resume_ready_lets_an_older_yielded_forward_go_first() -> None:
    """A forward that gave the token back at a yield point goes before a ready worker of a
    younger microbatch (whose stage-1 response the yield let in): resumed first, the younger
    one reached ``backward(loss)`` first, and deterministic accumulation buffered its
    gradients instead of streaming them (docs/performance.md). Before: the ready one first."""
    import types

    from smp_pipeline.actions import FORWARD
    from smp_pipeline.executor import Executor
    from smp_pipeline.worker import Baton, Task

    ex = Executor(0, None, Baton())  # type: ignore[arg-type]  (no task runs: switch is faked)
    order: list[int] = []
    ex.switch = lambda w: order.append(w.task.mb)  # type: ignore[method-assign]

    def worker(mb: int, step: int = 1) -> types.SimpleNamespace:
        return types.SimpleNamespace(task=Task(lambda t: None, mb, "<step>", FORWARD, None, step, None))

    ex.yielded.extend([worker(0), worker(2)])
    ex.ready.extend([(worker(1), "response"), (worker(3), "response")])
    ex.resume_ready()  # microbatch 0's forward yielded: it goes before the ready 1
    ex.resume_ready()  # 1 is older than the yielded 2: the ready one now
    assert order == [0, 1] and [w.task.mb for w in ex.yielded] == [2]
    assert [w.task.mb for w, _ in ex.ready] == [3]
    ex.yielded.clear()
    ex.yielded.append(worker(0, step=2))  # a later step's is never older
    ex.resume_ready()
    assert order == [0, 1, 3]
