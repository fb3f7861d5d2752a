"""``smp.plan`` on one process: the profile it measures, the plan it returns, the CLI."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import plan_toy
import pytest
import smp_torch as smp
import torch
from smp_partition.plan import search
from smp_torch.config import parse_config
from smp_torch.plan import parse_bytes, profile_model
from smp_torch.plan.profiling import (
    _checkpoint_unit_overhead_s,
    default_checkpoint_units,
    gathered_input_bytes,
    peak_step_allocation,
    replay_peak,
    saved_bytes_per_module,
    sharding_overheads_s,
    tensor_parallel_divisors,
)
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def toy_profile():  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    return profile_model(plan_toy.model_fn, plan_toy.sample_batch(), plan_toy.step_fn, repeats=2)


def test_profile_measures_the_model(toy_profile) -> None:  # type: ignore[no-untyped-def]
    p = toy_profile
    assert p.batch_size == 8 and p.forward_s > 0 and p.backward_s > 0
    assert p.checkpoint_units == tuple(f"blocks.{i}" for i in range(plan_toy.LAYERS))
    # the marked linears, each with the gcd of its parameters' first dimensions
    assert p.tp_divisors == {f"blocks.{i}.{n}": d for i in range(plan_toy.LAYERS) for n, d in (("fc", 128), ("proj", 32))}
    assert p.optimizer_bytes == 8  # Adam: two fp32 moments per element
    # Adam's step makes parameter-sized temporaries (torch's foreach sqrt and div: 8 bytes
    # an element; the single-tensor loop: one tensor's); the profile sees them, not 0
    assert p.optimizer_transient_bytes >= 1
    assert p.base_bytes > 0
    # the head saves its input (8 x 16 x 32 fp32) for backward; each block's fc likewise
    assert p.saved_bytes["head"] >= 8 * 16 * 32 * 4
    assert p.saved_bytes["blocks.0.fc"] >= 8 * 16 * 32 * 4


def test_the_step_peak_of_an_optimizer_counts_the_temporaries_its_record_function_frees() -> None:
    """The optimizer step's own record function frees the temporaries its ops made: placed
    at its start those frees cancel them (the peak read 0); at its end they do not."""
    emb = nn.Embedding(4096, 64)
    opt = torch.optim.Adam(emb.parameters(), lr=1e-3)
    emb(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    one_param = 4096 * 64 * 4
    assert peak_step_allocation(opt.step, frees_at_end=True) >= one_param


def test_sharding_overheads_are_measured_per_tensor_on_a_one_rank_mesh(toy_profile, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What FSDP2 adds per parameter tensor (the optimizer on DTensors, the copies around the
    collectives) is measured without a launched job and goes into the profile; the process
    group it needs is this process's alone and gone afterwards; inside a job (a group
    exists) it is not measured. (No timing is asserted beyond being a number.)"""
    import math

    import torch.distributed as dist
    from smp_torch.plan import profiling

    for v in (toy_profile.shard_optimizer_s_per_tensor, toy_profile.shard_microbatch_s_per_tensor):
        assert math.isfinite(v) and v >= 0
    assert not dist.is_initialized()
    one = (plan_toy.sample_batch()[0][:1], plan_toy.sample_batch()[1][:1])

    def adam(ps):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(ps, lr=1e-4)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert sharding_overheads_s(plan_toy.model_fn, plan_toy.step_fn, one, adam, 1) == (0.0, 0.0)
    finally:
        dist.destroy_process_group()
    # the profile carries what the measurement gives
    monkeypatch.setattr(profiling, "sharding_overheads_s", lambda *a: (1e-3, 2e-3))
    p = profile_model(plan_toy.model_fn, plan_toy.sample_batch(), plan_toy.step_fn, repeats=1)
    assert (p.shard_optimizer_s_per_tensor, p.shard_microbatch_s_per_tensor) == (1e-3, 2e-3)


