"""Run under mpiexec by test_mpi.py: pipeline training vs one process, many cases per launch.

Usage: python mpi_cases.py SUITE   (SUITE: pp2 | pp4 | failures)

For every case each rank builds the model from the same seed, keeps an untouched copy as the
single-process reference, trains it on the whole batch (mean loss), then runs the same step
through PipelineRuntime and compares: losses (on every rank: the driver broadcasts outputs)
and the gradient of every parameter it owns, then does an SGD step on both and compares the
next step's losses. Prints "CASE-OK <name>" per case; any mismatch raises and fails the job.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
from smp_comm import Communicator  # noqa: E402
from smp_pipeline import (  # noqa: E402
    PipelineRemoteError,
    PipelineRuntime,
    PipelineTimeoutError,
)

torch.set_num_threads(1)
RTOL, ATOL = 1e-5, 1e-6
TAG = [9000]


def next_tag() -> int:
    TAG[0] += 10  # every runtime gets its own tags: no message of an old one can leak
    return TAG[0]


def close(a: torch.Tensor, b: torch.Tensor, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    if not torch.allclose(a, b, rtol=rtol, atol=atol):
        raise AssertionError(f"{what}: max abs diff {(a - b).abs().max().item():.3g}\n{a}\n{b}")


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=1, eos_token_id=2,
    )
    return GPT2LMHeadModel(cfg)


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, vocab_size=97,
        dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
    )
    return T5ForConditionalGeneration(cfg)


def hf_loss_step(model, rt):
    def step(input_ids, labels):
        loss = model(input_ids=input_ids, labels=labels).loss
        rt.backward(loss)
        return loss

    return step


def reference_hf(model, batch):
    return model(input_ids=batch[0], labels=batch[1]).loss


def mse_ref(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def run_case(comm, name, build, batch, assignment, m, schedule="interleaved", *, step_of=None,
             ref_loss=None, per_microbatch_reference=False, checkpointing=None, active=None,
             rtol=RTOL, atol=ATOL, steps=2):
    rank, size = comm.rank, comm.size
    torch.manual_seed(1234)
    model = build()
    ref = copy.deepcopy(model)
    step_of = step_of or (lambda mdl, rt: models.mse_step(mdl, rt.backward))
    ref_loss = ref_loss or mse_ref
    rt = PipelineRuntime(
        model, comm, rank, size, assignment=assignment, schedule=schedule, timeout_s=60,
        checkpointing=checkpointing, active_microbatches=active, tag=next_tag(),
    )
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    opt = None
    for s in range(steps):
        ref_opt.zero_grad()
        if per_microbatch_reference:
            # Control flow depends on the microbatch, so one process reproduces the pipeline
            # by running each microbatch and averaging the mean losses.
            chunks = list(zip(*[torch.chunk(t, m) for t in batch]))
            losses = [ref_loss(ref, c) for c in chunks]
            expected = torch.stack(losses)
            (sum(losses) / m).backward()
        else:
            loss = ref_loss(ref, batch)
            loss.backward()
            expected = None
        outs = rt.run_step(step_of(model, rt), batch, num_microbatches=m)
        got = torch.stack([o.float() for o in outs])
        if expected is not None:
            close(got, expected.detach(), f"{name} step {s}: per-microbatch losses", rtol, atol)
        else:
            close(got.mean(), loss.detach(), f"{name} step {s}: loss", rtol, atol)
        refp = dict(ref.named_parameters())
        local = rt.named_local_parameters()
        for n, p in local:
            rp = refp[n]
            if rp.grad is None:
                assert p.grad is None or not p.grad.abs().any(), f"{name}: {n} has unexpected grad"
                continue
            assert p.grad is not None, f"{name} step {s}: {n} got no gradient on pp rank {rank}"
            close(p.grad, rp.grad, f"{name} step {s}: grad of {n} (pp rank {rank})", rtol, atol)
        names = comm_allgather([n for n, _ in local])
        covered = {n for part in names for n in part}
        missing = set(refp) - covered
        assert not missing, f"{name}: parameters owned by no rank: {missing}"
        trainable = [p for p in rt.local_parameters() if p.requires_grad]
        if opt is None and trainable:
            opt = torch.optim.SGD(trainable, lr=0.1)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        ref_opt.step()
    if rank == 0:
        print(f"CASE-OK {name} owners={sorted(set(rt.assignment.values()))}", flush=True)
    rt.close()
    return rt


def comm_allgather(obj):
    return MPI.COMM_WORLD.allgather(obj)


def data(seed=0, n=8, d=8, sign_pattern=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    if sign_pattern:  # first sample of every pair of rows decides the branch
        for i in range(0, n, 2):
            x[i, 0] = 1.0 if (i // 2) % 2 == 0 else -1.0
    return x, torch.randn(n, 1, generator=g)


def token_batch(n=8, t=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 97, (n, t), generator=g), torch.randint(1, 97, (n, t), generator=g)


def suite_pp2(comm):
    chain_assign = {"blocks.1": 1, "blocks.3": 1, "head": 1}
    for schedule in ("simple", "interleaved"):
        for m in (1, 2, 4, 8):
            run_case(comm, f"chain-{schedule}-m{m}", models.Chain, data(), chain_assign, m, schedule)
    run_case(comm, "chain-active1", models.Chain, data(), chain_assign, 4, "interleaved", active=1)
    run_case(comm, "chain-simple-active2", models.Chain, data(), chain_assign, 4, "simple", active=2)
    custom = [(0, "forward"), (1, "forward"), (0, "backward"), (2, "forward"), (1, "backward"),
              (3, "forward"), (2, "backward"), (3, "backward")]
    run_case(comm, "chain-custom", models.Chain, data(), chain_assign, 4, custom)
    run_case(comm, "chain-auto", models.Chain, data(), None, 4)

    def tied_step(model, rt):
        def step(ids, target):
            logits = model(ids)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
            rt.backward(loss)
            return loss
        return step

    def tied_ref(model, batch):
        logits = model(batch[0])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))

    ids = torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(3))
    tgt = torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(4))
    tied_assign = {"": 0, "embed": 1, "head": 1, "blocks.1": 0}
    for schedule in ("simple", "interleaved"):
        run_case(comm, f"tied-{schedule}", models.TiedLM, (ids, tgt), tied_assign, 4, schedule,
                 step_of=tied_step, ref_loss=tied_ref)
    for strategy in ("each", "group_2", "contiguous"):
        run_case(comm, f"tied-ckpt-{strategy}", models.TiedLM, (ids, tgt), tied_assign, 4,
                 step_of=tied_step, ref_loss=tied_ref, checkpointing={"blocks": strategy})
    run_case(comm, "chain-ckpt-module", models.Chain, data(), chain_assign, 4,
             checkpointing={"blocks.1": None, "blocks.0": None})
    run_case(comm, "tied-auto", models.TiedLM, (ids, tgt), None, 2, step_of=tied_step, ref_loss=tied_ref)

    for schedule in ("simple", "interleaved"):
        run_case(comm, f"reuse-{schedule}", models.Reuse, data(), {"shared": 1, "out": 1}, 4, schedule)
        run_case(comm, f"branch-{schedule}", models.Branch, data(sign_pattern=True),
                 {"left": 1, "right.1": 1}, 4, schedule, per_microbatch_reference=True)

    def fancy_step(model, rt):
        def step(x, y, mask):
            out = model(x, mask=mask, scale=0.5)
            loss = F.mse_loss(out, y)
            rt.backward(loss)
            return loss
        return step

    x, y = data()
    mask = (torch.rand(8, 8, generator=torch.Generator().manual_seed(5)) > 0.3).float()
    for assign in ({"enc": 1}, {"enc": 1, "dec": 1}, {"dec": 1, "enc.aux": 1}):
        run_case(comm, f"fancy-{sorted(assign)}", models.Fancy, (x, y, mask), assign, 4,
                 step_of=fancy_step,
                 ref_loss=lambda mdl, b: F.mse_loss(mdl(b[0], mask=b[2], scale=0.5), b[1]))

    gb = token_batch()
    for schedule in ("simple", "interleaved"):
        run_case(comm, f"gpt2-{schedule}", gpt2, gb, {"transformer.h.1": 1, "transformer.ln_f": 1}, 4,
                 schedule, step_of=hf_loss_step, ref_loss=reference_hf)
    run_case(comm, "gpt2-auto", gpt2, gb, None, 2, step_of=hf_loss_step, ref_loss=reference_hf)
    run_case(comm, "t5-auto", t5, gb, None, 4, step_of=hf_loss_step, ref_loss=reference_hf)
    run_case(comm, "t5-manual", t5, gb, {"decoder": 1, "decoder.embed_tokens": 0, "encoder.block.1": 1}, 2, "simple",
             step_of=hf_loss_step, ref_loss=reference_hf)
    state_checks(comm)


def state_checks(comm):
    """Grad mode and autocast state travel with requests; eval steps; state gathering."""
    rank, size = comm.rank, comm.size
    torch.manual_seed(0)

    class Probe(torch.nn.Module):
        def forward(self, x):
            return {"grad": torch.is_grad_enabled(), "autocast": torch.is_autocast_enabled("cpu"),
                    "y": x * 2}

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.probe = Probe()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.probe(self.lin(x))

    model = Root()
    full = copy.deepcopy(model).state_dict()
    rt = PipelineRuntime(model, comm, rank, size, assignment={"probe": 1}, tag=next_tag(), timeline=True)
    x = torch.randn(4, 4)
    with torch.no_grad():
        outs = rt.run_step(lambda x: model(x), (x,), num_microbatches=2)
    assert [o["grad"] for o in outs] == [False, False], outs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = rt.run_step(lambda x: model(x), (x,), num_microbatches=2)
    assert [o["autocast"] for o in outs] == [True, True], outs
    assert outs[0]["y"].dtype == torch.bfloat16
    outs = rt.run_step(lambda x: model(x), (x,), num_microbatches=1)
    assert outs[0]["grad"] is True and outs[0]["autocast"] is False
    sd = rt.full_state_dict(dst=0)
    if rank == 0:
        assert sd is not None and set(sd) == set(full)
        for k in full:
            close(sd[k], full[k], f"state_dict {k}")
    events = rt.write_timeline(json_path=f"/tmp/smp_pp_timeline_{os.getpid()}.json")
    if rank == 0:
        assert events and {e[0] for e in events} == set(range(size)), events
        print("CASE-OK state-and-timeline", flush=True)
    rt.close()


def suite_pp4(comm):
    assign = {"blocks.0": 1, "blocks.1": 2, "blocks.2": 3, "blocks.3": 3, "head": 2}
    for schedule in ("simple", "interleaved"):
        for m in (1, 3, 8):
            run_case(comm, f"chain4-{schedule}-m{m}", models.Chain,
                     data(n=24 if m == 3 else 8), assign, m, schedule)
    for schedule in ("simple", "interleaved"):
        run_case(comm, f"device4-{schedule}", models.DeviceChain, data(n=16), assign, 8, schedule)
    run_case(comm, "reuse4", models.Reuse, data(), {"a": 1, "shared": 2, "b": 3}, 4)
    run_case(comm, "branch4", models.Branch, data(sign_pattern=True),
             {"pre": 1, "left": 2, "right.0": 3, "right.1": 2}, 4, per_microbatch_reference=True)
    gb = token_batch()
    run_case(comm, "gpt2-4-auto", gpt2, gb, None, 4, step_of=hf_loss_step, ref_loss=reference_hf)
    run_case(comm, "gpt2-4-manual", gpt2, gb,
             {"transformer.h.0": 1, "transformer.h.1": 2, "transformer.ln_f": 3}, 8, "simple",
             step_of=hf_loss_step, ref_loss=reference_hf)
    run_case(comm, "t5-4-auto", t5, gb, None, 2, step_of=hf_loss_step, ref_loss=reference_hf)


class Boom(torch.nn.Module):
    def forward(self, x):
        raise ValueError("boom inside a module")


class Sleepy(torch.nn.Module):
    def forward(self, x):
        time.sleep(6.0)
        return x


class Wrap(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.pre = torch.nn.Linear(4, 4)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.pre(x))


def suite_failures(comm):
    rank, size = comm.rank, comm.size
    last = size - 1
    model = Wrap(Boom())
    rt = PipelineRuntime(model, comm, rank, size, assignment={"inner": last}, timeout_s=30, tag=next_tag())
    t0 = time.monotonic()
    try:
        rt.run_step(lambda x: model(x).sum(), (torch.randn(4, 4),), num_microbatches=2)
    except PipelineRemoteError as exc:
        assert "boom inside a module" in str(exc) and "inner" in str(exc), str(exc)
        print(f"ERROR-OK rank {rank} after {time.monotonic() - t0:.1f}s", flush=True)
    else:
        raise AssertionError("no error raised")
    model = Wrap(Sleepy())
    rt = PipelineRuntime(model, comm, rank, size, assignment={"inner": last}, timeout_s=1.5, tag=next_tag())
    t0 = time.monotonic()
    try:
        rt.run_step(lambda x: model(x).sum(), (torch.randn(4, 4),), num_microbatches=2)
    except PipelineTimeoutError as exc:
        text = str(exc)
        assert "'inner'" in text and "microbatch 0" in text and f"pp rank {last}" in text, text
        print(f"TIMEOUT-OK rank {rank} after {time.monotonic() - t0:.1f}s: {text}", flush=True)
    else:
        raise AssertionError("no timeout raised")
    sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()  # every rank has raised before anyone leaves
    os._exit(0)  # the stalled worker thread is still asleep; exit without waiting for it


def main() -> None:
    comm = Communicator(MPI.COMM_WORLD)
    suite = sys.argv[1]
    t0 = time.monotonic()
    {"pp2": suite_pp2, "pp4": suite_pp4, "failures": suite_failures}[suite](comm)
    if comm.rank == 0:
        print(f"SUITE-OK {suite} in {time.monotonic() - t0:.1f}s", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
