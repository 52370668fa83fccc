"""The ``autoscale`` command line: inspect what the passes do to a model, convert it, read telemetry.

    autoscale diff MODULE:FACTORY [--format text|json|html] [-o FILE] [--backward-only] [--summary] [--measure]
                                  [--telemetry LOG]
    autoscale convert MODULE:FACTORY -o FILE
    autoscale report LOG [-o DIR]

``MODULE:FACTORY`` names a function that takes no arguments and returns ``(model,
example_inputs)``; MODULE is a path to a ``.py`` file (it contains ``/`` or ends with ``.py``) or
a dotted module name importable from the current directory. The commands are thin: the work is
in ``autoscale.diff``, ``autoscale.convert`` and ``autoscale.report``, imported only by the command
that needs them, so that ``autoscale --help`` costs no more than ``import autoscale`` (matplotlib, in
particular, loads only when ``report`` draws).

Exit codes: 0 success, 1 a failure (one line on stderr saying what and what to do; ``--debug``
shows the traceback instead), 2 a usage error (a bad option or a malformed MODULE:FACTORY).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["CLIError", "FactorySpec", "load_factory", "main", "parse_factory_spec"]

log = logging.getLogger("autoscale")

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_FACTORY_HELP = "the model's factory, e.g. models.py:make or mypkg.models:make (see above)"
_FACTORY_CONTRACT = "FACTORY must take no arguments and return (model, example_inputs)"
_SPEC_EXAMPLE = "expected MODULE:FACTORY, e.g. models.py:make or mypkg.models:make"


class CLIError(Exception):
    """An expected failure: ``main`` prints its message as one line on stderr and exits with 1."""


@dataclass(frozen=True)
class FactorySpec:
    """A parsed ``MODULE:FACTORY``. ``factory`` may be dotted (``Models.tiny``): attributes are
    looked up one after another."""

    module: str
    factory: str

    @property
    def is_path(self) -> bool:
        """A file path rather than a module name: it has a path separator or ends with ``.py``."""
        return "/" in self.module or os.sep in self.module or self.module.endswith(".py")

    def __str__(self) -> str:
        return f"{self.module}:{self.factory}"


def parse_factory_spec(text: str) -> FactorySpec:
    """``MODULE:FACTORY`` -> :class:`FactorySpec`; an ``argparse.ArgumentTypeError`` (a usage error,
    exit 2) when malformed. Splits at the last colon, so a Windows drive letter survives."""
    module, sep, factory = text.rpartition(":")
    if not sep or not module or not factory:
        raise argparse.ArgumentTypeError(f"{text!r}: {_SPEC_EXAMPLE}")
    if not _IDENTIFIER.fullmatch(factory):
        raise argparse.ArgumentTypeError(f"{text!r}: FACTORY {factory!r} is not a Python name; {_SPEC_EXAMPLE}")
    spec = FactorySpec(module, factory)
    if not spec.is_path and not _IDENTIFIER.fullmatch(module):
        raise argparse.ArgumentTypeError(f"{text!r}: MODULE {module!r} is neither a dotted module name nor a path "
                                         f"to a .py file; {_SPEC_EXAMPLE}")
    return spec


# ---------------------------------------------------------------------------- factories


@contextmanager
def _import_path(spec: FactorySpec) -> Iterator[None]:
    """Make MODULE importable the way ``python`` would: a file's own directory (so it can import
    its neighbours), or the current directory for a module name (``python -m`` has it, the
    ``autoscale`` console script does not). Undone afterwards, for callers of ``main()``."""
    entry = str(Path(spec.module).resolve().parent) if spec.is_path else os.getcwd()
    saved = list(sys.path)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        sys.path[:] = saved


def _import_module(spec: FactorySpec) -> ModuleType:
    if spec.is_path:
        path = Path(spec.module)
        if not path.exists():
            raise CLIError(f"no such file: {path} (MODULE in MODULE:FACTORY is a path to a .py file "
                           "or a dotted module name)")
        if not path.is_file():
            raise CLIError(f"{path} is not a file; MODULE in MODULE:FACTORY is a path to a .py file")
        # Named after the file, so classes defined there pickle as `stem.Class` (importable again from
        # the file's directory), unless that would shadow a module already loaded.
        name = path.stem if path.stem.isidentifier() and path.stem not in sys.modules else f"_autoscale_{id(spec)}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise CLIError(f"cannot load {path} as Python source; give a .py file")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module  # dataclasses and pickle look classes up here
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise CLIError(f"importing {path} failed: {_one_line(e)}; fix the module (--debug shows where)") from e
        return module
    try:
        return importlib.import_module(spec.module)
    except ModuleNotFoundError as e:
        if e.name is not None and (spec.module == e.name or spec.module.startswith(e.name + ".")):
            raise CLIError(f"cannot import module {spec.module!r}: {e}; check the name and run from the directory "
                           "that contains it, or give the path to its .py file") from e
        raise CLIError(f"importing module {spec.module!r} failed: {_one_line(e)}; install what it needs") from e
    except Exception as e:
        raise CLIError(f"importing module {spec.module!r} failed: {_one_line(e)}; fix the module "
                       "(--debug shows where)") from e


def load_factory(spec: FactorySpec) -> tuple[nn.Module, tuple[Any, ...]]:
    """Import MODULE, call FACTORY and check what it returned; :class:`CLIError` naming the
    problem otherwise. A single tensor as ``example_inputs`` is wrapped in a tuple. Call it with
    MODULE on the import path (``main`` does)."""
    import torch
    from torch import nn

    module = _import_module(spec)
    where = f"module {spec.module!r}" if not spec.is_path else spec.module
    obj: Any = module
    for part in spec.factory.split("."):
        if not hasattr(obj, part):
            defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                             and getattr(v, "__module__", None) == module.__name__)
            hint = f"; it defines {', '.join(defined[:12])}" if defined else "; it defines no functions"
            raise CLIError(f"{where} has no factory {spec.factory!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CLIError(f"{spec} is not callable (it is of type {type(obj).__name__}); {_FACTORY_CONTRACT}")
    try:
        inspect.signature(obj).bind()
    except TypeError:
        names = ", ".join(inspect.signature(obj).parameters)
        raise CLIError(f"{spec} needs arguments ({names}); {_FACTORY_CONTRACT}") from None
    except ValueError:  # no signature to inspect (a builtin): let the call decide
        pass
    try:
        result = obj()
    except Exception as e:
        raise CLIError(f"factory {spec} raised {_one_line(e)}; fix the factory (--debug shows where)") from e
    if not isinstance(result, tuple | list) or len(result) != 2:
        got = f"a {len(result)}-item {type(result).__name__}" if isinstance(result, tuple | list) else \
            f"a {type(result).__name__}"
        raise CLIError(f"factory {spec} returned {got}, not a (model, example_inputs) pair; {_FACTORY_CONTRACT}")
    model, inputs = result
    if not isinstance(model, nn.Module):
        raise CLIError(f"factory {spec} returned a {type(model).__name__} as the model, not a torch.nn.Module; "
                       f"{_FACTORY_CONTRACT}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, tuple | list):
        raise CLIError(f"factory {spec} returned a {type(inputs).__name__} as example_inputs, not a tuple of "
                       f"the model's positional inputs or one tensor; {_FACTORY_CONTRACT}")
    return model, tuple(inputs)


def _one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``: compiler errors run to pages and the first line says
    what happened. When ``e`` wraps another exception (Dynamo's errors wrap the model's own), the
    innermost one is named too: it is usually the actual cause."""
    text = _first_line(e)
    root, seen = e, {id(e)}
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        root = nxt
        seen.add(id(nxt))
    if root is not e and _first_line(root) != text:
        text += f" (from {_first_line(root)})"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _first_line(e: BaseException) -> str:
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


