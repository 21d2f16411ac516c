"""``hetrl bench``: discovery of bench/ scripts, ``--list``, dispatch and its errors (fast, on
stand-in scripts), and every real benchmark run at ``--quick`` through the command line (slow), so a
benchmark that no longer starts fails CI. The real scripts are found the way the command finds
them, so a new script is covered without touching this file."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from hetrl import bench_command
from hetrl.cli import main

SRC = pathlib.Path(bench_command.__file__).resolve().parents[1]
REPO = SRC.parent
BENCHMARKS = bench_command.discover()
RUN_ELSEWHERE = {"gpu_check": "tests/test_gpu_check.py runs it at --quick through bench/gpu_check.sh --cpu-smoke"}
"""Benchmarks whose --quick run another test already makes (and checks more closely), each with where."""

STAND_IN = '''"""Stand-in benchmark: records its arguments.

More text that --list leaves out."""
import json
import pathlib

from hetrl.bench_command import output_dir, script_parser


def main(argv=None):
    parser = script_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    out = output_dir(args, __file__)
    (out / "stand_in.json").write_text(json.dumps(dict(quick=args.quick, repeats=args.repeats)))
'''


@pytest.fixture
def bench_dir(tmp_path, monkeypatch) -> pathlib.Path:
    """A bench/ directory with one stand-in benchmark, a helper module and a non-Python file,
    made the command's :data:`~hetrl.bench_command.BENCH_DIR`."""
    directory = tmp_path / "bench"
    directory.mkdir()
    (directory / "stand_in.py").write_text(STAND_IN)
    (directory / "_helpers.py").write_text('"""Not a benchmark."""\n')
    (directory / "notes.txt").write_text("not a benchmark\n")
    monkeypatch.setattr(bench_command, "BENCH_DIR", directory)
    return directory


def test_discover_lists_the_scripts_but_not_private_modules_or_other_files(bench_dir):
    assert list(bench_command.discover()) == ["stand_in"]


def test_list_names_each_benchmark_with_its_one_line_description(bench_dir, capsys):
    assert main(["bench", "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == ["stand_in  Stand-in benchmark: records its arguments."]


def test_run_passes_the_arguments_to_main_and_writes_under_out(bench_dir, tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "stand-in", "--quick", "--repeats", "3", "--out", str(out)]) == 0
    assert json.loads((out / "stand_in.json").read_text()) == {"quick": True, "repeats": 3}


def test_quick_without_out_writes_under_runs_not_bench_results(bench_dir):
    assert main(["bench", "stand_in", "--quick"]) == 0
    assert (bench_dir.parent / "runs" / "bench-quick" / "stand_in.json").exists()
    assert not (bench_dir / "results").exists()


def test_unknown_benchmark_is_one_line_naming_the_choices(bench_dir, capsys):
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'nope'" in err and "stand_in" in err


def test_missing_bench_directory_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_command, "BENCH_DIR", tmp_path / "installed-wheel" / "bench")
    assert main(["bench", "--list"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no bench/ directory" in err and "checkout" in err


def test_the_repository_has_benchmarks_each_with_a_short_description():
    assert {"correction_overhead", "sampler_throughput", "trainer_step", "async_overlap", "soak"} <= set(BENCHMARKS)
    assert set(RUN_ELSEWHERE) <= set(BENCHMARKS), "RUN_ELSEWHERE names a benchmark that is gone"
    long = {name: d for name, d in ((n, bench_command.description(p)) for n, p in BENCHMARKS.items())
            if not d or len(d) > 130}
    assert long == {}, "each bench script's docstring must open with a one-line description (<= 130 characters)"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(BENCHMARKS) - set(RUN_ELSEWHERE)))
def test_benchmark_runs_at_quick(name, tmp_path):
    """``hetrl bench NAME --quick --out DIR`` exits 0 and writes NAME.json and NAME.png there (a
    fresh process each, from the repository root like a user; under a minute each on 2 quiet cores,
    several under load, hence the generous timeout)."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, "-m", "hetrl.cli", "bench", name, "--quick", "--out", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"hetrl bench {name} --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert (out / f"{name}.json").is_file() and (out / f"{name}.png").is_file(), sorted(p.name for p in out.iterdir())
