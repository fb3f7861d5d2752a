"""Run under mpiexec by test_mpi.py: pipeline training vs one process, many cases per launch.

Usage: python mpi_cases.py SUITE   (SUITE: pp2 | pp4 | failures | tp | fast | fast4)

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
import threading
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
    split_microbatches,
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


def same(a: torch.Tensor, b: torch.Tensor, what: str, exact: bool, rtol: float, atol: float) -> None:
    """Bit for bit (``exact``), else within the tolerances."""
    if not exact:
        close(a, b, what, rtol, atol)
    elif not torch.equal(a, b):
        diff = (a - b).abs().max().item() if a.shape == b.shape else "shape"
        raise AssertionError(f"{what}: not bitwise equal (max abs diff {diff:.3g})\n{a}\n{b}")


def gpt2(n_layer=2):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=n_layer, n_embd=32, n_head=4, vocab_size=97, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=1, eos_token_id=2,
    )
    return GPT2LMHeadModel(cfg)


def llama(n_layer=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return LlamaForCausalLM(cfg)


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


# Issue 43's cross-check, run by hand (docs/how-to/pipeline.md): SMP_PIPE_MODE=static or
# zero_bubble overlays static_mode=True or schedule "zero_bubble" on every case run_case runs;
# each must still equal one process as the plain case does. A case the overlay cannot apply
# to runs unchanged and says so ("CASE-NOT-OVERLAID <name> <reason>"), never silently.
PIPE_MODE = os.environ.get("SMP_PIPE_MODE", "").strip()
PIPE_MODES = ("static", "zero_bubble")
if PIPE_MODE and PIPE_MODE not in PIPE_MODES:
    raise SystemExit(f"SMP_PIPE_MODE={PIPE_MODE!r}: must be one of {PIPE_MODES} (or unset)")


def overlay(schedule, rt_kwargs, not_in=None):
    """``(schedule, rt_kwargs, reason)`` under ``SMP_PIPE_MODE``; ``reason``: why the mode
    was not overlaid (None: it was, or no mode is asked for). ``not_in``: ``{mode: reason}``
    a case gives for a mode it cannot run in."""
    if not PIPE_MODE:
        return schedule, rt_kwargs, None
    if PIPE_MODE in (not_in or {}):
        return schedule, rt_kwargs, not_in[PIPE_MODE]
    if PIPE_MODE == "static":
        if rt_kwargs.get("order_channel") is not None:
            return schedule, rt_kwargs, "static_mode has no effect under tensor-parallel ordering"
        return schedule, {**rt_kwargs, "static_mode": True}, None
    if schedule == "zero_bubble":
        return schedule, rt_kwargs, None
    if schedule != "interleaved":
        what = "a custom task order" if not isinstance(schedule, str) else f"schedule {schedule!r}"
        return schedule, rt_kwargs, f"the case tests {what}; zero_bubble would replace it"
    if rt_kwargs.get("deterministic_accumulation") is False:
        return schedule, rt_kwargs, "deterministic_accumulation=False conflicts with zero_bubble"
    return "zero_bubble", rt_kwargs, None


def run_case(comm, name, build, batch, assignment, m, schedule="interleaved", *, step_of=None,
             ref_loss=None, per_microbatch_reference=False, checkpointing=None, active=None,
             rtol=RTOL, atol=ATOL, steps=2, exact=True, record=None, not_in=None, **rt_kwargs):
    """``exact``: losses and gradients must equal the accumulating reference bit for bit (the
    runtime folds each parameter's gradient into .grad in microbatch order, as the reference
    does); a case passing False says why it cannot. ``record`` (a dict): gets each step's
    losses and this rank's final weights."""
    rank, size = comm.rank, comm.size
    schedule, rt_kwargs, not_overlaid = overlay(schedule, rt_kwargs, not_in)
    if not_overlaid and rank == 0:
        print(f"CASE-NOT-OVERLAID {name} {not_overlaid}", flush=True)
    torch.manual_seed(1234)
    model = build()
    ref = copy.deepcopy(model)
    step_of = step_of or (lambda mdl, rt: models.mse_step(mdl, rt.backward))
    ref_loss = ref_loss or mse_ref
    rt = PipelineRuntime(
        model, comm, rank, size, assignment=assignment, schedule=schedule, timeout_s=60,
        checkpointing=checkpointing, active_microbatches=active, tag=next_tag(), **rt_kwargs,
    )
    if rt_kwargs.get("static_mode"):
        # Static mode's 2 ms gate is a speed heuristic: lifted, what runs inline does not
        # depend on the machine's load.
        rt.server.executor.inline_max_s = 60.0
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    opt = None
    for s in range(steps):
        ref_opt.zero_grad()
        # The reference is one process accumulating the pipeline's microbatches (split the
        # same way) in microbatch order, each loss scaled by 1/m: what the pipeline computes.
        # A whole-batch reference sums the same products in another order, and its rounding
        # differences, grown by a training step, broke rtol/atol on reuse-* now and then.
        chunks = [a for a, _ in split_microbatches(None, tuple(batch), None, m)]
        losses = []
        for c in chunks:
            loss_c = ref_loss(ref, c)
            (loss_c / m).backward()
            losses.append(loss_c.detach())
        expected = torch.stack(losses) if per_microbatch_reference else None
        loss = torch.stack(losses).mean()
        outs = rt.run_step(step_of(model, rt), batch, num_microbatches=m)
        got = torch.stack([o.float() for o in outs])
        if record is not None:
            record[f"losses step {s}"] = got.clone()
        if expected is not None or exact:
            want = torch.stack(losses)
            same(got, want, f"{name} step {s}: per-microbatch losses", exact, rtol, atol)
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
            same(p.grad, rp.grad, f"{name} step {s}: grad of {n} (pp rank {rank})", exact, rtol, atol)
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
    if record is not None:
        record.update({n: p.detach().clone() for n, p in rt.named_local_parameters()})
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
            rt = run_case(comm, f"chain-{schedule}-m{m}", models.Chain, data(), chain_assign, m, schedule)
            if m == 1 and PIPE_MODE != "zero_bubble":
                # pp rank 1 serves three calls per microbatch (blocks.1, blocks.3, head), each
                # with its own parameters: each parameter's one contribution streams into
                # .grad, nothing is buffered (per-parameter streaming). (Not under zero-bubble:
                # W tasks' gradients go into a microbatch's buffer by design, folded once
                # that microbatch's W tasks ran.)
                peaks = comm_allgather(rt.server.grads.peak_buffers)
                assert peaks[1] == 0, f"{schedule}: pp rank 1 buffered gradients: {peaks}"
    run_case(comm, "chain-active1", models.Chain, data(), chain_assign, 4, "interleaved", active=1)
    run_case(comm, "chain-simple-active2", models.Chain, data(), chain_assign, 4, "simple", active=2)
    custom = [(0, "forward"), (1, "forward"), (0, "backward"), (2, "forward"), (1, "backward"),
              (3, "forward"), (2, "backward"), (3, "backward")]
    run_case(comm, "chain-custom", models.Chain, data(), chain_assign, 4, custom)
    run_case(comm, "chain-auto", models.Chain, data(), None, 4)
    run_case(comm, "chain-auto-meta", models.Chain, data(), None, 4, trace_device="meta")
    seq_assign = {"1": 1, "2": 1, "3": 1, "5": 1}
    for schedule in ("simple", "interleaved"):
        run_case(comm, f"seqrun-{schedule}", models.seq_model, data(), seq_assign, 4, schedule)
    run_case(comm, "seqrun-ckpt", models.seq_model, data(), seq_assign, 4,
             checkpointing={"2": None, "4": None})

    # Preemption: pp rank 1's forward span (children 1-3, 30 ms each) is still running when
    # pp rank 0's backward request for the previous microbatch arrives; the forward yields
    # at the next child, serves the backward, resumes, and results stay exact.
    class Slow(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            time.sleep(0.03)
            return self.inner(x)

    def slow_seq():
        net = models.seq_model()
        for i in (1, 2, 3):
            net[i] = Slow(net[i])
        return net

    # (Static mode serves such forwards inline on the main loop, where nothing can preempt
    # them, once they ran straight through: run_case lifts its 2 ms gate.)
    rt = run_case(comm, "seqrun-preempt", slow_seq, data(), {"1": 1, "2": 1, "3": 1}, 4, steps=1,
                  not_in={"static": "it tests a worker-thread forward yielding to a backward; "
                                    "static mode serves it inline on the main loop"})
    yields = comm_allgather(rt.server.yields)
    assert yields[1] > 0, f"pp rank 1's forwards never yielded: {yields}"
    if comm.rank == 0:
        print(f"CASE-OK seqrun-preempt-yields {yields}", flush=True)

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
        rt = run_case(comm, f"reuse-{schedule}", models.Reuse, data(), {"shared": 1, "out": 1}, 4, schedule)
        # "shared" is called twice per microbatch: its parameters get two contributions,
        # which are buffered and summed before the fold (not streamed one by one).
        peaks = comm_allgather(rt.server.grads.peak_buffers)
        assert peaks[1] >= 1, f"reuse-{schedule}: pp rank 1 never buffered: {peaks}"
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
    # fast_mode's ModuleList chains: GPT-2's own loop calls h.1, h.2, h.3 (pp rank 1) one by
    # one; after the first step sees it follow the chaining rule, they are one request per
    # microbatch (forward, and one backward), bitwise as before.
    assign = {"transformer.h.1": 1, "transformer.h.2": 1, "transformer.h.3": 1, "transformer.ln_f": 1}
    rt = run_case(comm, "gpt2-chained", lambda: gpt2(4), gb, assign, 4, step_of=hf_loss_step,
                  ref_loss=reference_hf, steps=3)
    chains = rt._dispatch.chains
    if comm.rank == 0:
        assert chains is not None and chains.misses == 0 and chains.hits >= 2 * 2 * 4, (
            chains.seen, chains.off, chains.hits, chains.misses)
    # Llama's loop passes the rotary embeddings (a tuple), the mask and the position ids to
    # every layer as keyword arguments: the chained layers get them once.
    assign = {"model.layers.1": 1, "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1}
    rt = run_case(comm, "llama-chained", llama, gb, assign, 4, step_of=hf_loss_step,
                  ref_loss=reference_hf, steps=3)
    chains = rt._dispatch.chains
    if comm.rank == 0:
        assert chains is not None and chains.misses == 0 and chains.hits == 2 * 2 * 4, (
            chains.seen, chains.off, chains.hits, chains.misses)
    # T5: the encoder's output feeds every decoder block's cross-attention, and blocks share
    # position biases; across ranks each use is a separate remote call whose input gradient
    # returns through its own boundary, so such a tensor's gradient sums more than two terms
    # in another (fixed) order than one process's engine does: reproducible, not bitwise.
    run_case(comm, "t5-auto", t5, gb, None, 4, step_of=hf_loss_step, ref_loss=reference_hf, exact=False)
    run_case(comm, "t5-manual", t5, gb, {"decoder": 1, "decoder.embed_tokens": 0, "encoder.block.1": 1}, 2, "simple",
             step_of=hf_loss_step, ref_loss=reference_hf, exact=False)
    # The GPU code path (backward segments) on CPU, and the residual-around-a-remote-call
    # shape where joined backward saves work.
    seg = {"backward_mode": "segments"}
    run_case(comm, "chain-segments", models.Chain, data(), chain_assign, 4, **seg)
    # Not bitwise: segments differentiate the graph below a residual around a remote call
    # once per segment (g1*x + g2*x where one process computes (g1 + g2)*x).
    run_case(comm, "reuse-segments", models.Reuse, data(), {"shared": 1, "out": 1}, 4, exact=False, **seg)
    run_case(comm, "tied-segments", models.TiedLM, (ids, tgt), tied_assign, 4,
             step_of=tied_step, ref_loss=tied_ref, **seg)
    run_case(comm, "gpt2-segments", gpt2, gb, {"transformer.h.1": 1, "transformer.ln_f": 1}, 4,
             step_of=hf_loss_step, ref_loss=reference_hf, **seg)
    for mode, per_mb in (("joined", 1), ("segments", 2)):
        models.Diamond.backward_runs = 0
        run_case(comm, f"diamond-{mode}", models.Diamond, data(), {"mid": 1}, 4, steps=1,
                 backward_mode=mode, exact=mode == "joined")  # segments: as reuse-segments
        # Once per microbatch when joined, twice with segments; +4: the one-process reference
        # runs the same 4 microbatches.
        if comm.rank == 0:
            assert models.Diamond.backward_runs == 4 * per_mb + 4, (mode, models.Diamond.backward_runs)
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
    outs = rt.run_step(lambda x: model(x), (x,), num_microbatches=2, outputs_to_all=False)
    assert (outs[0] is None) == (rank != 0), outs
    sd = rt.full_state_dict(dst=0)
    if rank == 0:
        assert sd is not None and set(sd) == set(full)
        for k in full:
            close(sd[k], full[k], f"state_dict {k}")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "timeline.json")
        events = rt.write_timeline(json_path=path)
        if rank == 0:
            assert events and {e[0] for e in events} == set(range(size)), events
            assert os.path.getsize(path) > 0
        if rank == 0:  # one rank reports (two ranks' prints can interleave on one line)
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
    # Not bitwise: h has three consumers (b's linear and residual on pp rank 3, summed there
    # first, and the outer residual), which one process's engine sums in another order.
    run_case(comm, "reuse4", models.Reuse, data(), {"a": 1, "shared": 2, "b": 3}, 4, exact=False)
    run_case(comm, "branch4", models.Branch, data(sign_pattern=True),
             {"pre": 1, "left": 2, "right.0": 3, "right.1": 2}, 4, per_microbatch_reference=True)
    gb = token_batch()
    run_case(comm, "gpt2-4-auto", gpt2, gb, None, 4, step_of=hf_loss_step, ref_loss=reference_hf)
    run_case(comm, "gpt2-4-manual", gpt2, gb,
             {"transformer.h.0": 1, "transformer.h.1": 2, "transformer.ln_f": 3}, 8, "simple",
             step_of=hf_loss_step, ref_loss=reference_hf)
    run_case(comm, "t5-4-auto", t5, gb, None, 2, step_of=hf_loss_step, ref_loss=reference_hf,
             exact=False)  # see t5-auto
    run_case(comm, "branch4-segments", models.Branch, data(sign_pattern=True),
             {"pre": 1, "left": 2, "right.0": 3, "right.1": 2}, 4, per_microbatch_reference=True,
             backward_mode="segments")


def check_served(comm, rt, name, per_mb, m, steps=2):
    """``per_mb[r]``: requests (forward + backward) pp rank r serves per microbatch."""
    served = comm_allgather(rt.requests_served)
    want = [n * m * steps for n in per_mb]
    assert served == want, f"{name}: requests served per rank {served}, expected {want}"
    if comm.rank == 0:
        print(f"CASE-OK {name}-served {served}", flush=True)


def check_relayed(comm, rt, name, per_mb, m, steps=2):
    """``per_mb[r]``: requests pp rank r sent on to the next owner of a relay per microbatch
    (forward and backward), instead of answering through the caller."""
    relayed = comm_allgather(rt.server.remote.relayed)
    want = [n * m * steps for n in per_mb]
    assert relayed == want, f"{name}: requests relayed per rank {relayed}, expected {want}"
    if comm.rank == 0:
        print(f"CASE-OK {name}-relayed {relayed}", flush=True)


def suite_fast(comm):
    """fast_mode (pp=2): runs of Sequential children as one request, on and off, bitwise."""
    seq_assign = {"1": 1, "2": 1, "3": 1, "5": 1}
    for fast in (True, False):
        suffix = "" if fast else "-fast-off"
        # seq_model: children 1-3 are one run, 5 a lone child: 2 (fast) or 4 forward requests.
        rt = run_case(comm, f"seqrun{suffix}", models.seq_model, data(), seq_assign, 4, fast_mode=fast)
        check_served(comm, rt, f"seqrun{suffix}", [0, 4 if fast else 8], 4)
        run_case(comm, f"seqrun-ckpt{suffix}", models.seq_model, data(), seq_assign, 4,
                 checkpointing={"2": None, "4": None}, fast_mode=fast)
        # The placement cuts inside block 1: one request for 1.1, 1.2, 2, 3 (nested flattened).
        nested = {"1.1": 1, "1.2": 1, "2": 1, "3": 1}
        rt = run_case(comm, f"nested-seq{suffix}", models.nested_seq_model, data(), nested, 4,
                      fast_mode=fast)
        check_served(comm, rt, f"nested-seq{suffix}", [0, 2 if fast else 8], 4)
        # Control flow: the branch taken differs per microbatch; right's two blocks are a run.
        rt = run_case(comm, f"branch-run{suffix}", models.Branch, data(sign_pattern=True),
                      {"right.0": 1, "right.1": 1}, 4, per_microbatch_reference=True,
                      fast_mode=fast)
    # A forward hook on block 1 keeps it from being flattened: runs 1.1-1.2, then 2-3.
    rt = run_case(comm, "nested-seq-hooked", models.hooked_nested_seq_model, data(), nested, 4)
    check_served(comm, rt, "nested-seq-hooked", [0, 4], 4)
    rt = run_case(comm, "nested-seq-segments", models.nested_seq_model, data(), nested, 4,
                  backward_mode="segments")
    check_served(comm, rt, "nested-seq-segments", [0, 2], 4)


def check_inlined(comm, rt, name, ranks):
    """Static mode served requests on the main loop of each of ``ranks`` (and not the driver)."""
    inlined = comm_allgather(rt.server.executor.inlined)
    assert inlined[0] == 0 and all(inlined[r] > 0 for r in ranks), f"{name}: inlined {inlined}"
    if comm.rank == 0:
        print(f"CASE-OK {name}-inlined {inlined}", flush=True)


def suite_static(comm):
    """static_mode (pp=2 and pp=4 on 4 ranks' first 2 or all): bitwise equal to one process
    (hence to dynamic mode), with the requests that ran straight through served inline."""
    if comm.size == 2:
        seq_assign = {"1": 1, "2": 1, "3": 1, "5": 1}
        rt = run_case(comm, "seqrun-static", models.seq_model, data(), seq_assign, 4, steps=3,
                      static_mode=True)
        check_served(comm, rt, "seqrun-static", [0, 4], 4, steps=3)
        check_inlined(comm, rt, "seqrun-static", [1])
        rt = run_case(comm, "seqrun-ckpt-static", models.seq_model, data(), seq_assign, 4,
                      steps=3, checkpointing={"2": None, "4": None}, static_mode=True)
        check_inlined(comm, rt, "seqrun-ckpt-static", [1])
        rt = run_case(comm, "seqrun-fast-off-static", models.seq_model, data(), seq_assign, 4,
                      steps=3, fast_mode=False, static_mode=True)
        check_inlined(comm, rt, "seqrun-fast-off-static", [1])
        # Control flow: the branch (and so the requests) differ per microbatch and step.
        rt = run_case(comm, "branch-run-static", models.Branch, data(sign_pattern=True),
                      {"right.0": 1, "right.1": 1}, 4, steps=3, per_microbatch_reference=True,
                      static_mode=True)
        check_inlined(comm, rt, "branch-run-static", [1])
        rt = run_case(comm, "reuse-static", models.Reuse, data(), {"shared": 1, "out": 1}, 4,
                      steps=3, static_mode=True)
        check_inlined(comm, rt, "reuse-static", [1])
    else:
        runs = {"1": 1, "2": 1, "3": 2, "4": 2, "5": 3, "6": 3}
        rt = run_case(comm, "seq4-runs-static", lambda: models.nested_seq_model(n=7),
                      data(n=16), runs, 8, steps=3, static_mode=True)
        check_served(comm, rt, "seq4-runs-static", [0, 2, 2, 2], 8, steps=3)
        check_inlined(comm, rt, "seq4-runs-static", [1, 2, 3])
        rt = run_case(comm, "branch4-run-static", models.Branch, data(sign_pattern=True),
                      {"pre": 1, "left": 2, "right.0": 3, "right.1": 3}, 4, steps=3,
                      per_microbatch_reference=True, static_mode=True)
        check_inlined(comm, rt, "branch4-run-static", [1, 2, 3])


def suite_fast4(comm):
    """fast_mode (pp=4): one run per stage, on and off; control flow across three stages."""
    runs = {"1": 1, "2": 1, "3": 2, "4": 2, "5": 3, "6": 3}
    for fast in (True, False):
        suffix = "" if fast else "-fast-off"
        rt = run_case(comm, f"seq4-runs{suffix}", lambda: models.nested_seq_model(n=7), data(n=16),
                      runs, 8, fast_mode=fast)
        check_served(comm, rt, f"seq4-runs{suffix}", [0, 2, 2, 2] if fast else [0, 4, 4, 4], 8)
        # Stage 1 -> 2 -> 3 straight, the gradients 3 -> 2 -> 1: the driver sees one request
        # each way per microbatch, not three.
        check_relayed(comm, rt, f"seq4-runs{suffix}", [0, 1, 2, 1] if fast else [0, 0, 0, 0], 8)
        run_case(comm, f"branch4-run{suffix}", models.Branch, data(sign_pattern=True),
                 {"pre": 1, "left": 2, "right.0": 3, "right.1": 3}, 4,
                 per_microbatch_reference=True, fast_mode=fast)
    # A relay in segment mode (the caller never waits inside the engine; the first owner's
    # answer starts the caller's segment), and one whose stages are single children.
    rt = run_case(comm, "seq4-relay-segments", lambda: models.nested_seq_model(n=7), data(n=16),
                  runs, 8, backward_mode="segments")
    check_relayed(comm, rt, "seq4-relay-segments", [0, 1, 2, 1], 8)
    rt = run_case(comm, "seq4-relay-single", lambda: models.nested_seq_model(n=4), data(n=16),
                  {"1": 1, "2": 2, "3": 3}, 8)
    check_relayed(comm, rt, "seq4-relay-single", [0, 1, 2, 1], 8)


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
    # close() after the abort resumes workers still waiting for answers: none stays blocked.
    rt.close()
    deadline = time.monotonic() + 5
    while any(t.name.startswith("smp-pipeline-worker") for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.05)
    print(f"CLOSE-OK rank {rank}", flush=True)
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
    # os._exit skips MPI_Finalize, which is what removes MPICH's /dev/shm file: remove it
    # here (every rank mapped it long ago), or each run of this suite left one behind.
    from smp_comm.shutdown import unlink_mpi_shared_memory

    unlink_mpi_shared_memory()
    os._exit(0)  # the stalled worker thread is still asleep; exit without waiting for it


def suite_tp(comm):
    """pp=2 x 2 tensor-parallel peers: collectives inside modules need the order channel.

    Pipelines {0,1} and {2,3}; TP groups {0,2} and {1,3} (leaders 0 and 1). Stage 1 runs a
    gloo all_reduce in forward and in backward whose value is the microbatch id, so peers at
    different microbatches would fail the check (or hang and time out). Stage 0 sleeps a
    random time per call (different per pipeline) to scramble the natural order.
    """
    import random

    import torch.distributed as dist
    from smp_pipeline import OrderChannel, device_work

    rank = comm.rank
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=rank, world_size=4)
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pp_rank, pipeline = rank % 2, rank // 2
    tp_group = groups[pp_rank]
    rng = random.Random(100 + rank)

    class Jitter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            with device_work():
                time.sleep(rng.uniform(0.0, 0.01))
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            with device_work():
                time.sleep(rng.uniform(0.0, 0.01))
            return g

    class CheckedAllReduce(torch.autograd.Function):
        """Identity; forward and backward all-reduce the microbatch id and check it."""

        @staticmethod
        def forward(ctx, x, mb_id):  # type: ignore[override]
            ctx.mb_id = mb_id
            t = mb_id.clone()
            dist.all_reduce(t, group=tp_group)
            assert torch.equal(t, 2 * mb_id), f"forward collective mismatch {t} vs {mb_id}"
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            t = ctx.mb_id.clone()
            dist.all_reduce(t, group=tp_group)
            assert torch.equal(t, 2 * ctx.mb_id), f"backward collective mismatch {t}"
            return g, None

    class S0(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return Jitter.apply(torch.tanh(self.lin(x)))

    class S1(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)

        def forward(self, h, mb_id):
            return CheckedAllReduce.apply(self.lin(h), mb_id)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.s0 = S0()
            self.s1 = S1()

        def forward(self, x, mb_id):
            return self.s1(self.s0(x), mb_id)

    leader = pp_rank  # world rank of this stage's pipeline-0 peer
    # (static: stage 1's leader replays its recorded step in the second one, inline on its
    # main thread, and announces each inline task; the follower runs those inline too.)
    tp_cases = (("interleaved", 4, False), ("simple", 4, False), ("interleaved", 8, False),
                ("interleaved", 8, True))  # fmt: skip
    for case, (schedule, m, static) in enumerate(tp_cases):
        channel = OrderChannel(comm, leader=leader, followers=[leader + 2], tag=7360 + 2 * case + pp_rank)
        torch.manual_seed(7)
        model = Net()
        ref = copy.deepcopy(model)
        g = torch.Generator().manual_seed(pipeline)
        x, y = torch.randn(2 * m, 8, generator=g), torch.randn(2 * m, 1, generator=g)
        ids = torch.arange(m, dtype=torch.float32).repeat_interleave(2)
        rt = PipelineRuntime(model, comm, pp_rank, 2, comm_ranks=[2 * pipeline, 2 * pipeline + 1],
                             assignment={"s1": 1}, schedule=schedule, tag=next_tag() + 1000 * pipeline,
                             timeout_s=30, order_channel=channel, static_mode=static)

        def step(x, y, ids, model=model, rt=rt):
            loss = F.mse_loss(model(x, ids[0]), y)
            rt.backward(loss)
            return loss

        for _ in range(2):
            outs = rt.run_step(step, (x, y, ids), num_microbatches=m)
        F.mse_loss(torch.cat([ref.s1.lin(torch.tanh(ref.s0.lin(c))) for c in x.chunk(m)]), y).backward()
        close(torch.stack(outs).mean(), F.mse_loss(ref.s1.lin(torch.tanh(ref.s0.lin(x))), y), "tp loss")
        refp = dict(ref.named_parameters())
        # Within tolerances, not bitwise: the reference is the whole-batch gradient doubled,
        # not the two steps' microbatches accumulated in order.
        for n, p in rt.named_local_parameters():
            close(p.grad, 2 * refp[n].grad, f"tp grad {n}")  # two identical steps accumulated
        if static and pp_rank == 1:
            inlined = rt.server.executor.inlined
            assert inlined > 0, f"rank {rank}: nothing served inline ({inlined})"
            if rank == leader:
                stats = rt.replay_stats
                assert stats is not None and stats.replayed == 1, f"rank {rank}: {stats}"
        rt.close()
        channel.close()
        if rank == 0:
            print(f"CASE-OK tp-{schedule}-m{m}{'-static' if static else ''}", flush=True)

    # An exception in pipeline B's stage 1 while its TP peer in pipeline A waits inside the
    # all_reduce: abort_ranks carries the abort to the other pipeline, so all 4 ranks raise.
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, mb_id):  # type: ignore[override]
            if pipeline == 1 and int(mb_id) == 1:
                raise ValueError("boom-tp")
            return CheckedAllReduce.apply(x, mb_id)

    S1.forward = lambda self, h, mb_id: Boom.apply(self.lin(h), mb_id)  # type: ignore[method-assign]
    torch.manual_seed(7)
    model = Net()
    channel = OrderChannel(comm, leader=leader, followers=[leader + 2], tag=7390 + pp_rank)
    rt = PipelineRuntime(model, comm, pp_rank, 2, comm_ranks=[2 * pipeline, 2 * pipeline + 1],
                         assignment={"s1": 1}, tag=8800, timeout_s=30, order_channel=channel,
                         abort_ranks=[0, 1, 2, 3])
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    ids = torch.arange(4, dtype=torch.float32).repeat_interleave(2)
    try:
        rt.run_step(lambda x, y, ids: F.mse_loss(model(x, ids[0]), y), (x, y, ids), num_microbatches=4)
    except PipelineRemoteError as exc:
        assert "boom-tp" in str(exc), str(exc)
        print(f"TP-ABORT-OK rank {rank}", flush=True)
    else:
        raise AssertionError("no error")
    # A normal exit, although pipeline A's stage-1 worker is still inside the all_reduce:
    # the runtime's exit handler must keep interpreter finalization from aborting the process.