@contextmanager
def _quiet_torch(quiet: bool) -> Iterator[None]:
    """Silence torch's own loggers while the pipeline runs: when a model fails to trace, Dynamo and
    FakeTensor log the traceback at ERROR before raising, and the CLI reports the error in one
    line instead (``--debug`` keeps them)."""
    logger = logging.getLogger("torch")
    level = logger.level
    if quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _run_pipeline(verb: str, spec: FactorySpec, call: Callable[[nn.Module, tuple[Any, ...]], Any], *,
                  debug: bool) -> Any:
    """Load the factory and run ``call`` on it; a failure of autoscale's pipeline (usually the model
    not tracing) becomes one line naming the model and the exception."""
    with _import_path(spec):
        model, inputs = load_factory(spec)
        try:
            with _quiet_torch(not debug):
                return call(model, inputs)
        except Exception as e:
            raise CLIError(f"could not {verb} the model from {spec}: {_one_line(e)}; check that "
                           "model(*example_inputs) runs without torch.compile (--debug shows the traceback)") from e


# ----------------------------------------------------------------------------- commands


def _write(text: str, output: Path | None) -> None:
    """``text`` to ``output`` (created with its directory), or to stdout."""
    if output is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    except OSError as e:
        raise CLIError(f"cannot write {output}: {e.strerror or e}; choose another -o path") from e


