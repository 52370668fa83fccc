"""``import autoscale`` stays lean: no triton, no Inductor, no model library, no training framework,
no CUDA initialisation."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys, torch
import autoscale
libraries = ("triton", "transformers", "accelerate", "lightning", "autoscale.integrations")
heavy = sorted(m for m in sys.modules
               if m in libraries or m.startswith(tuple(f"{name}." for name in libraries) + ("torch._inductor",)))
assert not heavy, heavy
assert not torch.cuda.is_initialized()
print("lean")
"""


def test_import_is_lean() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lean"


def test_public_api() -> None:
    import autoscale

    assert set(autoscale.__all__) == {
        "Backend", "CompileRecord", "Config", "ConvertedFileError", "ConvertedModule", "FakeQuant", "GradScaler",
        "GraphDiff", "LayerReport", "NonFiniteForwardError", "OverflowConfig", "PrecisionReport", "QuantConfig",
        "ScalingConfig", "backend", "convert", "diff", "load", "recipe", "recipe_names", "save"}
    for name in autoscale.__all__:
        assert getattr(autoscale, name).__doc__
