"""autoscale.convert / save / load: ahead-of-time conversion (issue 5, part 1)."""

from __future__ import annotations

import copy
import dataclasses
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import autoscale
from autoscale.convert import (
    FORMAT_VERSION,
    MAGIC,
    ConvertedFileError,
    ConvertedModule,
    ConvertError,
    CorruptedFileError,
    FormatVersionError,
    NotConvertedFileError,
    TruncatedFileError,
    convert,
    load,
    save,
)
from autoscale.ops import rescale, watch
from autoscale.passes.graph_utils import PROVENANCE_KEY
from tests.helpers import Comparison, assert_matches_fp32, loss_of
from tests.models import conv_case, mlp_case, transformer_case

REPO = Path(__file__).resolve().parents[1]
# placement is compile-time ("all", the default, spelled out: these tests count the points)
EVERYWHERE = autoscale.Config(executor="eager", scaling=autoscale.ScalingConfig(placement="all"))
CASES = {"mlp": mlp_case, "conv": conv_case, "transformer": transformer_case}


def _rescales(converted: ConvertedModule) -> list[torch.fx.Node]:
    return [n for n in converted.graph_module.graph.nodes if n.op == "call_function" and n.target is rescale]


def _train(converted: nn.Module, scaler: autoscale.GradScaler, opt: torch.optim.Optimizer,
           inputs: tuple[torch.Tensor, ...], targets: torch.Tensor | None, steps: int) -> list[torch.Tensor]:
    """``steps`` steps of the torch.amp loop; returns the losses."""
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(converted, inputs, targets)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
    return losses


def _snapshot(converted: ConvertedModule, scaler: autoscale.GradScaler) -> dict[str, torch.Tensor]:
    """Everything that must match bit for bit: weights and buffers, per-layer scales and statistics."""
    state = {k: v.detach().clone() for k, v in converted.state_dict().items()}
    sd = scaler.state_dict()
    state.update({f"scaler.{k}": sd[k] for k in ("scales", "stats", "last_stats", "overflows", "skips")})
    return state


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ------------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("case", ["mlp", "conv"])  # (the transformer: in the Adam save/load test)
def test_converted_step_is_the_backends_bit_for_bit(case: str) -> None:
    """One scaled step of the converted module equals torch.compile with the eager executor: loss,
    every gradient, the scale state's statistics and seeded scales (same pipeline, same graph)."""
    model, inputs, targets = CASES[case]()
    twin = copy.deepcopy(model)
    converted = convert(model, inputs, config=EVERYWHERE)
    scaler = autoscale.GradScaler(converted, EVERYWHERE)
    loss = loss_of(converted, inputs, targets)
    scaler.scale(loss).backward()

    twin_scaler = autoscale.GradScaler(twin, EVERYWHERE)
    compiled = torch.compile(twin, backend=autoscale.backend(EVERYWHERE))
    twin_loss = loss_of(compiled, inputs, targets)
    twin_scaler.scale(twin_loss).backward()

    assert torch.equal(loss, twin_loss)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), name
    _assert_equal({"scales": scaler.state_dict()["scales"], "stats": scaler.state_dict()["stats"]},
                  {"scales": twin_scaler.state_dict()["scales"], "stats": twin_scaler.state_dict()["stats"]})


