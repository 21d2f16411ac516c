"""``hetrl bench --list`` and ``hetrl bench NAME [ARGS...]``: run a benchmark of the repository's ``bench/``.

A benchmark is any ``bench/NAME.py`` whose name does not start with ``_`` (found by listing the
directory, so a new script is a new benchmark). Each one follows one convention:

* its module docstring's first paragraph is its description (``hetrl bench --list`` prints it,
  read from the source without importing the script);
* it exposes ``main(argv: list[str] | None = None)``, whose parser starts from
  :func:`script_parser` (``--quick``, ``--out``) and which prints its table and writes
  ``NAME.json`` and ``NAME.png`` to :func:`output_dir`;
* ``--quick`` is the smallest size that still runs every code path (seconds, at most a minute on
  a 2-core machine): tests/test_bench.py runs every script that way. Quick figures go to
  ``runs/bench-quick/`` unless ``--out`` is given, so they never overwrite ``bench/results/``,
  and so does anything else a quick run writes (run directories, caches).

``hetrl bench NAME ARGS...`` imports ``bench/NAME.py`` and calls ``main(ARGS)`` (``-`` and ``_``
are interchangeable in NAME; ``hetrl bench NAME --help`` shows the script's own options).
``bench/`` is not part of the installed package: it is found next to the source tree, as
:data:`hetrl.config.CONFIG_DIR` finds ``configs/``; without it (an installed wheel without the
repository) the command says so.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import pathlib
import sys

__all__ = ["BENCH_DIR", "add_arguments", "run", "discover", "description", "script_parser", "output_dir"]

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "bench"
"""The repository's ``bench/`` directory (absent from an installed wheel)."""


def discover(bench_dir: pathlib.Path | None = None) -> dict[str, pathlib.Path]:
    """``{name: path}`` of every benchmark script in ``bench_dir`` (default :data:`BENCH_DIR`), sorted."""
    bench_dir = BENCH_DIR if bench_dir is None else bench_dir
    return {p.stem: p for p in sorted(bench_dir.glob("*.py")) if not p.name.startswith("_")}


def description(path: pathlib.Path) -> str:
    """The first paragraph of the script's module docstring on one line ('' without a docstring)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return first_paragraph(doc)


def first_paragraph(doc: str) -> str:
    """The first paragraph of ``doc``, its lines joined by single spaces."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def script_parser(doc: str | None) -> argparse.ArgumentParser:
    """The parser a benchmark script starts from: described by its docstring's first paragraph,
    with ``--quick`` and ``--out`` (read back by :func:`output_dir`)."""
    parser = argparse.ArgumentParser(description=first_paragraph(doc or ""))
    parser.add_argument("--quick", action="store_true",
                        help="the smallest size that still runs every code path (seconds); "
                             "writes to runs/bench-quick/ unless --out is given")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="directory for the JSON and the plot (default bench/results, with --quick runs/bench-quick)")
    return parser


def output_dir(args: argparse.Namespace, script: str) -> pathlib.Path:
    """Where the script at path ``script`` writes: ``--out``, else ``bench/results`` next to it,
    else (``--quick``) ``runs/bench-quick`` in its repository; created."""
    bench_dir = pathlib.Path(script).resolve().parent
    out = args.out or (bench_dir.parent / "runs" / "bench-quick" if args.quick else bench_dir / "results")
    out.mkdir(parents=True, exist_ok=True)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--list", action="store_true", help="name every benchmark in bench/ with its description")
    parser.add_argument("name", nargs="?", help="the benchmark to run (a script bench/NAME.py; see --list)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="passed to the script, e.g. --quick (hetrl bench NAME --help shows them)")


def run(args: argparse.Namespace) -> int:
    if not BENCH_DIR.is_dir():
        print(f"hetrl bench: no bench/ directory at {BENCH_DIR}: the benchmarks live in the hetrl repository, "
              "not in the installed package; run hetrl from a checkout (pip install -e .)", file=sys.stderr)
        return 1
    scripts = discover()
    if args.list or not args.name:
        if not args.list:
            print("hetrl bench: name a benchmark (hetrl bench NAME [--quick]); the benchmarks are:", file=sys.stderr)
        width = max((len(n) for n in scripts), default=0)
        for name, path in scripts.items():
            print(f"{name:<{width}}  {description(path)}", file=sys.stdout if args.list else sys.stderr)
        return 0 if args.list else 2
    name = args.name.removesuffix(".py").replace("-", "_")
    if name not in scripts:
        print(f"hetrl bench: no benchmark {args.name!r} in {BENCH_DIR}; choose from {', '.join(scripts)}",
              file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location(f"hetrl_bench_{name}", scripts[name])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    main = getattr(module, "main", None)
    if not callable(main):
        print(f"hetrl bench: {scripts[name]} has no main(argv) function (see hetrl.bench_command)", file=sys.stderr)
        return 1
    result = main(list(args.script_args))
    return int(result or 0)