def test_fixed_bytes_are_measured_after_torchs_first_step(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The calibration rank's fixed bytes hold torch's one-time first-step costs: the profile
    # pays them (a one-layer step) before its starting resident set, or counts them twice.
    from smp_torch.plan import profiling

    calls: list[str] = []
    real_warm, real_rss = profiling.warm_up_torch, profiling.rss_bytes
    monkeypatch.setattr(profiling, "warm_up_torch", lambda: (calls.append("warm"), real_warm())[1])
    monkeypatch.setattr(profiling, "rss_bytes", lambda: (calls.append("rss"), real_rss())[1])
    profile_model(lambda: nn.Linear(4, 4), torch.ones(2, 4), repeats=1, checkpoint_units=())
    assert calls[:2] == ["warm", "rss"]


def test_saved_bytes_attribute_to_the_innermost_module() -> None:
    lin = nn.Linear(4, 3)
    model = nn.Sequential(lin, nn.ReLU())
    x = torch.randn(5, 4, requires_grad=True)  # so autograd also saves the weight (skipped)
    saved = saved_bytes_per_module(model, lambda: model(x))
    # Linear saves its input (5x4 floats, weights left out); ReLU its output (5x3 floats)
    assert saved == {"0": 5 * 4 * 4, "1": 5 * 3 * 4}


def test_peak_allocation_counts_nested_ops_once() -> None:
    # torch.ones allocates inside aten::empty, nested in aten::ones; the linear's output
    # inside aten::addmm, nested in aten::linear: each allocation counts once.
    a = torch.randn(64, 256)
    w = torch.randn(256, 256)
    kept: list[torch.Tensor] = []

    def run() -> None:
        kept.append(torch.ones(1 << 18))  # 1 MiB, kept
        kept.append(torch.nn.functional.linear(a, w))  # 64 KiB, kept

    peak = peak_step_allocation(run)
    assert (1 << 20) + (64 << 10) <= peak < (1 << 20) + (128 << 10)
    # frees lower the running sum; records come in any order and are replayed by time
    assert replay_peak([(3.0, -5), (1.0, 10), (2.0, 4), (4.0, 2)]) == 14
    assert replay_peak([]) == 0


def test_checkpoint_overhead_is_measured_on_smps_wrapping(toy_profile) -> None:  # type: ignore[no-untyped-def]
    assert toy_profile.checkpoint_unit_overhead_s >= 0.0
    one = tuple(t[:1] for t in plan_toy.sample_batch())
    with pytest.raises(ValueError, match="checkpoint unit 'blocks.9'"):
        _checkpoint_unit_overhead_s(plan_toy.model_fn, plan_toy.step_fn, one, ("blocks.9",), lambda: None, 0.0, 1)
    assert _checkpoint_unit_overhead_s(plan_toy.model_fn, plan_toy.step_fn, one, (), lambda: None, 0.0, 1) == 0.0


def test_checkpoint_units_are_both_stacks_of_an_encoder_decoder() -> None:
    # T5's shape: an encoder and a decoder stack of equal length, each decoder layer holding
    # a list of as many sublayers (self-attention, cross-attention, MLP). Both stacks are
    # the layers; the sublayer lists inside them are not (checkpointing only the encoder
    # under-predicted what checkpointing saves by the decoder's share).
    class Layer(nn.Module):
        def __init__(self, parts: int) -> None:
            super().__init__()
            self.layer = nn.ModuleList(nn.Linear(4, 4) for _ in range(parts))

    class EncDec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.encoder = nn.ModuleList(Layer(2) for _ in range(3))
            self.decoder = nn.ModuleList(Layer(3) for _ in range(3))

    units = default_checkpoint_units(EncDec())
    assert units == tuple(f"{s}.{i}" for s in ("encoder", "decoder") for i in range(3))
    # one stack (and a model that is itself the list) as before
    assert default_checkpoint_units(plan_toy.Toy()) == tuple(f"blocks.{i}" for i in range(plan_toy.LAYERS))
    assert default_checkpoint_units(nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.ReLU())) == ("0", "1")
    assert default_checkpoint_units(nn.Linear(2, 2)) == ()


def test_tensor_parallel_divisors_need_a_mark() -> None:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 6
            self.lin = nn.Linear(12, 12)

    plain = nn.Sequential(nn.Linear(4, 8), Attn())
    assert tensor_parallel_divisors(plain) == {}
    with smp.tensor_parallelism():
        marked = nn.Sequential(nn.Linear(4, 8), Attn())
    assert tensor_parallel_divisors(marked) == {"0": 8, "1.lin": 12}


def test_llama_blocks_are_the_split_modules_and_divide_by_the_key_value_heads() -> None:
    """smp-tp replaces a Llama attention and MLP each by one Megatron block (one collective
    pair), so the planner splits those two modules, not the seven projections (a pair each:
    tp = 2 was predicted 2-3x too slow on bench_plan's llama-tied grid); tp must divide the
    attention's 2 key/value heads (smp-tp refuses tp = 4 there), not its rows (64)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2)  # fmt: skip
    with smp.tensor_parallelism():
        model = transformers.LlamaForCausalLM(cfg)
    divisors = tensor_parallel_divisors(model)
    layer = {k.removeprefix("model.layers.0."): v for k, v in divisors.items() if k.startswith("model.layers.0.")}
    assert layer == {"self_attn": 2, "mlp": 64}, divisors  # (the MLP: its rows)


def test_gathered_inputs_are_the_blocks_and_the_vocabulary_head() -> None:
    """smp-tp's Megatron blocks and the vocabulary-parallel head all-gather their input (and
    every argument with its batch dimension) over the tp group, so a split
    rank keeps it at tp times its samples; a per-linear split (the toy's marked linears)
    exchanges channel slices and gathers nothing."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    with smp.tensor_parallelism():
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 32, (3, 5))
    divisors = tensor_parallel_divisors(model)
    with torch.no_grad():
        got = gathered_input_bytes(model, lambda: model(ids), divisors)
    hidden = 3 * 5 * 64 * 4
    assert got["model.layers.0.mlp"] == hidden
    assert got["lm_head"] == hidden
    # the attention its input (the rotary cos/sin are (1, 5, 16), shared by the batch:
    # not gathered)
    assert got["model.layers.0.self_attn"] == hidden
    assert "model.embed_tokens" not in got  # (its input is token ids, not kept at tp times)
    toy = plan_toy.model_fn()
    with torch.no_grad():
        assert gathered_input_bytes(toy, lambda: toy(plan_toy.sample_batch()[0]), tensor_parallel_divisors(toy)) == {}


