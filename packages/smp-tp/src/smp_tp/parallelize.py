"""``parallelize``: replace marked modules with their distributed implementations (§5.2)."""

from __future__ import annotations

import dataclasses
import inspect
import threading
import warnings
from typing import Any

from torch import nn

from smp_tp import builtin as _builtin  # noqa: F401  (registers nn.Linear/Embedding/LayerNorm)
from smp_tp.architectures import VocabPlan, vocab_plan
from smp_tp.checkpoint import load_full_into
from smp_tp.decisions import Cause, TPDecision, Treatment
from smp_tp.group import ProcessGroup
from smp_tp.hf import register_hf_if_loaded
from smp_tp.layers.block import DistributedBlock
from smp_tp.layers.vocab import VocabParallelEmbedding, VocabParallelLMHead, sharded_logits
from smp_tp.loss import VocabParallelCausalLMLoss
from smp_tp.module import DistributedModule
from smp_tp.random import set_tensor_parallel_seed
from smp_tp.registry import (
    INIT_ARGS,
    Registration,
    is_tensor_parallel_enabled,
    lookup,
    registered_base,
)
from smp_tp.state import check_optimize, tp_config


def _ownership(model: nn.Module) -> tuple[dict[int, set[str]], dict[int, int]]:
    """Parameter id → paths of the modules that hold it directly; module id → #paths."""
    owners: dict[int, set[str]] = {}
    uses: dict[int, int] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        uses[id(m)] = uses.get(id(m), 0) + 1
        for _, p in m.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), set()).add(path)
    return owners, uses


