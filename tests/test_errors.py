"""A failure the user can cause ends in one line naming the cause and the fix, never a traceback.

Config errors: an unknown key gets a "did you mean"; an error an override caused names the
``--set`` override, not the file; nested sections do not repeat their prefix; mistyped
``environment.options`` fail at load. ``--dry-run`` refuses what the run would refuse (the
environment, trainer ranks and devices, a missing model path, object-store outputs), so every
shipped config either builds its orchestrator up to contacting its endpoints or is refused by
``--dry-run`` with its reason. At run time: an SGLang endpoint with no server, and any
:class:`hetrl.errors.UserError` raised in the set-up, are one line and exit status 1.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from hetrl.cli import main
from hetrl.config import CONFIG_DIR, ConfigError, load_config
from hetrl.errors import UserError
from tiny_run import NO_EVAL, QUIET, TINY_MODEL, set_args

REPO = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.name for p in CONFIG_DIR.glob("*.yaml") if not p.name.startswith("experiment_"))  # run configs
REFUSED = {  # the real-cluster examples on this machine: what --dry-run must say (tests/test_examples.py runs them at tiny scale)
    "qwen3_b200_megatron.yaml": ["model.path: /shared/models/Qwen3-8B does not exist"],
    "qwen3_tpu_jax.yaml": ["trainer.mesh: data 1 x fsdp -1 x tensor 4 needs a multiple of 4 devices and the trainer has",
                           "model.path: /mnt/models/Qwen3-8B does not exist"],
}


def _one_line_error(capsys, argv: list[str]) -> str:
    """Run ``hetrl`` with ``argv``: exit status 1 and a single ``hetrl ...:`` line on stderr."""
    assert main(argv) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetrl "), captured.err
    return lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- config errors
def test_an_unknown_key_from_an_override_names_the_override_with_a_did_you_mean():
    with pytest.raises(ConfigError) as err:
        load_config("tiny_mixed.yaml", ["trainer.optimzer.learning_rate=1e-4"])
    assert str(err.value) == ("--set trainer.optimzer.learning_rate=1e-4: unknown key 'optimzer' "
                              "(did you mean 'optimizer'?)")


def test_an_unknown_key_in_the_file_names_the_file_and_the_key_with_a_did_you_mean(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {tiny: qwen3}\nfleet: {pools: [{name: a, accelerator: h100}]}\n"
                    "environment: {options: {eval: {evry: 2}}}\nlogging: {evrey: 2}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}: invalid config:\n"
                              "  environment.options.eval.evry: unknown key 'evry' (did you mean 'every'?)\n"
                              "  logging.evrey: unknown key 'evrey' (did you mean 'every'?)")


def test_a_key_nothing_is_close_to_lists_the_known_keys():
    with pytest.raises(ConfigError, match=r"unknown key 'zzz' \(known keys: .*eval.*suite"):
        load_config("tiny_mixed.yaml", ["environment.options.zzz=1"])


@pytest.mark.parametrize("override, message", [
    ("environment.options.coding.max_turn=2", "unknown key 'max_turn' (did you mean 'max_turns'?)"),
    ("environment.options.eval.samples=0", "Input should be greater than or equal to 1"),
    ("environment.options.eval={greedy: true, samples: 4}", "samples > 1 needs greedy: false (greedy episodes are all the same)"),
    ("environment.name=gym", "name must be 'synthetic' or 'coding'"),
])
def test_environment_options_are_checked_when_the_config_loads(capsys, override, message):
    """``--dry-run`` refuses them (they used to pass it and fail at start-up in pydantic's words)."""
    line = _one_line_error(capsys, ["train", "tiny_homogeneous.yaml", "--dry-run", "--set", override])
    assert line == f"hetrl train: --set {override}: {message}"


def test_an_override_inside_a_replaced_section_names_the_override_and_the_key():
    with pytest.raises(ConfigError) as err:
        load_config("tiny_mixed.yaml", ["environment={options: {eval: {evry: 2}}}"])
    assert str(err.value) == ("--set environment={options: {eval: {evry: 2}}}: environment.options.eval.evry: "
                              "unknown key 'evry' (did you mean 'every'?)")


@pytest.mark.parametrize("override, message", [
    ("correction.token_bounds=[2, 1]", "token_bounds must satisfy 0 <= L <= U, got (2.0, 1.0)"),
    ("correction.veto_threshold=-1", "veto_threshold: Input should be greater than 0"),
    ("trainer.mesh.tensor=0", "mesh axis sizes must be positive or -1"),
])
def test_nested_errors_do_not_repeat_their_prefix(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_mixed.yaml", [override])
    text = str(err.value)
    assert text.startswith(f"--set {override}: {message}")
    assert "Value error" not in text and "hetrl:" not in text and text.count("correction") <= 1


def test_the_file_is_blamed_only_for_its_own_errors(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: {tiny: qwen3}\nfleet: {pools: [{name: a, accelerator: h100}]}\nasync: {max_staleness: -1}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["steps=3"])  # a good override: the error is the file's
    assert str(err.value) == f"{path}: invalid config:\n  async.max_staleness: Input should be greater than or equal to 0"


# ---------------------------------------------------------------------- --dry-run refuses what the run would
def test_a_missing_model_path_is_refused_by_dry_run_and_by_the_run(capsys, tmp_path):
    for extra in (["--dry-run"], ["--set", f"output_dir={tmp_path}"]):
        line = _one_line_error(capsys, ["train", "tiny_homogeneous.yaml", "--set", "model={path: /no/such/model}", *extra])
        assert "model.path: /no/such/model does not exist; point model.path at an HF checkpoint directory" in line
    (tmp_path / "empty").mkdir()
    line = _one_line_error(capsys, ["train", "tiny_homogeneous.yaml", "--dry-run", "--set", f"model={{path: {tmp_path}/empty}}"])
    assert "has no config.json or tokenizer.json" in line


def test_a_trainer_mesh_that_does_not_fill_world_size_is_refused_by_dry_run(capsys):
    base = ["train", "tiny_homogeneous.yaml", "--trainer", "megatron", "--dry-run"]
    line = _one_line_error(capsys, [*base, "--set", "trainer.mesh={data: 1, fsdp: 1, tensor: 2}"])
    assert "trainer.mesh: data 1 x fsdp 1 x tensor 2 needs 2 trainer ranks and trainer.world_size is 1" in line
    assert main([*base, "--set", "trainer.mesh={data: 1, fsdp: 1, tensor: 2}", "--set", "trainer.world_size=2"]) == 0
    line = _one_line_error(capsys, [*base, "--set", "trainer.world_size=2", "--set", "async.batch_groups=3",
                                    "--set", "async.group_size=3", "--set", "trainer.mesh={data: 2, fsdp: 1, tensor: 1}"])
    assert "9 rollouts (batch_groups x group_size) do not split evenly over 2 data-parallel trainer ranks" in line
    assert main([*base, "--set", "trainer.world_size=2", "--set", "backend=ray"]) == 0  # ranks in a placement group
    assert main(base) == 0
    jax_base = ["train", "tiny_homogeneous.yaml", "--dry-run", "--set", "trainer.world_size=2"]
    assert main(jax_base) == 0  # two JAX processes
    line = _one_line_error(capsys, [*jax_base, "--set", "trainer.mesh={data: 1, fsdp: 1, tensor: 3}"])
    assert "needs 3 devices and the trainer has 2 (2 process(es) x 1 cpu devices)" in line
    line = _one_line_error(capsys, [*jax_base, "--set", "trainer.distributed={auto: true}"])
    assert "trainer.distributed: the loop starts the JAX trainer's processes itself" in line
    line = _one_line_error(capsys, [*base[:-1], "--dry-run", "--set", "output_dir=gs://bucket/run"])
    assert "output_dir: 'gs://bucket/run' is a URL" in line  # refused by name, never a local folder named gs:


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_real_cluster_examples_are_refused_by_dry_run_naming_why(capsys, name):
    assert main(["train", name, "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"hetrl train: {CONFIG_DIR / name}: cannot run:" + ("\n" if len(REFUSED[name]) > 1 else " "))
    for reason in REFUSED[name]:
        assert reason in err


def test_every_shipped_config_is_covered():
    assert set(REFUSED) <= set(SHIPPED) and {"tiny_mixed.yaml", "tiny_homogeneous.yaml", "tiny_mixed_sglang.yaml"} <= set(SHIPPED)


@pytest.mark.parametrize("name", [n for n in SHIPPED if n not in REFUSED])
def test_every_other_shipped_config_builds_its_orchestrator_up_to_its_endpoints(tmp_path, capsys, name):
    """``--dry-run`` passes; then the set-up runs through (model, trainer, fleet, evaluation
    sampler), or, with server pools, up to contacting the servers (a port where none listens):
    the error there is the one-line :class:`ServerUnreachable`."""
    from hetrl.orchestrator import build_orchestrator
    from hetrl.samplers.sglang import ServerUnreachable

    assert main(["train", name, "--dry-run"]) == 0, capsys.readouterr().err
    raw = load_config(name)
    dead = f"http://127.0.0.1:{_free_port()}"
    servers = [i for i, p in enumerate(raw.fleet.pools) if p.engine != "embedded"]
    overrides = [f"output_dir={tmp_path}", QUIET,
                 *([f"model.cache_dir={REPO / raw.model.cache_dir}"] if raw.model.cache_dir else []),
                 *(f"fleet.pools[{i}].endpoints=[{dead}]" for i in servers)]
    orchestrator = build_orchestrator(load_config(name, overrides))
    orchestrator._start_backend()
    try:
        if servers:
            with pytest.raises(ServerUnreachable, match=rf"no sglang server answers at {dead}; start the server "
                                                        rf"there, or fix fleet\.pools\[.*\]\.endpoints"):
                orchestrator._setup()
        else:
            orchestrator._setup()
            assert len(orchestrator.fleet.replicas) == sum(p.replicas for p in raw.fleet.pools)
            orchestrator.fleet.close()
            orchestrator.trainer.close()
    finally:
        orchestrator._stop_backend()


def test_the_experiment_grid_passes_the_same_checks():
    """``configs/experiment_*.yaml`` (no --dry-run of its own): every arm's config loads and is
    runnable (:func:`hetrl.experiment.plan.build_plan` checks both)."""
    from hetrl.experiment.config import load_experiment
    from hetrl.experiment.plan import build_plan

    for path in CONFIG_DIR.glob("experiment_*.yaml"):
        assert build_plan(*load_experiment(path)).runs


# ---------------------------------------------------------------------- errors at run time
def test_an_sglang_endpoint_with_no_server_is_one_line_naming_it(tmp_path):
    dead = f"http://127.0.0.1:{_free_port()}"
    run = subprocess.run(
        [sys.executable, "-m", "hetrl.cli", "train", "tiny_homogeneous.yaml",
         *set_args([TINY_MODEL, f"output_dir={tmp_path}", QUIET, NO_EVAL]),
         "--set", f"fleet.pools=[{{name: h100-sglang, engine: sglang, accelerator: h100, weight_precision: bf16, "
                  f"endpoints: [{json.dumps(dead)}]}}]"],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stderr[-4000:]
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"hetrl train: pool 'h100-sglang': no sglang server answers at {dead}; start the server there, or fix "
        f"fleet.pools[h100-sglang].endpoints")


def test_a_user_error_in_any_phase_of_the_run_is_one_line(capsys, monkeypatch, tmp_path):
    """E.g. a resume the checkpoint does not fit (another trainer, another fleet): whatever raises
    a :class:`UserError` in the set-up or the loop is printed as one line, exit status 1."""
    import hetrl.orchestrator

    class Refusing:
        def request_stop(self) -> None: ...

        def run(self):
            raise UserError("checkpointing.resume: the checkpoint was written by the megatron trainer; resume with "
                            "--trainer megatron")

    monkeypatch.setattr(hetrl.orchestrator, "build_orchestrator", lambda config: Refusing())
    line = _one_line_error(capsys, ["train", "tiny_homogeneous.yaml", "--set", f"output_dir={tmp_path}"])
    assert line == ("hetrl train: checkpointing.resume: the checkpoint was written by the megatron trainer; resume "
                    "with --trainer megatron")


def test_a_reader_that_leaves_the_pipe_early_gets_no_traceback():
    """`hetrl experiment --dry-run | head`: the command's output outlives its reader (here a pipe
    whose read end is closed before anything is written); it ends quietly with 141 (128 +
    SIGPIPE), like a piped Unix tool, not with a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "hetrl.cli", "experiment", "experiment_default.yaml", "--dry-run"],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and proc.returncode == 141, proc.stderr[-2000:]