def test_converted_gradients_match_fp32_within_tolerance() -> None:
    model, inputs, targets = conv_case()
    reference = copy.deepcopy(model)
    converted = convert(model, inputs)  # the default config: emulated float16 on CPU
    loss = loss_of(converted, inputs, targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ref_loss = loss_of(reference, inputs, targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert_matches_fp32(Comparison(autoscale.backend(), loss.detach(), grads, ref_loss.detach(), ref_grads))
    assert not torch.equal(loss, ref_loss)  # really float16


def test_scale_points_and_provenance_are_in_the_graph() -> None:
    model, inputs, _ = mlp_case()
    converted = convert(model, inputs, config=EVERYWHERE)
    counts = {r.name: r.counts for r in converted.record.passes}["insert_grad_scaling"]
    # a scale point per Linear, an unscale point per parameter (six), no merge in an MLP
    assert (counts["scale_points"], counts["unscaled"], counts["aligned"]) == (3, 6, 0)
    points = _rescales(converted)
    assert len(points) == 9
    assert all(p.meta[PROVENANCE_KEY]["pass"] == "insert_grad_scaling" for p in points)
    assert {p.meta[PROVENANCE_KEY]["layer"] for p in points} == {"fc1", "fc2", "fc3"}
    by_pass: dict[tuple[str, str], int] = {}
    for n in converted.graph_module.graph.nodes:
        if PROVENANCE_KEY in n.meta:
            key = (n.meta[PROVENANCE_KEY]["pass"], "cast" if n.target == "to" else "op")
            by_pass[key] = by_pass.get(key, 0) + 1
    # the precision pass's 8 casts and its 5 painted ops, of which the 3 GEMMs are emulated; the forward's
    # overflow checks: the input's cast and the float16 GEMMs (not the GELU: never larger than its input; not the
    # float32 output, which only widens fc3's float16 output: fc3's check is the output's)
    sites = {r.name: r.counts for r in converted.record.passes}["insert_overflow_checks"]
    assert sites == {"sites": 4, "float16": 3, "cast": 1, "float32": 0}
    assert by_pass == {("convert_precision", "cast"): 8, ("convert_precision", "op"): 5,
                       ("insert_grad_scaling", "op"): 9, ("insert_overflow_checks", "op"): 4}
    emulated = [n for n in converted.graph_module.graph.nodes if n.meta.get(PROVENANCE_KEY, {}).get("emulated")]
    assert [n.args[0] for n in emulated] == ["torch._C._nn.linear"] * 3
    assert str(converted.report).startswith("converted 5 of 5 nodes to float16")


@pytest.mark.parametrize("kernel", ["fused", "inductor"])
def test_every_point_carries_the_configured_point_kernel(kernel: str) -> None:
    """``ScalingConfig.point_kernel`` reaches each point's backward (it decides only on CUDA), and a
    step computes the same either way elsewhere."""
    model, inputs, targets = mlp_case()
    config = dataclasses.replace(EVERYWHERE, scaling=autoscale.ScalingConfig(point_kernel=kernel))  # type: ignore[arg-type]
    converted = convert(model, inputs, config=config)
    assert [p.args[-1] for p in _rescales(converted)] == [kernel == "fused"] * 9
    reference = convert(model, inputs, config=EVERYWHERE)
    grads = []
    for c in (converted, reference):
        scaler = autoscale.GradScaler(c)
        scaler.scale(loss_of(c, inputs, targets)).backward()
        grads.append([p.grad.clone() for p in c.parameters()])  # type: ignore[union-attr]
        c.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_every_point_and_check_carries_the_configured_form_through_a_save(tmp_path: Path) -> None:
    """``Config.form`` reaches each point's and check's work (as the ``form`` its node carries, left
    out for the default form), a step computes the same in either form, and a saved and loaded
    module keeps it."""
    model, inputs, targets = mlp_case()
    converted = convert(model, inputs, config=EVERYWHERE.replace(form="fewer_launches"))
    checks = converted.graph_module.graph.find_nodes(op="call_function", target=watch)
    assert checks and all(n.kwargs.get("form") == "fewer_launches" for n in [*_rescales(converted), *checks])
    reference = convert(model, inputs, config=EVERYWHERE)
    assert not any("form" in n.kwargs for n in _rescales(reference))
    save(converted, tmp_path / "mlp.autoscale")
    loaded = load(tmp_path / "mlp.autoscale")
    assert loaded.graph_module.code == converted.graph_module.code
    grads = []
    for c in (converted, reference, loaded):
        scaler = autoscale.GradScaler(c)
        scaler.scale(loss_of(c, inputs, targets)).backward()
        grads.append([p.grad.clone() for p in c.parameters()])  # type: ignore[union-attr]
        c.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[2], strict=True))


