"""The run folder: every output of a run under its ``output_dir``, a new run refusing a folder
that holds one, resumes checked against the folder's ``config.yaml``, config paths resolved
against the config file, and the model built by the orchestrator, never by the config.

The checks of who may write where run on folders made by hand (fast); one module-scoped pair of
tiny runs (2 steps each, one replica, a held-out evaluation at steps 0 and 2), then a resume of
one of them to step 3, serve the checks of what a run writes.
"""

import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from hetrl.cli import main
from hetrl.config import CONFIG_DIR, ConfigError, load_config
from hetrl.orchestrator.run_folder import RunFolder, compare_configs
from tiny_run import TINY_RUN

REPO = CONFIG_DIR.parent
TINY = [*TINY_RUN, "async.max_staleness=1", "checkpointing.every=1",
        "environment.options.eval={every: 2, tasks: 2, greedy: true, samples: 1}"]
"""The tiny run (:data:`tiny_run.TINY_RUN`) of tiny_homogeneous.yaml, checkpointed every step, evaluated at step 2."""


def _tiny(out: pathlib.Path, *extra: str):
    return load_config("tiny_homogeneous.yaml", [f"output_dir={out}", *TINY, *extra])


def _fake_run(out: pathlib.Path, *extra: str, checkpoint: bool = True) -> None:
    """A folder as a run of ``_tiny(out, *extra)`` leaves it: its config.yaml and a checkpoint."""
    RunFolder(out).write_config(_tiny(out, *extra))
    if checkpoint:
        (out / "checkpoints" / "2").mkdir(parents=True)


def _train(capsys, out: pathlib.Path, *argv: str) -> tuple[int, str]:
    args = ["train", "tiny_homogeneous.yaml", "--set", f"output_dir={out}"]
    for o in TINY:
        args += ["--set", o]
    code = main([*args, *argv])
    return code, capsys.readouterr().err


# ====================================================================== who may write where
@pytest.mark.parametrize("leftover", ["config.yaml", "metrics.jsonl", "summary.json", "checkpoints/5"])
def test_a_new_run_in_a_folder_holding_one_is_refused_in_one_line(tmp_path, capsys, leftover):
    (tmp_path / leftover).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / leftover).mkdir() if leftover.startswith("checkpoints") else (tmp_path / leftover).write_text("{}")
    code, err = _train(capsys, tmp_path)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("hetrl train: ") and "already holds a run" in err
    assert "--resume" in err and "fresh output_dir" in err


def test_an_absent_empty_or_foreign_folder_holds_no_run(tmp_path):
    assert RunFolder(tmp_path / "absent").run_files() == []
    (tmp_path / "train.log").write_text("an experiment's log")  # written before the run starts
    (tmp_path / "checkpoints").mkdir()
    assert RunFolder(tmp_path).run_files() == []
    RunFolder(tmp_path).check_start(_tiny(tmp_path))  # no error


@pytest.mark.parametrize("held", [False, True])
def test_resume_with_nothing_to_resume_says_so(tmp_path, capsys, held):
    if held:
        _fake_run(tmp_path, checkpoint=False)  # killed before its first checkpoint
    code, err = _train(capsys, tmp_path, "--resume")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "nothing to resume" in err and str(tmp_path) in err


@pytest.mark.parametrize("argv, key", [
    (["--trainer", "megatron"], "trainer.kind"),
    (["--set", "fleet.pools=[{name: h100-fp8, accelerator: h100, weight_precision: fp8_e4m3}]"], "fleet.pools"),
    (["--set", "model={tiny: qwen2}"], "model.tiny"),
])
def test_resume_with_the_other_trainer_or_fleet_is_refused_by_name(tmp_path, capsys, argv, key):
    _fake_run(tmp_path)
    code, err = _train(capsys, tmp_path, "--resume", *argv)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert key in err.split("must keep: ")[1].split(";")[0].split(", ") and "fresh output_dir" in err