def _size(path: Path) -> str:
    n = path.stat().st_size
    return f"{n} bytes" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.1f} MiB"


def _cmd_diff(args: argparse.Namespace) -> int:
    from autoscale.diff import diff

    if args.telemetry is not None:  # (refused before the model is captured, and named as the log's problem)
        from autoscale.report import TelemetryError, load_telemetry

        if not args.telemetry.is_file():
            raise CLIError(f"--telemetry {args.telemetry}: no such file; give the log that "
                           "GradScaler(model, telemetry=LOG) wrote")
        try:
            load_telemetry(args.telemetry)
        except TelemetryError as e:
            raise CLIError(f"--telemetry: {e}") from e
    result = _run_pipeline("diff", args.target,
                           lambda model, inputs: diff(model, inputs, measure=args.measure, telemetry=args.telemetry),
                           debug=args.debug)
    if args.format == "json":
        text = json.dumps(result.to_json(backward_only=args.backward_only), indent=2)
    elif args.format == "html":
        text = result.to_html(backward_only=args.backward_only)
    else:
        color = args.color == "always" or (
            args.color == "auto" and args.output is None and sys.stdout.isatty() and "NO_COLOR" not in os.environ)
        text = result.to_text(color=color, backward_only=args.backward_only, summary_only=args.summary)
    _write(text, args.output)
    if args.output is not None:
        print(f"wrote {args.output} ({_size(args.output)}): {result}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from autoscale.convert import convert, save

    converted = _run_pipeline("convert", args.target, lambda model, inputs: convert(model, inputs),
                              debug=args.debug)
    output: Path = args.output
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        save(converted, output)
    except OSError as e:
        raise CLIError(f"cannot write {output}: {e.strerror or e}; choose another -o path") from e
    except Exception as e:
        raise CLIError(f"could not save the converted model to {output}: {_one_line(e)}") from e
    report = str(getattr(converted, "report", "")).splitlines()
    print(f"wrote {output} ({_size(output)})" + (f": {report[0]}" if report else ""))
    print(f"load it with autoscale.load({str(output)!r}): it trains with plain autograd, no torch.compile")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from autoscale.report import TelemetryError, default_output_dir, format_summary, load_telemetry, render, summarize

    path: Path = args.log
    how = "write one with autoscale.GradScaler(model, telemetry=PATH)"
    if not path.exists():
        raise CLIError(f"no such telemetry log: {path}; {how}")
    if not path.is_file():
        raise CLIError(f"{path} is not a file; give the telemetry log (JSON lines), {how}")
    try:
        telemetry = load_telemetry(path)
    except TelemetryError as e:
        raise CLIError(str(e)) from e
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror or e}") from e
    print(format_summary(summarize(telemetry)))
    if args.no_plots:
        return 0
    out = args.output if args.output is not None else default_output_dir(path)
    try:
        written = render(telemetry, out)
    except ImportError as e:
        raise CLIError(f"the plots need matplotlib ({_one_line(e)}): pip install matplotlib, "
                       "or pass --no-plots for the tables only") from e
    except OSError as e:
        raise CLIError(f"cannot write the plots to {out}: {e.strerror or e}; choose another -o directory") from e
    print("\nplots:")
    for p in written:
        print(f"  {p}")
    return 0


# ------------------------------------------------------------------------------- parser