def test_gradscaler_on_the_converted_module_uses_its_state_skips_overflows_and_updates_scales() -> None:
    model, inputs, targets = mlp_case()
    converted = convert(model, inputs, config=EVERYWHERE)
    buffers = dict(model.named_buffers())
    scaler = autoscale.GradScaler(converted, EVERYWHERE)
    assert dict(model.named_buffers()).keys() == buffers.keys()  # no second state
    assert scaler.state_dict()["scales"].tolist() == buffers["_autoscale_scales"].tolist()  # the seeded scales
    opt = torch.optim.SGD(converted.parameters(), lr=0.05)
    losses = _train(converted, scaler, opt, inputs, targets, 8)
    assert scaler.skipped_steps == 0 and losses[-1] < losses[0]
    scales = {r.name: r.scale for r in scaler.layers()}
    assert set(scales) == {"fc1", "fc2", "fc3"}

    # fc2's scale 2**8 above what the headroom rule chose: its float16 gradients overflow
    state = scaler.state_dict()
    state["scales"][list(state["layers"]).index("fc2")] *= 2.0**8
    scaler.load_state_dict(state)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train(converted, scaler, opt, inputs, targets, 1)
    assert scaler.skipped_steps == 1
    _assert_equal(weights, dict(model.named_parameters()))  # skipped: the optimizer did not run
    after = {r.name: r.scale for r in scaler.layers()}
    assert after["fc2"] == scales["fc2"] * 2.0**7  # backed off, and only there
    assert {k: v for k, v in after.items() if k != "fc2"} == {k: v for k, v in scales.items() if k != "fc2"}
    for _ in range(4):  # recovers within a few backoffs
        skipped = scaler.skipped_steps
        _train(converted, scaler, opt, inputs, targets, 1)
        if scaler.skipped_steps == skipped:
            break
    assert scaler.skipped_steps == skipped and not torch.equal(weights["fc1.weight"], model.get_parameter("fc1.weight"))


def test_gradscaler_created_before_convert_is_the_one_the_graph_serves() -> None:
    model, inputs, targets = mlp_case()
    scaler = autoscale.GradScaler(model, EVERYWHERE)
    converted = convert(model, inputs, config=EVERYWHERE)
    assert len(_rescales(converted)) == 9
    _train(converted, scaler, torch.optim.SGD(converted.parameters(), lr=0.05), inputs, targets, 2)
    assert {r.name for r in scaler.layers()} == {"fc1", "fc2", "fc3"}