def test_resume_with_a_changed_learning_rate_warns_and_goes_on(tmp_path, caplog):
    _fake_run(tmp_path)
    config = _tiny(tmp_path, "checkpointing.resume=true", "trainer.optimizer.learning_rate=1.0e-3", "steps=9",
                   "logging.every=3")
    with caplog.at_level(logging.WARNING):
        RunFolder(tmp_path).check_start(config)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "trainer.optimizer.learning_rate 5e-05 -> 0.001" in warning and "steps 60 -> 9" in warning
    assert "logging" not in warning  # how a run is shown changes nothing it trains


def test_resume_with_another_model_cache_warns_and_goes_on(tmp_path, caplog):
    """The cache says where a built model is kept, not which model: a resume may move it."""
    _fake_run(tmp_path, f"model.cache_dir={tmp_path / 'cache-a'}")
    config = _tiny(tmp_path, "checkpointing.resume=true", f"model.cache_dir={tmp_path / 'cache-b'}")
    with caplog.at_level(logging.WARNING):
        RunFolder(tmp_path).check_start(config)  # not refused
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"model.cache_dir {str(tmp_path / 'cache-a')!r} -> {str(tmp_path / 'cache-b')!r}" in warning


def test_compare_configs_names_the_fixed_prefix_once():
    saved = {"seed": 0, "trainer": {"kind": "jax", "optimizer": {"b1": 0.9}}, "fleet": {"pools": [1], "max_batch": 8},
             "output_dir": "a", "checkpointing": {"resume": False, "keep": 2}}
    new = {"seed": 1, "trainer": {"kind": "megatron", "optimizer": {"b1": 0.8}}, "fleet": {"pools": [2], "max_batch": 8},
           "output_dir": "b", "checkpointing": {"resume": True, "keep": 3}}
    refused, changed = compare_configs(saved, new)
    assert refused == ["fleet.pools", "seed", "trainer.kind"]
    assert changed == ["checkpointing.keep 2 -> 3", "trainer.optimizer.b1 0.9 -> 0.8"]


def test_a_missing_model_path_is_one_line_naming_it_and_the_fix(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    code, err = _train(capsys, tmp_path / "run", "--set", f"model={{path: {missing}}}")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"model.path: {missing} does not exist" in err and "HF checkpoint directory" in err


@pytest.mark.parametrize("override, key, where", [
    ("logging.jsonl_path=runs/a/metrics.jsonl", "logging.jsonl_path", "metrics.jsonl"),
    ("logging={tensorboard_dir: runs/a/tb}", "logging.tensorboard_dir", "tensorboard/"),
    ("checkpointing={directory: runs/a/ckpt, every: 1}", "checkpointing.directory", "checkpoints/"),
])
def test_a_removed_output_path_is_refused_naming_output_dir(tmp_path, capsys, override, key, where):
    """The output paths a config once set live in the run folder now; the refusal says so and
    names the --set that gave one (and the key, when the override set a whole section)."""
    code, err = _train(capsys, tmp_path, "--set", override)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    prefix = f"--set {override}: " + ("" if override.startswith(key + "=") else f"{key}: ")
    assert err.startswith(f"hetrl train: {prefix}every output of a run lives under output_dir")
    assert f"<output_dir>/{where}" in err and "set output_dir instead" in err
    data = yaml.safe_load((CONFIG_DIR / "tiny_homogeneous.yaml").read_text())
    data.setdefault(key.split(".")[0], {})[key.split(".")[1]] = "somewhere"
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=rf"\n  {key}: every output of a run lives under output_dir"):
        load_config(tmp_path / "old.yaml")


