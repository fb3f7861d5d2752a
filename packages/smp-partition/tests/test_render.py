"""The drawings hold any module name: the SVG stays well-formed XML and shows the name."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest
from smp_partition import Module, ModuleGraph, partition
from smp_partition.render import dot, svg

SVG = "{http://www.w3.org/2000/svg}"
# Names a JSON graph may carry (JSON allows "\u0000"): XML 1.0 cannot hold the controls and
# U+FFFF at all, and & < > " ' must become entities.
AWKWARD = {
    "nul\x00name": "nul\\x00name",
    "a<b>&c": "a<b>&c",
    "say \"hi\" 'there'": "say \"hi\" 'there'",
    "bell\x07tab\tline\nend\r\x1f": "bell\\x07tab\\tline\\nend\\r\\x1f",
    "not\uffffchar": "not\\uffffchar",
}


def _graph() -> ModuleGraph:
    names = list(AWKWARD)
    # Distinct types, so that no run of siblings is drawn as one box.
    mods = [Module("", "Root\x00<&>", tuple(names))]
    mods += [Module(n, f"T{i}", (), {f"w{i}": 1000 * (i + 1)}) for i, n in enumerate(names)]
    return ModuleGraph(mods)


def test_svg_with_awkward_names_is_xml_and_shows_them() -> None:
    graph = _graph()
    result = partition(graph, num_devices=2)
    out = svg(graph, result, title="model\x00 <&> \"'")
    root = ET.fromstring(out)  # raised "not well-formed (invalid token)" on the NUL
    titles = [t.text for t in root.iter(f"{SVG}title")]
    for shown in AWKWARD.values():
        assert shown in titles, (shown, titles)
    assert "Root\\x00<&>" in titles  # the root box is labelled by its type
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "model\\x00 <&> \"'" in texts
    # Nothing XML cannot hold survives anywhere in the text, escaped or not.
    assert not any(ord(c) < 0x20 and c not in "\n" for c in out)


def test_dot_with_awkward_names_has_no_control_characters() -> None:
    graph = _graph()
    out = dot(graph, partition(graph, num_devices=2))
    assert not any(ord(c) < 0x20 and c != "\n" for c in out)
    assert 'label="nul\\\\x00name\\n' in out  # DOT's own backslash escape on top
    assert 'label="say \\"hi\\" \'there\'\\n' in out


@pytest.mark.parametrize("name", list(AWKWARD), ids=[ascii(n) for n in AWKWARD])
def test_each_awkward_name_alone_gives_xml(name: str) -> None:
    graph = ModuleGraph([Module("", "Root", (name,)), Module(name, "Leaf", (), {"w": 10})])
    root = ET.fromstring(svg(graph, partition(graph, num_devices=1), title=name))
    assert AWKWARD[name] in [t.text for t in root.iter(f"{SVG}title")]
