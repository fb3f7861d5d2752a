"""Sequence parallelism (optimize="speed", sequence_parallel=True, scaled batch) and
selective recomputation of the attention core (recompute_attention=True) against the
single-rank modules on the concatenated batch; the collectives per layer; the saved
activations per rank against the plain speed layout; the errors for prescaled/memory.
"""

from __future__ import annotations

import smp_tp
import torch
from common import (
    FAILURES,
    check,
    close,
    close_dicts,
    finish,
    gather_batch,
    log,
    randomize,
    saved_bytes,
    setup,
)

rank, T, single = setup()
failures = FAILURES
B, S, H = 2, 6, 16


def hidden(seed: int, s: int = S) -> torch.Tensor:
    return torch.randn(B, s, H, generator=torch.Generator().manual_seed(seed))


def pad_mask(seed: int) -> torch.Tensor:
    m = torch.ones(B, S)
    m[:, -1 - seed % 2:] = 0  # differs between ranks: travels with the samples
    return (1.0 - m)[:, None, None, :] * -1e4


# name: (constructor, inputs(seed) -> [(tensor, requires_grad)])
BUILDERS = {
    "attention_post": (lambda **k: smp_tp.DistributedAttentionLayer(4, 4, H, 0.0, 0.0, **k),
                       lambda s: [(hidden(s), True), (pad_mask(s), False)]),
    "output_gelu": (lambda **k: smp_tp.DistributedTransformerOutputLayer(H, 32, 0.0, "gelu", **k),
                    lambda s: [(hidden(s), True)]),
    "layer_cross": (lambda **k: smp_tp.DistributedTransformerLayer(4, 4, H, 32, 0.0, 0.0, "gelu",
                                                                   add_cross_attention=True, **k),
                    lambda s: [(hidden(s), True), (pad_mask(s), False), (hidden(s + 7, s=3), True)]),
    "transformer_pre_causal": (
        lambda **k: smp_tp.DistributedTransformer(2, 4, 4, H, 32, 0.0, 0.0, "gelu_new", causal_mask_size=S,
                                                  pre_layernorm=True, post_layernorm=False, **k),
        lambda s: [(hidden(s), True)]),
    "lmhead_gpt": (
        lambda **k: smp_tp.DistributedTransformerLMHead(2, 4, 4, H, 32, 97, 8, 0.0, 0.0, causal_mask_size=8,
                                                        pre_layernorm=True, post_layernorm=False, **k),
        lambda s: [(torch.randint(0, 97, (B, S), generator=torch.Generator().manual_seed(s)), False)]),
}
OPTIONS = {"sp": dict(sequence_parallel=True), "sp+recompute": dict(sequence_parallel=True, recompute_attention=True),
           "sp+recompute+mlp": dict(sequence_parallel=True, recompute_attention=True, recompute_mlp_activation=True),
           "mlp": dict(sequence_parallel=True, recompute_mlp_activation=True)}  # the MLP block's own


def compare(name: str, option: str) -> None:
    build, make_inputs = BUILDERS[name]
    kwargs = dict(OPTIONS[option])
    with smp_tp.tp_config(tp_group=single, optimize="speed"):
        ref = build()  # the plain single-rank module (no option)
    randomize(ref)
    with smp_tp.tp_config(optimize="speed"):
        par = build(**kwargs)
    smp_tp.load_full_state_dict(par, smp_tp.full_state_dict(ref))
    local = make_inputs(100 + rank)
    glob = [(gather_batch(t), g) for t, g in local]
    local = [t.clone().requires_grad_(g) for t, g in local]
    glob = [t.clone().requires_grad_(g) for t, g in glob]
    y_ref, y = ref(*glob), par(*local)
    (y_ref ** 2).mean().backward()
    (y ** 2).mean().backward()
    smp_tp.sync_gradients(par)
    got_grads, want_grads = smp_tp.full_grad_dict(par), smp_tp.full_grad_dict(ref)
    # every collective is done: assertions below cannot desynchronise the ranks
    label = f"{name}/{option}"
    close(f"{label} output", y, y_ref.chunk(T, 0)[rank])
    close_dicts(f"{label} grads", got_grads, want_grads)
    for i, (t, g) in enumerate(zip(local, glob)):
        if t.requires_grad:
            close(f"{label} input grad {i}", t.grad, g.grad.chunk(T, 0)[rank] * T)
    if rank == 0:
        log(f"{label}: OK")


# the MLP block has no attention, the attention block no MLP
ONLY = {"output_gelu": ("sp", "mlp"), "attention_post": ("sp", "sp+recompute")}
for name in BUILDERS:
    for option in ONLY.get(name, ("sp", "sp+recompute", "sp+recompute+mlp")):
        check(f"{name}/{option}", compare, name, option)


# Collectives per layer (2-layer minus 1-layer stack): the all-reduce pair of each block
# becomes an all-gather + reduce-scatter pair, and backward gathers each column linear's
# input again (it stored only this rank's samples).
PER_LAYER = {"forward": {"all_gather": 2, "reduce_scatter": 2}, "backward": {"all_gather": 4, "reduce_scatter": 2}}