def test_the_checkpointing_section_is_the_checkpoint_config_but_its_directory():
    from hetrl.core.checkpoints import CheckpointConfig

    section = _tiny(pathlib.Path("/runs/x"), "checkpointing={every: 4, keep: null, async_save: false}").checkpointing
    assert set(type(section).model_fields) == set(CheckpointConfig.model_fields) - {"directory"} | {"resume"}
    assert section.checkpoint_config("/runs/x/checkpoints") == CheckpointConfig(
        directory="/runs/x/checkpoints", every=4, keep=None, async_save=False)
    with pytest.raises(ConfigError, match="checkpointing.keep"):
        _tiny(pathlib.Path("/runs/x"), "checkpointing.keep=0")  # CheckpointConfig's own bounds


# ====================================================================== paths
def test_relative_paths_in_a_config_resolve_against_its_file_and_overrides_against_the_cwd(tmp_path, monkeypatch):
    where = tmp_path / "project" / "configs"
    where.mkdir(parents=True)
    data = yaml.safe_load((CONFIG_DIR / "tiny_homogeneous.yaml").read_text())
    data.update(output_dir="../runs/x", model={"path": "../models/m"}, ray={"temp_dir": "ray"})
    (where / "run.yaml").write_text(yaml.safe_dump(data))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    c = load_config(where / "run.yaml")
    assert c.output_dir == str(tmp_path / "project" / "runs" / "x")
    assert c.model.path == str(tmp_path / "project" / "models" / "m")
    assert c.ray.temp_dir == str(where / "ray")
    assert load_config(where / "run.yaml", ["output_dir=mine"]).output_dir == "mine"  # typed in a shell: the cwd's
    data.update(output_dir="gs://bucket/run", model={"path": "/abs/m"})
    (where / "run.yaml").write_text(yaml.safe_dump(data))
    c = load_config(where / "run.yaml")
    assert c.output_dir == "gs://bucket/run" and c.model.path == "/abs/m"


def test_the_shipped_warm_start_is_found_from_any_working_directory(tmp_path, monkeypatch):
    """Started elsewhere, the default config's model cache is still the repository's
    assets/models, where the shipped warm start is: resolved, not retrained."""
    import hetrl.warmstart.train as warmstart_train
    from hetrl.models.resolve import resolve_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(warmstart_train, "run_warmstart", lambda *a, **k: pytest.fail("retrained the warm start"))
    config = load_config("tiny_mixed.yaml")
    assert pathlib.Path(config.model.cache_dir) == REPO / "assets" / "models"
    assert pathlib.Path(config.output_dir) == REPO / "runs" / "tiny_mixed"
    model = resolve_model(config.model, tmp_path / "unused")
    assert model.parent == REPO / "assets" / "models" and (model / "model.safetensors").is_file()


def test_configuration_never_trains_a_model():
    """config.py imports neither the warm-start pipeline nor the model builders (no cycle with
    hetrl.warmstart.command either), and its model section has nothing that builds one."""
    code = ("import json, sys, hetrl.config, hetrl.warmstart.command; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('hetrl.warmstart.', 'hetrl.models.')))))")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=True)
    loaded = json.loads(out.stdout)
    assert "hetrl.warmstart.train" not in loaded and "hetrl.models.tiny" not in loaded
    from hetrl.config import ModelSection

    assert not hasattr(ModelSection, "materialize")


