"""The command line: formats, output file, exit code 2 on bad input; import hygiene."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from conftest import BAD, t5_like
from smp_partition import ModuleGraph
from smp_partition.cli import main


@pytest.fixture()
def graph_file(tmp_path: Path) -> Path:
    path = tmp_path / "t5.json"
    t5_like(6).to_json(path)
    return path


def test_table(graph_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(graph_file), "--devices", "4", "--alpha", "0.8"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "4 devices, alpha 0.8, method default" in out
    rows = [ln.split() for ln in lines if ln.startswith(" ") and ln.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert sum(float(r[1]) for r in rows) == pytest.approx(1.0, abs=1e-3)
    assert "lower bound" in out and "gap" in out and "cut edges" in out


def test_json_to_file(graph_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    assert (
        main([str(graph_file), "-d", "3", "--method", "paper", "-f", "json", "-o", str(out)]) == 0
    )
    data = json.loads(out.read_text())
    assert data["schema"] == "smp-partition/assignment@1" and data["method"] == "paper"
    assert set(data["assignment"]) == {m.name for m in ModuleGraph.from_json(graph_file)}


def test_dot(graph_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(graph_file), "-d", "4", "-f", "dot"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("digraph partition {") and out.rstrip().endswith("}")
    assert "n0 -> n1;" in out and "fillcolor=" in out


def test_svg_is_xml_and_collapses_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "deep.json"
    t5_like(24).to_json(path)
    assert main([str(path), "-d", "4", "-f", "svg"]) == 0
    out = capsys.readouterr().out
    root = ET.fromstring(out)
    assert root.tag.endswith("svg")
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert any(t and t.startswith("block[") for t in titles)  # runs like block[0:6]
    assert len(titles) < 60  # 48 blocks do not each get a box


@pytest.mark.parametrize("case,data,message", BAD, ids=[b[0] for b in BAD])
def test_bad_graph_exit_2(
    case: str,
    data: dict[str, Any],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "bad.json"
    # the NaN case relies on json writing and reading the NaN extension
    path.write_text(json.dumps(data))
    assert main([str(path), "-d", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("smp-partition: error: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.parametrize(
    "args", [["-d", "0"], ["-d", "2", "--alpha", "1.5"], ["-d", "x"], ["-d", "2", "-f", "png"]]
)
def test_bad_arguments_exit_2(
    graph_file: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        if main([str(graph_file), *args]) == 2:
            raise SystemExit(2)
    assert info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_missing_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nope.json"), "-d", "2"]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_python_dash_m_and_no_heavy_imports(graph_file: Path) -> None:
    code = (
        "import sys, runpy\n"
        "import smp_partition, smp_partition.cli, smp_partition.render\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'heavy import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    done = subprocess.run(
        [sys.executable, "-m", "smp_partition", str(graph_file), "-d", "2"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0 and "max load" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "smp_partition", str(graph_file), "-d", "-1"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "--devices" in bad.stderr


def test_unwritable_output_exit_2(
    graph_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "no" / "such" / "dir.txt"
    assert main([str(graph_file), "-d", "2", "-o", str(target)]) == 2
    assert "dir.txt" in capsys.readouterr().err


def test_deep_chain_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from smp_partition import Module

    chain = [Module("", children=("c0",))] + [
        Module(f"c{i}", "M", (f"c{i + 1}",) if i < 2999 else (), {f"c{i}": 1}) for i in range(3000)
    ]
    path = tmp_path / "chain.json"
    ModuleGraph(chain).to_json(path)
    for fmt in ("svg", "dot"):
        assert main([str(path), "-d", "8", "-f", fmt]) == 0
    assert "(+ subtree)" in capsys.readouterr().out