def counts() -> None:
    got = {}
    for layers in (1, 2):
        with smp_tp.tp_config(optimize="speed"):
            m = smp_tp.DistributedTransformer(layers, 4, 4, H, 32, 0.0, 0.0, sequence_parallel=True,
                                              recompute_attention=True)
        with smp_tp.collective_counts() as c:
            m(hidden(rank).requires_grad_(True)).pow(2).mean().backward()
        got[layers] = c.total()
    per_layer = {ph: {k: v - got[1][ph].get(k, 0) for k, v in got[2][ph].items() if v != got[1][ph].get(k, 0)}
                 for ph in ("forward", "backward")}
    if per_layer != PER_LAYER:
        raise AssertionError(f"per-layer collectives {per_layer} != {PER_LAYER}")
    if rank == 0:
        log(f"collectives per layer (speed, sequence_parallel): {per_layer}; whole 1-layer stack {got[1]}")


check("counts", counts)


def bitwise() -> None:
    """With dropout on, each recomputation option gives bit-for-bit the outputs (two calls:
    the dropout streams move on), input gradients and parameter gradients of storing."""
    def run(label: str, **kw) -> list[torch.Tensor]:
        smp_tp.set_tensor_parallel_seed(7)
        torch.manual_seed(0)
        with smp_tp.tp_config(optimize="speed"):
            m = smp_tp.DistributedTransformer(2, 4, 4, H, 32, 0.2, 0.2, "gelu_new", causal_mask_size=S,
                                              pre_layernorm=True, post_layernorm=False, **kw)
        x = hidden(200 + rank).requires_grad_(True)
        ys = [m(x), m(x)]
        (ys[0].pow(2).mean() + ys[1].pow(3).mean()).backward()
        return [*ys, x.grad, *(p.grad for p in m.parameters())]

    for sp in (False, True):
        want = run("stored", sequence_parallel=sp)
        if torch.equal(want[0], want[1]):
            raise AssertionError("dropout is off: the two calls are equal")
        for label, kw in (("recompute", dict(recompute_attention=True)),
                          ("mlp", dict(recompute_mlp_activation=True)),
                          ("both", dict(recompute_attention=True, recompute_mlp_activation=True))):
            got = run(label, sequence_parallel=sp, **kw)
            for i, (g, w) in enumerate(zip(got, want)):
                if g is None or w is None or not torch.equal(g, w):
                    diff = None if g is None or w is None else (g - w).abs().max().item()
                    raise AssertionError(f"sp={sp} {label}: tensor {i} differs from storing ({diff})")
    if rank == 0:
        log("bitwise: recompute_attention / recompute_mlp_activation / both == stored, with and without sp")


check("bitwise", bitwise)



def saved() -> None:
    got = {}
    for name, kw in (("speed", {}), ("sp", dict(sequence_parallel=True)),
                     ("sp+recompute", dict(sequence_parallel=True, recompute_attention=True)),
                     ("sp+recompute+mlp", dict(sequence_parallel=True, recompute_attention=True,
                                               recompute_mlp_activation=True)),
                     ("recompute", dict(recompute_attention=True))):
        torch.manual_seed(0)
        layer = smp_tp.DistributedTransformerLayer(4, 16, 64, 256, 0.1, 0.1, optimize="speed", **kw)
        got[name] = saved_bytes(layer, torch.randn(2, 32, 64, requires_grad=True))
    if not got["sp+recompute"] < got["sp"] < got["speed"] or not got["sp+recompute"] < got["recompute"] < got["speed"]:
        raise AssertionError(f"saved bytes {got}")
    # the activation function's output, (tokens of the TP group, intermediate / T) floats, is no longer stored
    if got["sp+recompute"] - got["sp+recompute+mlp"] != 2 * T * 32 * 256 // T * 4:
        raise AssertionError(f"saved bytes {got}: recompute_mlp_activation should drop one (tokens, 256/T) tensor")
    if rank == 0:
        log(f"saved bytes per rank (tp={T}): {got}; sp/speed {got['sp'] / got['speed']:.3f}, "
            f"sp+recompute/speed {got['sp+recompute'] / got['speed']:.3f}, "
            f"sp+recompute+mlp/speed {got['sp+recompute+mlp'] / got['speed']:.3f}")


check("saved bytes", saved)


def errors() -> None:
    for kw, text in ((dict(prescaled_batch=True), "scaled-batch"), (dict(optimize="memory"), "optimize='speed'")):
        try:
            smp_tp.DistributedTransformerLayer(4, 4, H, 32, sequence_parallel=True, **kw)
        except ValueError as e:
            if text not in str(e):
                raise AssertionError(f"{e!r} lacks {text!r}") from e
        else:
            raise AssertionError(f"no error for sequence_parallel with {kw}")


check("errors", errors)
finish(failures)