# ====================================================================== what a run writes
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny runs of 2 steps in two folders, then the first resumed to step 3."""
    from hetrl.orchestrator.local import LocalOrchestrator

    root = tmp_path_factory.mktemp("runs")
    a = LocalOrchestrator(_tiny(root / "a", "steps=2")).run()
    b = LocalOrchestrator(_tiny(root / "b", "steps=2")).run()
    files_before_resume = {p.relative_to(root / "a") for p in (root / "a").rglob("*")}
    resumed = LocalOrchestrator(_tiny(root / "a", "steps=3", "checkpointing.resume=true")).run()
    return root, a, b, resumed, files_before_resume


@pytest.mark.slow
def test_two_runs_with_different_output_dirs_share_no_file(runs):
    root, a, b, _, files_a = runs
    for result in (a, b):
        for path in (result.metrics_path, result.tensorboard_dir, result.checkpoint_dir, *result.plots):
            assert path.resolve().is_relative_to(result.output_dir.resolve()), path
    files_b = {p.relative_to(root / "b") for p in (root / "b").rglob("*")}
    expected = {"config.yaml", "metrics.jsonl", "summary.json", "tensorboard", "checkpoints", "plots", "hf",
                "generations", "model"}
    assert {p.parts[0] for p in files_a} == {p.parts[0] for p in files_b} == expected
    for name in ("metrics.jsonl", "generations/eval-2.jsonl", "hf/step-2/model.safetensors"):
        assert not (root / "a" / name).samefile(root / "b" / name)
    assert [json.loads(x)["step"] for x in (root / "b" / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


@pytest.mark.slow
def test_the_resolved_config_and_generations_of_every_evaluation_are_written(runs):
    root, _, b, _, _ = runs
    assert load_config(root / "b" / "config.yaml").resolved() == _tiny(root / "b", "steps=2").resolved()
    assert sorted(p.name for p in (root / "b" / "generations").iterdir()) == ["eval-0.jsonl", "eval-2.jsonl"]
    records = [json.loads(x) for x in (root / "b" / "generations" / "eval-2.jsonl").read_text().splitlines()]
    assert len(records) == 2 and {r["task_id"] for r in records} == {t.task_id for t in _heldout()[:2]}
    for r in records:
        assert set(r) == {"task_id", "prompt", "completion", "reward", "success"}
        assert r["prompt"] and isinstance(r["completion"], str) and isinstance(r["success"], bool)
    evals = [h for h in b.history if h["step"] == 2][0]
    assert evals["eval/success"] == sum(r["success"] for r in records) / 2
    assert evals["eval/reward"] == pytest.approx(sum(r["reward"] for r in records) / 2)


def _heldout():
    """The held-out tasks of a run of seed 0 that starts from no warm start (its default suite)."""
    from hetrl.envs.tasks_synthetic import SuiteConfig, synthetic_suite

    return synthetic_suite(SuiteConfig(seed=0)).heldout


@pytest.mark.slow
def test_the_hf_export_at_the_end_loads_with_transformers_and_latest_points_at_it(runs):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    root, _, b, _, _ = runs
    hf = root / "b" / "hf"
    assert (hf / "latest").is_symlink() and os.readlink(hf / "latest") == "step-2"
    assert sorted(p.name for p in hf.iterdir()) == ["latest", "step-1", "step-2"]  # keep: 2 checkpoints
    model = AutoModelForCausalLM.from_pretrained(hf / "latest", dtype=torch.float32)
    from hetrl.models.hf_io import load_state_dict

    exported = load_state_dict(hf / "step-2", require_manifest=True)  # checksummed like every hetrl export
    name = "model.layers.0.mlp.down_proj.weight"
    np.testing.assert_array_equal(model.state_dict()[name].numpy(), exported[name])
    for other in ("config.json", "tokenizer.json", "generation_config.json"):  # what `hetrl parity --checkpoint` reads
        assert (hf / "latest" / other).is_file()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


@pytest.mark.slow
def test_a_resumed_run_continues_the_folder_and_its_summary_covers_the_whole_run(runs):
    root, a, _, resumed, _ = runs
    assert resumed.final["version"] == 3
    assert [r["step"] for r in resumed.history] == [0, 1, 2, 3]  # history from the start
    assert [json.loads(x)["step"] for x in (root / "a" / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert resumed.final["groups_trained"] == 3 * 2 == a.final["groups_trained"] + 2  # counts continued
    summary = json.loads((root / "a" / "summary.json").read_text())
    assert summary["groups_trained"] == 6 and summary["version"] == 3
    assert os.readlink(root / "a" / "hf" / "latest") == "step-3"
    assert sorted(p.name for p in (root / "a" / "hf").iterdir()) == ["latest", "step-2", "step-3"]  # pruned with keep: 2
    assert yaml.safe_load((root / "a" / "config.yaml").read_text())["steps"] == 3
