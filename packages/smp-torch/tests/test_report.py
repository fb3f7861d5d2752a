"""``model.report()``: what smp did to Gemma2, Phi-3 and a Llama at tp = 2 and pp = 2, and
to the Llama at sdp = 2 (one 2-rank job: see ``scripts/report.py``), and the table's layout
(no MPI job)."""

from __future__ import annotations

from pathlib import Path

from conftest import launch, ok_cases
from smp_torch.report import ModelReport, ModuleReport, fallback_messages

CASES = [f"{layout}_{model}" for layout in ("tp2", "pp2") for model in ("gemma2", "phi3", "llama")]
CASES.append("sdp2_llama")


def test_report_of_hf_models_at_tp2_and_pp2(tmp_path: Path) -> None:
    out = launch("report.py", 2, str(tmp_path), timeout=300)
    assert ok_cases(out) == CASES, out
    # print_report (the Llama at tp = 2): the table once, by rank 0.
    assert out.count("smp: LlamaForCausalLM: pp=1 tp=2") == 1, out


def _report() -> ModelReport:
    rows = (
        ModuleReport("", "M", None, "", "", None, 300),
        ModuleReport("a", "Block", None, "block", "Megatron", None, 100),
        ModuleReport("b.q", "Linear", None, "per-linear", "no block mapping for B", None, 50,
                     "tp_register_block"),
        ModuleReport("b.k", "Linear", None, "per-linear", "no block mapping for B", None, 50,
                     "tp_register_block"),
    )
    return ModelReport("M", 1, 2, 1, 1, rows)


def test_table_has_a_row_per_module_and_one_warning_per_fallback_kind() -> None:
    report = _report()
    lines = str(report).splitlines()
    assert lines[0] == "smp: M: pp=1 tp=2 sdp=1 rdp=1"
    assert lines[1].split() == ["module", "type", "stage", "tensor", "parallel", "shard", "unit",
                                "bytes/rank", "why"]
    assert lines[3].split()[:6] == ["<model>", "M", "-", "-", "-", "300"]
    assert lines[5].split()[:6] == ["b.q", "Linear", "-", "per-linear", "-", "50"]
    assert report.row("a").tp == "block"
    messages = fallback_messages(report)
    assert list(messages) == ["tp_register_block"]
    assert "2 module(s)" in messages["tp_register_block"] and "smp.tp_register_block(" in messages["tp_register_block"]