def suite_repro(comm):
    """Deterministic accumulation across runs: train timing-sensitive configurations (module
    reuse and a ModuleList loop served one block per request with 8 microbatches in flight,
    static and fast mode on a Sequential, control flow)
    and save every rank's weights and losses to ``$SMP_REPRO_OUT/rank<r>.pt``.
    test_mpi.py runs this twice, the second time beside CPU-burning processes, and compares
    the files bit for bit (each run is also checked bitwise against one process here)."""
    saved = {name: {} for name in ("reuse-m8", "chain-m8", "seqrun-static", "branch")}
    run_case(comm, "repro-reuse-m8", models.Reuse, data(n=16), {"shared": 1, "out": 1}, 8,
             steps=3, active=8, record=saved["reuse-m8"])
    # Several calls per microbatch on pp rank 1, each parameter's contribution streamed or
    # buffered as timing has it (per-parameter streaming): the same bits either way.
    run_case(comm, "repro-chain-m8", models.Chain, data(n=16),
             {"blocks.1": 1, "blocks.3": 1, "head": 1}, 8, steps=3, active=8,
             record=saved["chain-m8"])
    run_case(comm, "repro-seqrun-static", models.seq_model, data(n=16),
             {"1": 1, "2": 1, "3": 1, "5": 1}, 8, steps=3, static_mode=True,
             record=saved["seqrun-static"])
    run_case(comm, "repro-branch", models.Branch, data(n=16, sign_pattern=True),
             {"left": 1, "right.1": 1}, 8, steps=3, per_microbatch_reference=True,
             record=saved["branch"])
    torch.save(saved, os.path.join(os.environ["SMP_REPRO_OUT"], f"rank{comm.rank}.pt"))


def main() -> None:
    comm = Communicator(MPI.COMM_WORLD)
    suite = sys.argv[1]
    t0 = time.monotonic()
    suites = {
        "pp2": suite_pp2, "pp4": suite_pp4, "failures": suite_failures, "tp": suite_tp,
        "fast": suite_fast, "fast4": suite_fast4, "static": suite_static,
        "static4": suite_static, "repro": suite_repro,
    }  # fmt: skip
    suites[suite](comm)
    if comm.rank == 0:
        print(f"SUITE-OK {suite} in {time.monotonic() - t0:.1f}s", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
