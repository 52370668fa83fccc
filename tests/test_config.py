from __future__ import annotations

import dataclasses

import pytest
import torch

import autoscale
from autoscale import Config, ScalingConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": torch.float32}, r"Config.dtype=torch.float32 is not valid; allowed values: torch.float16"),
        ({"dtype": "int8"}, r"Config.dtype='int8' is not valid; .* or 'float8'"),
        ({"float8": "yes"}, r"Config.float8='yes' is not valid; it must be a bool"),
        ({"quant": 8}, r"Config.quant must be a QuantConfig or None"),
        ({"compute": "fast"}, r"Config.compute='fast' is not valid; allowed values: 'auto', 'native', 'emulate'"),
        ({"executor": "tvm"}, r"Config.executor='tvm' is not valid; allowed values: 'inductor', 'eager'"),
        ({"allow": "linear"}, r"Config.allow must be a tuple of op names"),
        ({"deny": ("",)}, r"Config.deny must contain op names"),
        ({"allow": ("mm",), "deny": ("mm",)}, r"op 'mm' is listed in both Config.allow and Config.deny"),
        ({"scaling": "adaptive"}, r"Config.scaling must be a ScalingConfig"),
        ({"overflow": False}, r"Config.overflow must be an OverflowConfig"),
        ({"form": "gpu"}, r"Config.form='gpu' is not valid; allowed values: 'default', 'fewer_launches'"),
    ],
)
def test_invalid_config_names_field_and_allowed_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(**kwargs)


def test_float8_is_float16_storage_with_float8_gemm_inputs() -> None:
    assert Config(dtype="float8") == Config(dtype="fp8") == Config(dtype=torch.float16, float8=True)
    assert autoscale.recipe("fp8").float8 and autoscale.recipe("fp8").dtype == torch.float16


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"grad_bits": 1}, r"QuantConfig.grad_bits=1 is not valid; it must be None or an int in \[2, 16\]"),
    ({"momentum": 1.0}, r"QuantConfig.momentum=1.0 is not valid"),
    ({"weights": 1}, r"QuantConfig.weights=1 is not valid; it must be a bool"),
])
def test_invalid_quant_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        autoscale.QuantConfig(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "auto"}, r"ScalingConfig.mode='auto' is not valid; allowed values: 'adaptive', 'dynamic'"),
    ({"gamma": 0.0}, r"ScalingConfig.gamma=0.0 is not valid"),
    ({"point_kernel": "triton"},
     r"ScalingConfig.point_kernel='triton' is not valid; allowed values: 'inductor', 'fused'"),
])
def test_invalid_scaling_config(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScalingConfig(**kwargs)


def test_config_is_frozen_normalized_and_hashable() -> None:
    cfg = Config(dtype="bf16", allow=["my_op"])  # type: ignore[arg-type]
    assert cfg.dtype is torch.bfloat16 and cfg.allow == ("my_op",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dtype = torch.float16  # type: ignore[misc]
    assert hash(cfg) == hash(Config(dtype=torch.bfloat16, allow=("my_op",)))
    assert cfg.op_overrides == {"my_op": "allow"}


def test_compute_auto_resolves_by_device() -> None:
    assert Config().resolved(torch.device("cpu")).compute == "emulate"
    assert Config().resolved(torch.device("cuda")).compute == "native"
    assert Config(compute="native").resolved(torch.device("cpu")).compute == "native"


def test_recipes() -> None:
    assert autoscale.recipe("debug").executor == "eager"
    assert autoscale.recipe("bf16", executor="eager") == Config(dtype=torch.bfloat16, executor="eager")
    assert set(autoscale.recipe_names()) >= {"default", "debug", "bf16"}
    with pytest.raises(ValueError, match="unknown recipe 'fast'; known recipes: 'default'"):
        autoscale.recipe("fast")


def test_backend_refuses_non_config() -> None:
    with pytest.raises(ValueError, match="must be an autoscale.Config"):
        autoscale.backend({"dtype": "float16"})  # type: ignore[arg-type]
