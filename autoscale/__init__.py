"""autoscale: mixed-precision training as compiler passes.

``torch.compile(model, backend="autoscale")`` runs the forward and backward in float16 where that
is safe and float32 where it is not, with float32 master weights. See README.md and DESIGN.md.

Importing this package is cheap: it does not import triton, Inductor or initialise CUDA.
"""

from __future__ import annotations

from autoscale.backend import Backend, CompileRecord, backend
from autoscale.config import Config, ScalingConfig, recipe, recipe_names
from autoscale.inspect import PrecisionReport
from autoscale.scaler import GradScaler, LayerReport

__all__ = [
    "Backend",
    "CompileRecord",
    "Config",
    "GradScaler",
    "LayerReport",
    "PrecisionReport",
    "ScalingConfig",
    "backend",
    "recipe",
    "recipe_names",
]

__version__ = "0.1.0"