def _within(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def _shares_parameters(m: nn.Module, path: str, owners: dict[int, set[str]]) -> bool:
    return any(
        not _within(o, path)
        for _, p in m.named_parameters(remove_duplicate=False)
        for o in owners.get(id(p), ())
    )


def _generic(module: nn.Module, reg: Registration) -> DistributedModule:
    """Build a user-registered replacement from the recorded constructor arguments."""
    recorded = getattr(module, INIT_ARGS, None)
    if recorded is None:
        raise ValueError(
            f"smp_tp: {type(module).__name__} was created before it was registered with "
            f"tp_register; register the class first so its constructor arguments are recorded"
        )
    args, kwargs = recorded
    if reg.init_hook is not None:
        args, kwargs = reg.init_hook(*args, **kwargs)
    dist = reg.dist_cls(*args, **kwargs)
    to_full, from_full = reg.weight_hooks or (dict, dict)
    try:
        load_full_into(dist, to_full(module.state_dict()))
    except (KeyError, ValueError) as e:
        raise ValueError(
            f"smp_tp: cannot copy the weights of {type(module).__name__} into "
            f"{reg.dist_cls.__name__} ({e}); pass weight_hooks=(to_full, from_full) to tp_register"
        ) from e
    dist.train(module.training)
    object.__setattr__(dist, "_smp_tp_to_full", to_full)
    object.__setattr__(dist, "_smp_tp_from_full", from_full)
    if reg.forward_hook is not None or reg.return_hook is not None:
        run, fh, rh = dist.forward, reg.forward_hook, reg.return_hook

        def forward(*a: Any, **k: Any) -> Any:
            if fh is not None:
                a, k = fh(*a, **k)
            out = run(*a, **k)
            return rh(out) if rh is not None else out

        object.__setattr__(dist, "forward", forward)
    return dist


def _convert(module: nn.Module, path: str, quiet: bool) -> tuple[DistributedModule | None, list[str]]:
    """The replacement (None: the converter declined) and, when ``quiet``, the warnings the
    converter gave (the caller records them as the reason instead of printing them)."""
    reg = lookup(module)
    assert reg is not None
    try:
        if not quiet:
            return (reg.converter(module) if reg.converter is not None else _generic(module, reg)), []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = reg.converter(module) if reg.converter is not None else _generic(module, reg)
        return out, [str(w.message) for w in caught]
    except ValueError as e:
        raise ValueError(f"smp_tp.parallelize: module {path or '<root>'!r}: {e}") from e


def _treatment(original: nn.Module, replacement: DistributedModule) -> Treatment:
    if isinstance(replacement, DistributedBlock):
        return Treatment.BLOCK
    if isinstance(replacement, (VocabParallelEmbedding, VocabParallelLMHead)):
        return Treatment.VOCAB
    if type(original) is nn.Linear:
        return Treatment.PER_LINEAR
    return Treatment.LAYER


def _vocab_owners(model: nn.Module) -> dict[int, str]:
    """Module id → class name of the outermost model naming it as its input embedding or
    output head (Hugging Face's accessors): what ``tp_register_vocab_parallel`` would take."""
    found: dict[int, str] = {}
    for m in model.modules():
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            fn = getattr(m, getter, None)
            try:
                target = fn() if callable(fn) else None
            except (AttributeError, NotImplementedError):  # (a model without that module)
                target = None
            if isinstance(target, nn.Module):
                found.setdefault(id(target), type(m).__name__)
    return found


def _replaced(path: str, original: nn.Module, replacement: DistributedModule,
              parent: nn.Module | None, vocab_owner: str | None) -> TPDecision:
    kind = _treatment(original, replacement)
    name = type(original).__name__
    if kind is Treatment.BLOCK:
        return TPDecision(path, name, kind, "Megatron column -> row block: one collective pair")
    if vocab_owner is not None and kind in (Treatment.PER_LINEAR, Treatment.LAYER):
        # An embedding split over the hidden dimension, or a head gathering its outputs:
        # correct, but the vocabulary-parallel pair is what a language model wants.
        return TPDecision(path, name, kind,
                          f"{type(replacement).__name__}, not vocabulary-parallel: register "
                          f"tp_register_vocab_parallel({vocab_owner})",
                          remedy="tp_register_vocab_parallel")
    if kind is Treatment.PER_LINEAR:
        owner = type(parent).__name__ if parent is not None else "the model"
        return TPDecision(path, name, kind,
                          f"no block mapping for {owner}: one collective per nn.Linear "
                          f"(register one with tp_register_block({owner}, column=..., row=...))",
                          remedy="tp_register_block")
    return TPDecision(path, name, kind, f"replaced by {type(replacement).__name__}")


# ------------------------------------------------------------------ vocabulary plans


def _resolve(owner: nn.Module, path: str | None, getter: str) -> nn.Module | None:
    if path is None:
        fn = getattr(owner, getter, None)
        return fn() if callable(fn) else None
    return owner.get_submodule(path) if path else None


def _set_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, new)


_pending = threading.local()


