"""Import-level checks and single-process behaviour (no process group: degree 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import smp_tp
import torch
from torch import nn


def test_version() -> None:
    assert smp_tp.__version__.count(".") == 2


def test_imports_without_mpi4py_and_transformers() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('mpi4py', 'transformers'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import smp_tp, torch\n"
        "m = smp_tp.parallelize(smp_tp.set_tensor_parallelism(torch.nn.Sequential(torch.nn.Linear(4, 4))))\n"
        "assert type(m[0]).__name__ == 'DistributedLinear'\n"
        "assert 'mpi4py' not in sys.modules and 'transformers' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_public_api() -> None:
    for name in smp_tp.__all__:
        assert hasattr(smp_tp, name), name
    for cls in ("DistributedLinear", "DistributedEmbedding", "DistributedLayerNorm",
                "DistributedAttentionLayer", "DistributedTransformerOutputLayer",
                "DistributedTransformerLayer", "DistributedTransformer",
                "DistributedTransformerLMHead"):
        assert issubclass(getattr(smp_tp, cls), smp_tp.DistributedModule)


def test_single_process_transformer_layer_matches_plain_torch() -> None:
    """Degree 1: the layer is ordinary maths; check it against a hand-written BERT layer."""
    torch.manual_seed(0)
    layer = smp_tp.DistributedTransformerLayer(4, 8, 32, 64, 0.0, 0.0, "gelu")
    x = torch.randn(2, 5, 32)
    sd = layer.state_dict()

    def lin(t, n):
        return nn.functional.linear(t, sd[f"{n}.weight"], sd[f"{n}.bias"])

    def ln(t, n):
        return nn.functional.layer_norm(t, (32,), sd[f"{n}.weight"], sd[f"{n}.bias"], 1e-5)

    q, k, v = (lin(x, f"attention.{n}").view(2, 5, 4, 8).transpose(1, 2) for n in ("query", "key", "value"))
    att = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v
    a = ln(x + lin(att.transpose(1, 2).reshape(2, 5, 32), "attention.dense"), "attention.post_layernorm")
    h = lin(nn.functional.gelu(lin(a, "output.dense_h_to_4h")), "output.dense_4h_to_h")
    want = ln(a + h, "output.post_layernorm")
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_tensor_parallelism_context_marks_modules() -> None:
    with smp_tp.tensor_parallelism():
        a = nn.Linear(2, 2)
        with smp_tp.tensor_parallelism(enabled=False):
            b = nn.Linear(2, 2)
    c = nn.Linear(2, 2)
    assert smp_tp.is_tensor_parallel_enabled(a)
    assert not smp_tp.is_tensor_parallel_enabled(b)
    assert not smp_tp.is_tensor_parallel_enabled(c)
    assert nn.Module.__init__.__name__ == "__init__" and "marking" not in repr(nn.Module.__init__)


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="optimize"):
        smp_tp.parallelize(nn.Linear(2, 2), optimize="fast")
    with pytest.raises(ValueError, match="max_norm"):
        smp_tp.DistributedEmbedding(10, 4, max_norm=1.0)
    with pytest.raises(ValueError, match="activation"):
        smp_tp.DistributedTransformerOutputLayer(8, 16, activation="swish")
    with pytest.raises(TypeError, match="DistributedModule"):
        smp_tp.tp_register_with_module(nn.ReLU, nn.Linear)
