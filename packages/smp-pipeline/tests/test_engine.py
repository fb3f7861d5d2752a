"""smp_pipeline.engine: a backward segment calls the engine directly, with torch's results."""

from __future__ import annotations

import pytest
import torch
from smp_pipeline import engine
from smp_pipeline.autograd import run_segment


def _graph(seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    y = torch.tanh(lin(x))
    return lin, x, y, torch.randn(3, 8)


def _counting_backward(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    public = torch.autograd.backward

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        public(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.autograd, "backward", counted)
    return calls


def test_segment_skips_the_public_call_and_matches_it_bitwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lin_ref, x_ref, y_ref, g_ref = _graph()
    torch.autograd.backward([y_ref], [g_ref])
    calls = _counting_backward(monkeypatch)
    lin, x, y, g = _graph()
    run_segment([y], [g], retain=False)
    assert calls == []  # the engine was called directly (the old code called backward)
    assert x.grad is not None and lin.weight.grad is not None
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(lin.weight.grad, lin_ref.weight.grad)
    assert torch.equal(lin.bias.grad, lin_ref.bias.grad)


def test_retain_graph_is_passed_on() -> None:
    _, x, y, g = _graph()
    engine.run_backward([y], [g], True)
    engine.run_backward([y], [g], True)  # the graph is still there
    _, x2, y2, g2 = _graph()
    engine.run_backward([y2], [g2], False)
    with pytest.raises(RuntimeError, match="second time"):
        engine.run_backward([y2], [g2], False)
    assert x.grad is not None and torch.equal(x.grad, 2 * x2.grad)  # type: ignore[operator]


def test_what_torch_checks_goes_through_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting_backward(monkeypatch)
    _, _, y, g = _graph()
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        engine.run_backward([y], [g[:2]], False)  # torch's own error names the mismatch
    assert calls == [1]
    _, x, y, _ = _graph()
    engine.run_backward([y.sum()], [None], False)  # a None gradient: torch makes the ones
    assert calls == [1, 1] and x.grad is not None