def _labels_given(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    if kwargs.get("labels") is not None:
        return True
    if not args:
        return False
    try:
        bound = inspect.signature(type(module).forward).bind_partial(None, *args, **kwargs)
    except TypeError:
        return False
    return bound.arguments.get("labels") is not None


def _loss_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Auto mode: while a causal LM computes its loss from labels, its head returns shards."""
    stack = _pending.__dict__.setdefault("stack", [])
    head_path = module.__dict__.get("_smp_tp_vocab_head")
    head = module.get_submodule(head_path) if head_path is not None else None
    if isinstance(head, VocabParallelLMHead) and _labels_given(module, args, kwargs):
        ctx = sharded_logits(head)
        ctx.__enter__()
        stack.append(ctx)
    else:
        stack.append(None)


def _loss_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    stack = _pending.__dict__.get("stack")
    ctx = stack.pop() if stack else None
    if ctx is not None:
        ctx.__exit__(None, None, None)


def _seq2seq_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Encoder-decoder LMs (T5) compute ``CrossEntropyLoss`` on the logits inline: with
    ``labels``, run the forward without them (decoder inputs from the labels, as the model
    would) and with the head returning shards; the post-hook computes the loss."""
    stack = _pending.__dict__.setdefault("stack", [])
    head_path = module.__dict__.get("_smp_tp_vocab_head")
    head = module.get_submodule(head_path) if head_path is not None else None
    sig = inspect.signature(type(module).forward)
    try:
        bound = sig.bind(None, *args, **kwargs)
    except TypeError:
        bound = None
    labels = bound.arguments.get("labels") if bound is not None else None
    if not isinstance(head, VocabParallelLMHead) or labels is None or bound is None:
        stack.append(None)
        return None
    first = next(iter(sig.parameters))
    call: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            call.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL and name != first:
            call[name] = value
    call.pop("labels")
    if call.get("decoder_input_ids") is None and call.get("decoder_inputs_embeds") is None:
        call["decoder_input_ids"] = module.prepare_decoder_input_ids_from_labels(labels=labels)  # type: ignore[operator]
    ctx = sharded_logits(head)
    ctx.__enter__()
    stack.append((ctx, head, labels))
    return (), call


def _seq2seq_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    stack = _pending.__dict__.get("stack")
    entry = stack.pop() if stack else None
    if entry is None:
        return None
    ctx, head, labels = entry
    ctx.__exit__(None, None, None)
    if output is None:  # the forward raised (hook called with always_call)
        return None
    logits = output[0] if isinstance(output, tuple) else output.logits
    # T5's own loss: mean cross entropy over the non-ignored labels (-100) of the batch
    loss = head.cross_entropy(logits.float(), labels.to(logits.device))
    if isinstance(output, tuple):
        return (loss, *output)
    return dataclasses.replace(output, loss=loss)


def _same_table(a: nn.Embedding, b: nn.Embedding) -> bool:
    return (a.num_embeddings, a.embedding_dim, a.padding_idx, a.norm_type, a.sparse, a.max_norm,
            a.scale_grad_by_freq) == (b.num_embeddings, b.embedding_dim, b.padding_idx, b.norm_type,
                                      b.sparse, b.max_norm, b.scale_grad_by_freq)


def _install_loss(owner: nn.Module, head_rel: str, plan: VocabPlan, vhead: VocabParallelLMHead) -> None:
    object.__setattr__(owner, "_smp_tp_vocab_head", head_rel)
    if not plan.hf_seq2seq_lm:
        owner.loss_function = VocabParallelCausalLMLoss(vhead)  # type: ignore[assignment]
    if owner.__dict__.get("_smp_tp_loss_hooks"):
        return
    pre, post = (_seq2seq_pre_hook, _seq2seq_post_hook) if plan.hf_seq2seq_lm else (_loss_pre_hook, _loss_post_hook)
    owner.register_forward_pre_hook(pre, with_kwargs=True)
    owner.register_forward_hook(post, with_kwargs=True, always_call=True)
    object.__setattr__(owner, "_smp_tp_loss_hooks", True)


def _apply_vocab_plan(model: nn.Module, owner: nn.Module, plan: VocabPlan,
                      record: list[TPDecision] | None) -> None:
    emb = _resolve(owner, plan.embedding, "get_input_embeddings")
    if type(emb) is not nn.Embedding or not is_tensor_parallel_enabled(emb):
        return
    assert isinstance(emb, nn.Embedding)
    if emb.max_norm is not None or emb.scale_grad_by_freq:
        warnings.warn("smp_tp: an nn.Embedding with max_norm or scale_grad_by_freq cannot be "
                      "vocabulary-parallel", stacklevel=4)
        return
    head = _resolve(owner, plan.head, "get_output_embeddings")
    owners, uses = _ownership(model)
    paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
    emb_path = paths[id(emb)]
    w = emb.weight
    tied = head is not None and getattr(head, "weight", None) is w
    usable_head = (
        type(head) is nn.Linear and is_tensor_parallel_enabled(head)  # type: ignore[arg-type]
        and tuple(head.weight.shape) == tuple(w.shape) and uses.get(id(head), 1) == 1
    )
    if tied and not usable_head:
        return  # the tie cannot be kept; parallelize() leaves both and warns
    head_path = paths[id(head)] if usable_head else None
    # further embedding modules holding the same parameter (T5: encoder/decoder.embed_tokens)
    aliases = [p for p, m in model.named_modules() if m is not emb and type(m) is nn.Embedding
               and m.weight is w and _same_table(m, emb) and is_tensor_parallel_enabled(m)
               and uses.get(id(m), 1) == 1]
    allowed = {emb_path, *aliases} | ({head_path} if tied else set())
    if uses.get(id(emb), 1) > 1 or not owners.get(id(w), set()) <= allowed:
        return
    if usable_head and not tied:
        assert isinstance(head, nn.Linear)
        if any(not owners.get(id(p), set()) <= {head_path} for p in head.parameters()):
            usable_head = False
    vemb = VocabParallelEmbedding(
        emb.num_embeddings, emb.embedding_dim, emb.padding_idx, None, emb.norm_type, False,
        emb.sparse, dtype=w.dtype, device=w.device,
    )
    vemb.load_full_weight(w.detach())
    vemb.train(emb.training)
    _set_module(model, emb_path, vemb)
    vocab_reason = f"tp_register_vocab_parallel({type(owner).__name__})"
    if record is not None:
        record.append(TPDecision(emb_path, type(emb).__name__, Treatment.VOCAB, vocab_reason))
    for path in aliases:
        alias = model.get_submodule(path)
        # built on the meta device, then given the shared shard: one parameter, as before
        twin = VocabParallelEmbedding(
            emb.num_embeddings, emb.embedding_dim, emb.padding_idx, None, emb.norm_type, False,
            emb.sparse, dtype=w.dtype, device="meta",
        )
        twin.weight = vemb.weight
        twin.train(alias.training)
        _set_module(model, path, twin)
        if record is not None:
            record.append(TPDecision(path, type(alias).__name__, Treatment.VOCAB,
                                     f"{vocab_reason}, sharing {emb_path}'s shard"))
    if not usable_head:
        return
    assert isinstance(head, nn.Linear) and head_path is not None
    vhead = VocabParallelLMHead(
        emb.embedding_dim, emb.num_embeddings, head.bias is not None, tie_to=vemb if tied else None,
        gather_output=None if plan.hf_causal_lm or plan.hf_seq2seq_lm else False, dtype=w.dtype,
        device=w.device,
    )
    vhead.load_full_weight(head.weight.detach(), head.bias.detach() if head.bias is not None else None)
    vhead.train(head.training)
    _set_module(model, head_path, vhead)
    if record is not None:
        tie = f", tied to {emb_path} (one shard)" if tied else ""
        record.append(TPDecision(head_path, type(head).__name__, Treatment.VOCAB, vocab_reason + tie))
    if plan.hf_causal_lm or plan.hf_seq2seq_lm:
        owner_path = paths[id(owner)]
        rel = head_path[len(owner_path) + 1:] if owner_path else head_path
        _install_loss(owner, rel, plan, vhead)


def _apply_vocab_plans(model: nn.Module, record: list[TPDecision] | None) -> None:
    """Vocabulary-parallel embeddings/heads of registered models, outermost model first."""
    for _, owner in list(model.named_modules()):
        plan = vocab_plan(owner)
        if plan is not None:
            _apply_vocab_plan(model, owner, plan, record)


def _outside(m: nn.Module, path: str, owners: dict[int, set[str]]) -> list[str]:
    """The modules outside ``m`` holding one of its parameters."""
    return sorted({o for _, p in m.named_parameters(remove_duplicate=False)
                   for o in owners.get(id(p), ()) if not _within(o, path)})


def parallelize(
    model: nn.Module,
    tp_group: ProcessGroup = None,
    prescaled_batch: bool = False,
    optimize: str = "speed",
    tensor_parallel_seed: int | None = None,
    *,
    record: list[TPDecision] | None = None,
) -> nn.Module:
    """Replace, in place, every module that

    1. has a distributed implementation (built-in or registered),
    2. is marked (``tensor_parallelism()`` / ``set_tensor_parallelism()``),
    3. has no ancestor already replaced, and
    4. shares no parameter with a module outside it (and is not reused at several places),

    by its distributed version holding this rank's slices of the *original* weights, and
    return the model (the replacement itself when the root module is replaced).

    ``record``: a list that receives a :class:`~smp_tp.decisions.TPDecision` for every module
    replaced and every module holding parameters left whole, with the reason. Passing one
    also silences the warnings about modules left whole: the caller reports them (smp's
    ``model.report()`` warns once per kind, naming the remedy).
    """
    check_optimize(optimize)
    if tensor_parallel_seed is not None:
        set_tensor_parallel_seed(tensor_parallel_seed)
    register_hf_if_loaded()
    with tp_config(tp_group=tp_group, prescaled_batch=prescaled_batch, optimize=optimize):
        _apply_vocab_plans(model, record)
    owners, uses = _ownership(model)
    quiet = record is not None
    vocab_owners = _vocab_owners(model) if quiet else {}

    def keep(m: nn.Module, path: str, cause: Cause, reason: str, remedy: str | None = None) -> None:
        if record is not None:
            record.append(TPDecision(path, type(m).__name__, Treatment.REPLICATED, reason, cause, remedy))

    def eligible(m: nn.Module, path: str) -> bool:
        if isinstance(m, DistributedModule):
            return False
        marked = is_tensor_parallel_enabled(m)
        own = any(True for _ in m.parameters(recurse=False))
        if lookup(m) is None:
            base = registered_base(m)
            if marked and base is not None:
                # A subclass may change the maths (Gemma2's embedding scales its output),
                # so only the exact type is replaced; the user can register the subclass.
                keep(m, path, Cause.SUBCLASS,
                     f"a subclass of {base.__name__}: only exact types are replaced (a "
                     f"subclass may change the maths); register it with tp_register_with_module",
                     "tp_register_with_module")
            elif own:
                if marked:
                    keep(m, path, Cause.NO_MAPPING, f"no distributed implementation for {type(m).__name__}")
                else:
                    keep(m, path, Cause.UNMARKED, "not marked for tensor parallelism")
            return False
        if not marked:
            if own:
                keep(m, path, Cause.UNMARKED, "not marked for tensor parallelism")
            return False
        if uses.get(id(m), 1) > 1 or _shares_parameters(m, path, owners):
            others = _outside(m, path, owners)
            if quiet:
                what = f"shares parameters with {', '.join(others)}" if others else "is used at several places"
                keep(m, path, Cause.SHARED,
                     f"{what} (tied weights stay whole); tp_register_vocab_parallel keeps a "
                     f"tied nn.Embedding and head as one shard", "tp_register_vocab_parallel")
            else:
                warnings.warn(
                    f"smp_tp: {path or '<root>'} ({type(m).__name__}) shares parameters or is "
                    f"reused; left unreplaced", stacklevel=3,
                )
            return False
        return True

    def replace(m: nn.Module, path: str, parent: nn.Module | None) -> DistributedModule | None:
        replacement, said = _convert(m, path, quiet)
        if replacement is None:
            # A registration of the user's own for the class wins over the built-in one.
            keep(m, path, Cause.DECLINED, "; ".join(said) or f"the {type(m).__name__} converter declined it",
                 "tp_register_with_module")
        elif record is not None:
            record.append(_replaced(path, m, replacement, parent, vocab_owners.get(id(m))))
        return replacement

    def visit(parent: nn.Module, path: str) -> None:
        for name, child in list(parent.named_children()):
            cpath = f"{path}.{name}" if path else name
            if isinstance(child, DistributedModule):
                continue
            if eligible(child, cpath):
                replacement = replace(child, cpath, parent)
                if replacement is not None:
                    setattr(parent, name, replacement)
                    continue
            visit(child, cpath)

    with tp_config(tp_group=tp_group, prescaled_batch=prescaled_batch, optimize=optimize):
        if eligible(model, ""):
            replacement = replace(model, "", None)
            if replacement is not None:
                return replacement
        visit(model, "")
    return model