def test_convert_does_not_run_the_model_or_leave_dynamo_entries_behind() -> None:
    """Conversion hands Dynamo placeholder outputs (batch-norm statistics stay as they were), and
    a later torch.compile of the same model compiles its own graph."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), torch.randn(8, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convert(model, (x,), config=EVERYWHERE)
    _assert_equal(before, model.state_dict())
    backend = autoscale.backend(EVERYWHERE)
    torch.compile(model, backend=backend)(x).sum().backward()
    assert len(backend.records) == 1
    assert not torch.equal(before["1.running_mean"], model.state_dict()["1.running_mean"])  # this one ran


def test_output_structure_inputs_and_tied_weights(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor, scale: float) -> dict[str, Any]:
            h = self.b(torch.relu(self.a(x))) * scale
            return {"out": h, "pair": (h.sum(), x), "scale": scale}

    torch.manual_seed(0)
    model, x = Tied(), torch.randn(3, 4)
    converted = convert(model, (x, 2.0), config=EVERYWHERE)
    out = converted(x, 2.0)
    assert set(out) == {"out", "pair", "scale"} and out["scale"] == 2.0 and out["pair"][1] is x
    torch.testing.assert_close(out["out"], model(x, 2.0)["out"], atol=1e-2, rtol=1e-2)
    assert len(list(converted.parameters())) == 3  # the tied weight once
    save(converted, tmp_path / "tied")
    loaded = load(tmp_path / "tied")
    assert loaded.module.get_parameter("b.weight") is loaded.module.get_parameter("a.weight")
    again = loaded(x, 2.0)
    assert torch.equal(again["out"], out["out"]) and again["pair"][1] is x and again["scale"] == 2.0


# ------------------------------------------------------------------------------------ refusals


def test_a_graph_break_is_refused_with_what_to_do() -> None:
    class Chatty(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y: torch.Tensor = self.fc(x)
            return y if y.sum().item() > 0 else -y  # data-dependent Python control flow

    with pytest.raises(ConvertError, match=r"(?s)whole forward as one graph.*Remove the graph break.*"
                                           r"backend=autoscale.backend"):
        convert(Chatty(), (torch.randn(2, 4),))


def test_inputs_other_than_the_captured_ones_are_refused() -> None:
    model, (x,), _ = mlp_case()
    converted = convert(model, (x,), config=EVERYWHERE)
    with pytest.raises(ValueError, match=r"has shape \(4, 16\).*converted for shape \(8, 16\).*static"):
        converted(x[:4])
    with pytest.raises(ValueError, match="float64 on cpu; it was converted for shape"):
        converted(x.double())
    with pytest.raises(ValueError, match="takes 1 positional argument"):
        converted(x, x)
    converted.eval()
    with pytest.raises(RuntimeError, match="converted in training mode"):
        converted(x)
    with pytest.raises(ValueError, match="tuple of the forward's positional arguments"):
        convert(model, x)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------- save/load


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model, inputs, _ = mlp_case()
    path = tmp_path / "mlp.autoscale"
    save(convert(model, inputs, config=EVERYWHERE), path)
    return path


def _rewrite(path: Path, edit: Any) -> Path:
    path.write_bytes(edit(path.read_bytes()))
    return path


def test_a_loaded_module_has_the_same_graph_provenance_and_state(saved: Path) -> None:
    model, inputs, targets = mlp_case()
    converted = convert(model, inputs, config=EVERYWHERE)
    loaded = load(saved)
    assert loaded.graph_module.code == converted.graph_module.code
    assert [n.meta.get(PROVENANCE_KEY) for n in loaded.graph_module.graph.nodes] == \
        [n.meta.get(PROVENANCE_KEY) for n in converted.graph_module.graph.nodes]
    assert len(_rescales(loaded)) == 9
    _assert_equal(converted.state_dict(), loaded.state_dict())
    assert str(loaded.report) == str(converted.report) and loaded.config == converted.config
    assert "saved from tests.models.MLP" in repr(loaded)
    assert torch.equal(loss_of(loaded, inputs, targets), loss_of(converted, inputs, targets))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_save_load_continues_training_bit_for_bit(tmp_path: Path, optimizer: str) -> None:
    """Train k steps, save (the scaler's and optimizer's state as ``extra``), load in this process,
    continue: losses, weights, scales and statistics equal the uninterrupted run's."""
    model, inputs, targets = transformer_case() if optimizer == "adam" else conv_case()
    converted = convert(model, inputs, config=EVERYWHERE)
    scaler = autoscale.GradScaler(converted, EVERYWHERE)

    def make_opt(params: Any) -> torch.optim.Optimizer:
        return (torch.optim.Adam(params, lr=1e-3) if optimizer == "adam"
                else torch.optim.SGD(params, lr=0.05, momentum=0.9))

    opt = make_opt(converted.parameters())
    _train(converted, scaler, opt, inputs, targets, 3)
    save(converted, tmp_path / "ckpt", extra={"scaler": scaler.state_dict(), "optimizer": opt.state_dict()})
    uninterrupted = _train(converted, scaler, opt, inputs, targets, 3)

    loaded = load(tmp_path / "ckpt")
    loaded_scaler = autoscale.GradScaler(loaded, loaded.config)
    loaded_scaler.load_state_dict(loaded.extra["scaler"])
    loaded_opt = make_opt(loaded.parameters())
    loaded_opt.load_state_dict(loaded.extra["optimizer"])
    resumed = _train(loaded, loaded_scaler, loaded_opt, inputs, targets, 3)

    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed, strict=True)), (uninterrupted, resumed)
    _assert_equal(_snapshot(converted, scaler), _snapshot(loaded, loaded_scaler))


_CONTINUE = """
import sys, torch, autoscale
from autoscale.convert import load
loaded = load(sys.argv[1])
x, y = torch.load(sys.argv[2])
scaler = autoscale.GradScaler(loaded, loaded.config)
scaler.load_state_dict(loaded.extra["scaler"])
opt = torch.optim.Adam(loaded.parameters(), lr=1e-3)
opt.load_state_dict(loaded.extra["optimizer"])
losses = []
for _ in range(3):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(loaded(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    losses.append(loss.detach())
sd = scaler.state_dict()
torch.save({"losses": losses, "model": loaded.state_dict(),
            **{f"scaler.{k}": sd[k] for k in ("scales", "stats", "last_stats", "overflows", "skips")}}, sys.argv[3])
assert "tests" not in sys.modules  # the model's class was not needed
"""


