"""autoscale: mixed-precision training as compiler passes.

``torch.compile(model, backend="autoscale")`` runs the forward and backward in float16 where that
is safe and float32 where it is not, with float32 master weights; ``convert``/``save``/``load`` do
the same ahead of time, and ``diff`` shows what the passes changed. See README.md and docs/design.md.

(``autoscale.convert`` and ``autoscale.diff`` name the functions; their modules are imported as
``from autoscale.convert import ...`` and ``from autoscale.diff import ...``.)

Importing this package is cheap: it does not import triton, Inductor or initialise CUDA.
"""

from __future__ import annotations

from autoscale.backend import Backend, backend
from autoscale.config import Config, OverflowConfig, QuantConfig, ScalingConfig, recipe, recipe_names
from autoscale.convert import ConvertedFileError, ConvertedModule, convert, load, save
from autoscale.diff import GraphDiff, diff
from autoscale.inspect import PrecisionReport
from autoscale.overflow import NonFiniteForwardError
from autoscale.quant import FakeQuant
from autoscale.rewrite import CompileRecord
from autoscale.scaler import GradScaler, LayerReport

__all__ = [
    "Backend",
    "CompileRecord",
    "Config",
    "ConvertedFileError",
    "ConvertedModule",
    "FakeQuant",
    "GradScaler",
    "GraphDiff",
    "LayerReport",
    "NonFiniteForwardError",
    "OverflowConfig",
    "PrecisionReport",
    "QuantConfig",
    "ScalingConfig",
    "backend",
    "convert",
    "diff",
    "load",
    "recipe",
    "recipe_names",
    "save",
]

__version__ = "0.1.0"