def test_best_config_passes_smp_init_validation(toy_profile) -> None:  # type: ignore[no-untyped-def]
    plan = smp.plan(plan_toy.model_fn, None, 4, "4GiB", profile=toy_profile)
    best = plan.best
    assert best.fits and best.peak_bytes <= 4 << 30
    cfg = parse_config(best.config, 4)  # what smp.init runs first, before any communication
    assert (cfg.pp, cfg.tp, cfg.sdp, cfg.microbatches) == (
        best.candidate.pp, best.candidate.tp, best.candidate.sdp, best.candidate.microbatches
    )  # fmt: skip
    assert cfg.rdp == best.candidate.dp
    for e in plan.feasible:  # every configuration the planner says fits is a valid config
        parse_config(e.config, 4)


def test_plan_pins_and_explains(toy_profile) -> None:  # type: ignore[no-untyped-def]
    plan = smp.plan(plan_toy.model_fn, None, 4, 4 << 30, profile=toy_profile,
                    pinned={"pipeline_parallel_degree": 2})  # fmt: skip
    assert all(e.candidate.pp == 2 for e in plan.estimates)
    assert plan.best.config["pipeline_parallel_degree"] == 2
    full = search(toy_profile, 4, 4 << 30)
    assert "tp=4 does not divide" not in full.why_not({"tensor_parallel_degree": 4})
    assert "does not divide the world size" in full.why_not({"tensor_parallel_degree": 3})
    tight = search(toy_profile, 4, toy_profile.base_bytes + 1000)
    assert "> budget" in tight.why_not({"pipeline_parallel_degree": 1})


def test_a_model_or_batch_off_the_cpu_is_refused_by_name() -> None:
    """The profile reads CPU clocks and the resident set: elsewhere it would measure nothing
    (the meta device stands in for a GPU here)."""
    with pytest.raises(ValueError, match="parameters and buffers are on meta"):
        profile_model(lambda: nn.Linear(4, 4, device="meta"), torch.ones(2, 4))
    with pytest.raises(ValueError, match="sample batch are on meta"):
        profile_model(lambda: nn.Linear(4, 4), torch.ones(2, 4, device="meta"))


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("512 MiB") == 512 << 20
    assert parse_bytes("1.5G") == 3 << 29
    assert parse_bytes(1000) == 1000
    for bad in ("2 parsecs", "-1GiB", "", 0):
        with pytest.raises(ValueError, match="memory must"):
            parse_bytes(bad)  # type: ignore[arg-type]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")  # fmt: skip
    return subprocess.run([sys.executable, "-m", "smp_torch.plan", *args], env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip


def test_cli_prints_the_table_and_draws_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    png = tmp_path / "plan.png"
    plot = ("--plot", str(png)) if importlib.util.find_spec("matplotlib") else ()
    out = _cli("plan_toy:model_fn", "--world-size", "4", "--memory", "4GiB", "--top", "3",
               "--why-not", "pipeline_parallel_degree=4,microbatches=2", *plot)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("smp.plan: 4 ranks, budget 4.0 GiB per rank")
    assert lines[2].lstrip().startswith("1  pp=")
    if plot:
        assert lines.pop() == f"picture: {png}"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert lines[-1].startswith("why not: pp=4 tp=1 dp=1 sdp=1 mb=2")


def test_cli_bad_input_is_one_line_exit_2() -> None:
    out = _cli("plan_toy:model_fn", "--world-size", "4", "--memory", "lots")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "memory must look like" in out.stderr
    out = _cli("plan_toy:nope", "--world-size", "4", "--memory", "1GiB")
    assert out.returncode == 2 and "has no attribute 'nope'" in out.stderr


def test_timings_take_the_fastest_run_and_pair_what_is_compared(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Other processes only add to a run's time, so the profile keeps each timing's fastest
    run, and what it subtracts (a sharded copy from a plain one, a checkpointed step from a
    plain one) is timed in turn, under the same load."""
    from smp_torch.plan import profiling

    ticks = iter([0.0, 2.0, 2.0, 3.0, 3.0, 8.0, 8.0, 9.0])  # a 2 s, b 1 s, a 5 s, b 1 s
    monkeypatch.setattr(profiling, "_clock", lambda: lambda: next(ticks))
    order: list[str] = []
    best = profiling._paired_best_s([lambda: order.append("a"), lambda: order.append("b")], 2)
    assert order == ["a", "b", "a", "b"]
    assert best == [2.0, 1.0]