def _parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="autoscale", formatter_class=raw,
        description="Mixed-precision training as PyTorch compiler passes: inspect what autoscale does to a "
                    "model, convert it ahead of time, and read the gradient scaler's telemetry.",
        epilog="Run 'autoscale COMMAND --help' for a command's options and an example.\n"
               "Exit codes: 0 success, 1 failure (one line on stderr), 2 usage error.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure and log more")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    def command(name: str, summary: str, description: str, example: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=f"{summary}\n\n{description}",
                                  epilog=f"example:\n{example}", formatter_class=raw)
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show the traceback of a failure instead of one line")
        return sub

    factory_description = (
        "MODULE:FACTORY: MODULE is a path to a .py file (it contains '/' or ends with '.py') or a dotted\n"
        "module name importable from the current directory; FACTORY is a function in it that takes no\n"
        "arguments and returns (model, example_inputs): an nn.Module and a tuple of its positional\n"
        "inputs (a single tensor is accepted too).")

    sub = command(
        "diff", "Show what autoscale's passes change in a model's forward and backward graphs.",
        "First a per-layer map: each layer's float16/float32 decision and why, its gradient scale point\n"
        "and seeded scale, and the predicted (with --measure, also measured) gradient underflow and\n"
        "forward maximum. Then every node before and after the pipeline: inserted casts, rescale\n"
        "points, overflow checks, with the pass that made each and why (docs/diff.md).\n\n"
        + factory_description,
        "  autoscale diff models.py:tiny_mlp                          # coloured on a terminal\n"
        "  autoscale diff models.py:tiny_mlp --summary --measure      # the per-layer map, measured too\n"
        "  autoscale diff models.py:tiny_mlp --backward-only\n"
        "  autoscale diff mypkg.models:make --format json -o diff.json\n"
        "  autoscale diff models.py:tiny_mlp --format html -o diff.html")
    sub.add_argument("target", metavar="MODULE:FACTORY", type=parse_factory_spec, help=_FACTORY_HELP)
    sub.add_argument("--format", choices=("text", "json", "html"), default="text",
                     help="text (a unified diff, the default), json (pretty-printed) or html (one self-contained page)")
    sub.add_argument("-o", "--output", type=Path, metavar="FILE", help="write to FILE instead of stdout")
    sub.add_argument("--backward-only", action="store_true", help="only the backward graph")
    sub.add_argument("--summary", action="store_true",
                     help="text: only the summary and the per-layer map, without the node diff")
    sub.add_argument("--measure", action="store_true",
                     help="also run one float32 step on the example inputs and show the measured per-layer "
                          "numbers beside the predicted ones")
    sub.add_argument("--telemetry", type=Path, metavar="LOG",
                     help="a GradScaler telemetry log of a run of this model: add its per-layer scales, "
                          "weight-gradient zero rates and overflows to the per-layer map")
    sub.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                     help="colour the text diff: auto (the default) colours only a terminal without -o and "
                          "NO_COLOR unset")
    sub.set_defaults(handler=_cmd_diff)

    sub = command(
        "convert", "Convert a model ahead of time and save it.",
        "Captures the model's forward as one graph (a graph break is an error), runs autoscale's passes\n"
        "on it once for the example inputs' shapes, and saves the converted module to FILE (format\n"
        "version and SHA-256 checked on load). autoscale.load(FILE) returns a module that trains with\n"
        "plain autograd, without torch.compile; see docs/convert.md.\n\n" + factory_description,
        "  autoscale convert models.py:tiny_mlp -o tiny_mlp.autoscale")
    sub.add_argument("target", metavar="MODULE:FACTORY", type=parse_factory_spec, help=_FACTORY_HELP)
    sub.add_argument("-o", "--output", type=Path, metavar="FILE", required=True, help="where to save it")
    sub.set_defaults(handler=_cmd_convert)

    sub = command(
        "report", "Summarise a GradScaler telemetry log: per-layer tables and plots.",
        "LOG is the JSON-lines file autoscale.GradScaler(model, telemetry=LOG) appends one line to per\n"
        "update(). Prints, per layer, the final, min and max scale, the mean and max weight-gradient\n"
        "zero (underflow) rate and the overflow count, and the skipped steps; writes scales.png,\n"
        "zero_rates.png and skipped.png (matplotlib) to DIR. A log holding several runs (the scaler\n"
        "appends) is reported for its last run.",
        "  autoscale report run.jsonl              # plots in run_report/\n"
        "  autoscale report run.jsonl -o plots/")
    sub.add_argument("log", metavar="LOG", type=Path, help="the telemetry log (JSON lines)")
    sub.add_argument("-o", "--output", type=Path, metavar="DIR",
                     help="directory for the PNG plots (default: LOG's name + '_report' next to it)")
    sub.add_argument("--no-plots", action="store_true", help="print the tables only (no matplotlib needed)")
    sub.set_defaults(handler=_cmd_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (argparse exits with 2 itself on usage errors)."""
    parser = _parser()
    args = parser.parse_args(argv)
    # The commands print their results; the library's INFO lines (what convert did, where it saved)
    # would repeat them on stderr, so only warnings show, unless --debug.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    if args.debug:
        log.setLevel(logging.DEBUG)
    if args.version:
        import autoscale

        print(autoscale.__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 0
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except CLIError as e:
        if args.debug:
            raise
        print(f"autoscale {args.command}: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `autoscale diff ... | head`: the reader left, which is not a failure to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130