def test_a_fresh_process_continues_training_bit_for_bit(tmp_path: Path) -> None:
    model, (x,), y = mlp_case()
    converted = convert(model, (x,), config=EVERYWHERE)
    scaler = autoscale.GradScaler(converted, EVERYWHERE)
    opt = torch.optim.Adam(converted.parameters(), lr=1e-3)
    _train(converted, scaler, opt, (x,), y, 3)
    save(converted, tmp_path / "ckpt", extra={"scaler": scaler.state_dict(), "optimizer": opt.state_dict()})
    torch.save((x, y), tmp_path / "data.pt")
    uninterrupted = _train(converted, scaler, opt, (x,), y, 3)

    subprocess.run([sys.executable, "-c", _CONTINUE, str(tmp_path / "ckpt"), str(tmp_path / "data.pt"),
                    str(tmp_path / "out.pt")], check=True, cwd=tmp_path, timeout=120)
    result = torch.load(tmp_path / "out.pt")
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, result.pop("losses"), strict=True))
    expected = _snapshot(converted, scaler)
    _assert_equal(expected, {**result.pop("model"), **result})


def test_a_truncated_file_is_refused(saved: Path) -> None:
    data = saved.read_bytes()
    for cut in (len(MAGIC) - 3, len(MAGIC) + 2, len(MAGIC) + 20, len(data) - 100):
        saved.write_bytes(data[:cut])
        with pytest.raises(TruncatedFileError, match="truncated.*copy the file again, or re-run autoscale.convert"):
            load(saved)


def test_a_corrupted_file_is_refused(saved: Path) -> None:
    data = bytearray(saved.read_bytes())
    data[len(data) // 2] ^= 0x01
    saved.write_bytes(bytes(data))
    with pytest.raises(CorruptedFileError, match="corrupted: the payload's SHA-256 is .* the header records"):
        load(saved)
    _rewrite(saved, lambda raw: raw + b"more")
    with pytest.raises(CorruptedFileError, match="4 unexpected bytes follow the payload"):
        load(saved)


def test_a_file_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "weights.pt")
    with pytest.raises(NotConvertedFileError, match="not an autoscale converted-module file.*read it with torch.load"):
        load(tmp_path / "weights.pt")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(NotConvertedFileError, match="not an autoscale converted-module file"):
        load(tmp_path / "notes.txt")


def test_another_format_version_is_refused(saved: Path) -> None:
    def with_version(version: int) -> Any:
        return lambda raw: raw[:len(MAGIC)] + struct.pack("<I", version) + raw[len(MAGIC) + 4:]

    _rewrite(saved, with_version(FORMAT_VERSION + 1))
    with pytest.raises(FormatVersionError, match=f"saved by format version {FORMAT_VERSION + 1}, this autoscale "
                                                 f"reads versions 1, 2, 3: upgrade autoscale"):
        load(saved)
    _rewrite(saved, with_version(1))  # (version 1's payload is version 2's; its graphs measure every point)
    assert isinstance(load(saved), ConvertedModule)
    _rewrite(saved, with_version(0))
    with pytest.raises(FormatVersionError, match="version 0.*convert the model again"):
        load(saved)


def test_file_errors_are_value_errors() -> None:
    for error in (NotConvertedFileError, TruncatedFileError, CorruptedFileError, FormatVersionError):
        assert issubclass(error, ConvertedFileError) and issubclass(error, ValueError)


def test_save_writes_the_documented_header(saved: Path) -> None:
    import hashlib

    raw = saved.read_bytes()
    version, length, digest = struct.unpack_from("<IQ32s", raw, len(MAGIC))
    assert raw.startswith(MAGIC) and version == FORMAT_VERSION
    payload = raw[len(MAGIC) + 44:]
    assert len(payload) == length and hashlib.sha256(payload).digest() == digest
    assert not list(saved.parent.glob("*.tmp"))  # written in place by a rename
