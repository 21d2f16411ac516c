"""Run configs: the shipped YAML files, dotted overrides, errors naming the key, the CLI."""

import pathlib
import re
import subprocess
import sys

import pytest
import yaml

from hetrl.cli import main
from hetrl.config import (
    CONFIG_DIR,
    ConfigError,
    RunConfig,
    apply_override,
    load_config,
    validate_config,
)
from hetrl.core.correction import PRESETS
from hetrl.core.training import TrainerSettings
from hetrl.orchestrator.trainer_handle import TrainerSetup
from hetrl.trainer_jax.config import JaxTrainerConfig
from hetrl.trainer_megatron.config import MegatronTrainerConfig

SHIPPED = sorted(p.name for p in CONFIG_DIR.glob("*.yaml") if not p.name.startswith("experiment_"))  # run configs


def test_the_four_configs_ship():
    assert {"tiny_mixed.yaml", "tiny_homogeneous.yaml", "qwen3_b200_megatron.yaml", "qwen3_tpu_jax.yaml"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_validate_and_round_trip(name):
    config = load_config(CONFIG_DIR / name)
    again = validate_config(yaml.safe_load(config.to_yaml()))
    assert again.resolved() == config.resolved()  # the printed config means the same run
    assert again.correction.resolve() == config.correction.resolve()
    for pool in config.fleet.pools:
        pool.numerics()  # formats native to the accelerator


def test_tiny_mixed_is_six_kinds_three_precisions():
    c = load_config("tiny_mixed.yaml")
    kinds = {p.accelerator for p in c.fleet.pools}
    assert kinds == {"b200", "h100", "mi300x", "a100", "l40s", "tpu-v6e"}
    assert {p.numerics().weight_format for p in c.fleet.pools} >= {"bf16", "fp8_e4m3", "fp8_e4m3fnuz", "nvfp4"}
    assert all(p.engine == "embedded" for p in c.fleet.pools) and c.model.warmstart is not None
    assert isinstance(c.trainer, JaxTrainerConfig)


def test_tiny_configs_start_from_the_shipped_warm_start():
    """Both tiny configs name one warm start, and the checkpoint shipped for it was trained with
    exactly those settings (its ``warmstart.json`` key), so `make train` does not retrain it (the
    configs' relative ``cache_dir`` resolves against configs/, from any working directory)."""
    import json

    from hetrl.models.config import ModelConfig
    from hetrl.models.hf_io import check_state_dict, load_state_dict
    from hetrl.warmstart.command import default_directory
    from hetrl.warmstart.train import RESULT_FILE

    mixed, homogeneous = load_config("tiny_mixed.yaml").model, load_config("tiny_homogeneous.yaml").model
    assert mixed == homogeneous and mixed.warmstart is not None
    directory = default_directory(mixed.warmstart.key(), CONFIG_DIR.parent / mixed.cache_dir)
    assert json.loads((directory / RESULT_FILE).read_text())["key"] == mixed.warmstart.key()
    check_state_dict(ModelConfig.load(directory), load_state_dict(directory))


def test_tiny_homogeneous_is_b200_bf16_only():
    c = load_config("tiny_homogeneous")
    assert {(p.accelerator, p.numerics().weight_format, p.numerics().kv_format) for p in c.fleet.pools} == {("b200", "bf16", "bf16")}


def test_real_cluster_examples():
    mega = load_config("qwen3_b200_megatron.yaml")
    assert isinstance(mega.trainer, MegatronTrainerConfig) and mega.trainer.mesh.tensor == 2
    assert {p.engine for p in mega.fleet.pools} == {"sglang"} and mega.model.path
    tpu = load_config("qwen3_tpu_jax.yaml")
    assert isinstance(tpu.trainer, JaxTrainerConfig) and tpu.trainer.mesh.tensor == 4
    assert {p.engine for p in tpu.fleet.pools} == {"sglang-jax"}


def test_the_trainer_section_is_the_trainers_config_and_the_setup_adds_what_other_sections_own():
    c = load_config("tiny_mixed.yaml", ["correction.veto_threshold=1e-4", "checkpointing.every=7"])
    assert type(c.trainer) is JaxTrainerConfig  # no second schema: the section is the trainer's config
    setup = TrainerSetup.of(c, "/runs/x/checkpoints")
    assert setup.settings is c.trainer and setup.seed == c.seed
    assert setup.correction == PRESETS["hetrl"].model_copy(update={"veto_threshold": 1e-4})
    assert (setup.checkpoint.directory, setup.checkpoint.every) == ("/runs/x/checkpoints", 7)
    for owned in ("correction_preset", "checkpoint"):  # owned by correction / checkpointing, not the trainer
        with pytest.raises(ConfigError, match=f"trainer.{owned}=1: unknown key {owned!r}"):
            load_config("tiny_mixed.yaml", [f"trainer.{owned}=1"])


def test_both_trainers_share_one_settings_vocabulary():
    shared = set(TrainerSettings.model_fields)
    assert shared <= set(JaxTrainerConfig.model_fields) and shared <= set(MegatronTrainerConfig.model_fields)
    assert JaxTrainerConfig.model_fields["optimizer"].annotation is MegatronTrainerConfig.model_fields["optimizer"].annotation
    mega = load_config("qwen3_b200_megatron.yaml", ["correction.preset=mis"]).trainer
    assert mega.parallel_sizes(8) == (2, 1, 4)  # tensor 2, no pipeline, data parallel over the rest
    with pytest.raises(ValueError, match="3 devices cannot be split"):
        mega.parallel_sizes(3)


def test_switching_the_trainer_keeps_every_shared_setting():
    """``trainer.kind=megatron`` on a JAX section (and back) changes the kind only."""
    schedule = ["trainer.optimizer.schedule=cosine", "trainer.optimizer.decay_steps=40",
                "trainer.optimizer.min_learning_rate=5e-6"]
    jax_cfg = load_config("tiny_mixed.yaml", schedule)
    mega = load_config("tiny_mixed.yaml", [*schedule, "trainer.kind=megatron", "trainer.micro_batch_size=4"])
    assert isinstance(mega.trainer, MegatronTrainerConfig) and mega.trainer.micro_batch_size == 4
    assert {k: getattr(mega.trainer, k) for k in TrainerSettings.model_fields if k != "kind"} == \
        {k: getattr(jax_cfg.trainer, k) for k in TrainerSettings.model_fields if k != "kind"}
    back = load_config("tiny_mixed.yaml", [*schedule, "trainer.kind=megatron", "trainer.kind=jax"])
    assert back.trainer == jax_cfg.trainer


@pytest.mark.parametrize("config, overrides, message", [
    ("tiny_mixed.yaml", ["trainer.optimizer.weight_decay=0.1", "trainer.optimizer.decay_vectors=true",
                         "trainer.kind=megatron"], "the Megatron trainer never decays biases and norms"),
    ("qwen3_b200_megatron.yaml", ["trainer.mesh.pipeline=2"], "does not run pipeline stages yet"),
    ("qwen3_b200_megatron.yaml", ["trainer.kind=jax"],
     "trainer.distributed_optimizer: 'distributed_optimizer' is a setting of the 'megatron' trainer only"),
    ("qwen3_tpu_jax.yaml", ["trainer.distributed={auto: true}", "trainer.kind=megatron"],
     "trainer.distributed={auto: true}: 'distributed' is a setting of the 'jax' trainer only: the 'megatron' trainer cannot"),
    ("tiny_mixed.yaml", ["trainer.mesh.pipeline=2"], "the JAX trainer has no pipeline parallelism"),
])
def test_a_setting_the_trainer_cannot_honour_is_refused_by_name(config, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(config, overrides)


def test_lockstep_schedule_needs_synchronous_embedded_pools():
    ok = load_config("tiny_mixed.yaml", ["async.schedule=lockstep", "async.max_staleness=0"])
    assert ok.async_.schedule == "lockstep"
    with pytest.raises(ConfigError, match="max_staleness: 0"):
        load_config("tiny_mixed.yaml", ["async.schedule=lockstep", "async.max_staleness=1"])
    with pytest.raises(ConfigError, match="embedded pools only"):
        load_config("tiny_mixed_sglang.yaml", ["async.schedule=lockstep", "async.max_staleness=0"])


# ---------------------------------------------------------------------- overrides
def test_overrides_are_typed_and_reach_lists():
    c = load_config("tiny_mixed.yaml", ["fleet.pools[0].replicas=3", "async.max_staleness=0", "steps=5",
                                         "correction.token_bounds=[0.25, 4.0]", "correction.preset=mis",
                                         "fleet.pools[6]={name: extra, accelerator: h200}",
                                         "async.sampling.top_p=0.8", "model.cache_dir=null"])
    assert c.fleet.pools[0].replicas == 3 and c.async_.max_staleness == 0 and c.steps == 5
    assert c.correction.resolve().token_bounds == (0.25, 4.0) and c.correction.preset == "mis"
    assert c.fleet.pools[6].name == "extra" and c.async_.sampling.top_p == 0.8 and c.model.cache_dir is None


def test_switching_the_trainer_kind():
    c = load_config("qwen3_tpu_jax.yaml", ["trainer={kind: megatron, mesh: {tensor: 8}}"])
    assert isinstance(c.trainer, MegatronTrainerConfig) and c.trainer.mesh.tensor == 8


@pytest.mark.parametrize("shorthand, axis", [("tensor_parallel", "tensor"), ("data_parallel", "data")])
def test_a_megatron_mesh_shorthand_overrides_the_files_mesh_axis(shorthand, axis):
    c = load_config("tiny_mixed.yaml", ["trainer.kind=megatron", "trainer.world_size=2", f"trainer.{shorthand}=2"])
    assert c.trainer.mesh.model_dump() == {"data": 1, "fsdp": -1, "tensor": 1, "pipeline": 1} | {axis: 2}
    assert shorthand not in c.trainer.model_dump()  # kept once, in the mesh


def test_a_mesh_shorthand_in_a_file_sets_its_axis_and_may_not_contradict_the_mesh():
    assert MegatronTrainerConfig(kind="megatron", data_parallel=4).mesh.model_dump() == {
        "data": 4, "fsdp": -1, "tensor": 1, "pipeline": 1}
    with pytest.raises(ValueError, match="does not run pipeline stages yet"):
        MegatronTrainerConfig(kind="megatron", pipeline_parallel=2)
    assert MegatronTrainerConfig(kind="megatron", tensor_parallel=2, mesh={"tensor": 2}).mesh.tensor == 2
    data = yaml.safe_load((CONFIG_DIR / "qwen3_b200_megatron.yaml").read_text())
    data["trainer"]["tensor_parallel"] = 4  # the file's mesh says tensor: 2
    with pytest.raises(ConfigError, match="tensor_parallel: 4 contradicts mesh.tensor: 2"):
        validate_config(data)


@pytest.mark.parametrize("override, message", [
    ("steps", "must look like key=value"),
    ("fleet..pools=1", "is malformed"),
    ("fleet.pools[9].replicas=1", "index out of range"),
    ("steps[0]=1", "steps is not a list"),
    ("fleet.pools.name=x", "fleet.pools is not a map"),
    ("steps=[1", "not valid YAML"),
])
def test_bad_overrides(override, message):
    data = yaml.safe_load((CONFIG_DIR / "tiny_mixed.yaml").read_text())
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        apply_override(data, override)


# ---------------------------------------------------------------------- errors name the key
@pytest.mark.parametrize("override, message", [
    ("fleet.pools[3].weight_precision=fp8_e4m3", "accelerator 'a100' does not run weight format 'fp8_e4m3'"),
    ("fleet.pools[0].replicaz=2", "unknown key 'replicaz'"),
    ("fleet.pools[1].accelerator=v100", "unknown accelerator kind 'v100'"),
    ("trainer.mesh.tensor=0", "mesh axis sizes must be positive"),
    ("trainer.optimizer.learning_rate=-1", "Input should be greater than 0"),
    ("trainer.kind=pytorch", "Input tag 'pytorch' found using 'kind' does not match"),
    ("trainer.sequence_parallel=2", "unknown key 'sequence_parallel'"),
    ("trainer.tensor_parallel=0", "mesh axis sizes must be positive"),
    ("trainer.data.batch_size=4", "unknown key 'data'"),
    ("async.max_staleness=-1", "Input should be greater than or equal to 0"),
    ("async.stale_policy=keep", "Input should be 'drop' or 'regenerate'"),
    ("async.sampling.top_p=1.5", "Input should be less than or equal to 1"),
    ("correction.preset=magic", "unknown correction preset 'magic'"),
    ("correction.veto_threshold=-1", "veto_threshold: Input should be greater than 0"),
    ("correction.token_bounds=[2, 1]", "token_bounds must satisfy 0 <= L <= U"),
    ("model.path=/x", "set exactly one of 'tiny'"),
    ("fleet.pools[1].name=b200-nvfp4", "pool names must be unique"),
    ("loging.every=2", "unknown key 'loging'"),
    ("steps=many", "Input should be a valid integer"),
    ("fleet.pools=5", "Input should be a valid tuple"),
    ("logging.console=maybe", "Input should be a valid boolean"),
    ("fleet.max_batch=0", "Input should be greater than or equal to 1"),
    ("model=null", "Input should be a valid dictionary"),
])
def test_a_bad_override_fails_naming_the_override(override, message):
    """An error an override caused names the override (which names the key), not the file."""
    with pytest.raises(ConfigError) as err:
        load_config("tiny_mixed.yaml", [override])
    assert str(err.value).startswith(f"--set {override}: ") and message in str(err.value)
    assert "tiny_mixed.yaml" not in str(err.value) and "Value error" not in str(err.value)


def test_missing_file_and_non_map():
    with pytest.raises(ConfigError, match="not found"):
        load_config("no_such_config.yaml")
    with pytest.raises(ConfigError, match="must be a map"):
        validate_config([1, 2])


@pytest.mark.parametrize("text, message", [
    ("steps: [1\n", "not valid YAML: while parsing a flow sequence"),
    ("steps: 5\nseed: 1\nsteps: 50\n", "not valid YAML: found the key 'steps'"),
    ("fleet: {max_batch: 2, max_batch: 4}\n", "found the key 'max_batch'"),
    ("", "the config must be a map, got NoneType"),
    ("- steps: 5\n", "the config must be a map, got list"),
])
def test_a_malformed_file_fails_naming_the_file(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_a_missing_section_and_an_unreadable_file_fail_naming_them(tmp_path):
    path = tmp_path / "no_model.yaml"
    path.write_text("fleet: {pools: [{name: a, accelerator: h100}]}\n")
    with pytest.raises(ConfigError, match="no_model.yaml: invalid config:\n  model: Field required"):
        load_config(path)
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe steps: 1")
    with pytest.raises(ConfigError, match="binary.yaml: cannot read the config: 'utf-8' codec"):
        load_config(tmp_path / "binary.yaml")
    with pytest.raises(ConfigError, match="cannot read the config: .*Is a directory"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="override model: value .* found the key 'tiny'"):
        load_config(path, ["model={tiny: qwen3, tiny: qwen2}"])


# ---------------------------------------------------------------------- server endpoints
@pytest.mark.parametrize("override, message", [
    ("fleet.pools[1].endpoints[0]=http://h100-sgl-0:30000", "'http://h100-sgl-0:30000': plain http to a non-loopback host"),
    ("fleet.pools[2].endpoints[0]=mi300x-sgl-0:30000", "'mi300x-sgl-0:30000' must be an http:// or https:// URL"),
    ("fleet.pools[0].endpoints[1]=https://b200-sgl-1:3e4", "'https://b200-sgl-1:3e4' is not a valid URL"),
    ("fleet.pools[0].api_key_env=$KEY", "String should match pattern"),
])
def test_bad_endpoints_fail_naming_the_endpoint_override(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("qwen3_b200_megatron.yaml", [override])
    assert str(err.value).startswith(f"--set {override}: ") and message in str(err.value)


def test_insecure_http_needs_an_explicit_opt_in_and_loopback_needs_none():
    c = load_config("qwen3_b200_megatron.yaml", ["fleet.pools[1].endpoints[0]=http://h100-sgl-0:30000",
                                                  "fleet.pools[1].allow_insecure_http=true",
                                                  "fleet.pools[2].endpoints[0]=http://127.0.0.1:30000"])
    assert c.fleet.pools[1].endpoints[0].startswith("http://") and c.fleet.pools[2].endpoints[0].startswith("http://")


@pytest.mark.parametrize("overrides, message", [
    (["async.sampling.top_p=0.9"], "fleet.pools[b200-nvfp4] with async.sampling: top_p=0.9 without a top-k cap"),
    (["async.sampling.top_k=128", "async.sampling.top_p=0.9"], "top_k=128 exceeds the log-prob head"),
])
def test_server_pools_refuse_sampling_their_head_cannot_rebuild(overrides, message):
    assert load_config("qwen3_b200_megatron.yaml", overrides).async_.sampling.top_p == 0.9  # native masks: exact
    head = [f"fleet.pools[{i}].server.sampling_mask=head" for i in range(5)]
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("qwen3_b200_megatron.yaml", overrides + head)
    approx = [f"fleet.pools[{i}].server.support=head_tail" for i in range(5)]
    assert load_config("qwen3_b200_megatron.yaml", overrides + head + approx).async_.sampling.top_p == 0.9


def test_the_resolved_config_names_the_api_key_variable_never_the_key(capsys, monkeypatch):
    monkeypatch.setenv("HETRL_SGLANG_API_KEY", "sk-do-not-print-me")
    out = load_config("qwen3_b200_megatron.yaml").to_yaml()  # what --dry-run prints of a runnable config
    assert "sk-do-not-print-me" not in out
    assert {p["api_key_env"] for p in yaml.safe_load(out)["fleet"]["pools"]} == {"HETRL_SGLANG_API_KEY"}
    assert main(["train", "qwen3_b200_megatron.yaml", "--dry-run"]) == 1  # refused (tests/test_errors.py), saying why
    assert "sk-do-not-print-me" not in "".join(capsys.readouterr())
    pool = load_config("qwen3_b200_megatron.yaml").fleet.pools[0]
    assert pool.auth_headers() == {"Authorization": "Bearer sk-do-not-print-me"}


def test_defaults_are_complete():
    c = RunConfig.model_validate({"model": {"tiny": "qwen3"}, "fleet": {"pools": [{"name": "a", "accelerator": "h100"}]}})
    assert c.trainer.kind == "jax" and c.correction.resolve() == PRESETS["hetrl"] and c.async_.group_size == 4


def test_tiny_model_is_built_once(tmp_path):
    from hetrl.models.resolve import resolve_model

    c = load_config("tiny_mixed.yaml", ["model={tiny: qwen3}"])
    path = resolve_model(c.model, tmp_path)
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(c.model, tmp_path) == path and (path / "model.safetensors").stat().st_mtime_ns == mtime


# ---------------------------------------------------------------------- the CLI
def test_dry_run_prints_the_resolved_config(capsys):
    assert main(["train", "configs/tiny_mixed.yaml", "--dry-run", "--set", "fleet.pools[0].replicas=2"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["fleet"]["pools"][0]["replicas"] == 2
    assert out["correction"]["score_centering"] is True and out["correction"]["token_bounds"] == [0.5, 2.0]
    assert out["async"]["max_staleness"] == 2 and out["trainer"]["kind"] == "jax"


def test_cli_bad_value_exits_nonzero_naming_the_key(capsys):
    assert main(["train", "tiny_mixed.yaml", "--dry-run", "--set", "async.max_staleness=-3"]) == 1
    assert "async.max_staleness" in capsys.readouterr().err


def test_cli_switching_trainer_keeps_the_settings_or_names_what_does_not_fit(capsys):
    assert main(["train", "tiny_homogeneous.yaml", "--trainer", "megatron", "--dry-run"]) == 0
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert (trainer["kind"], trainer["compute_dtype"]) == ("megatron", "fp32")  # tiny_homogeneous trains in fp32
    assert main(["train", "tiny_homogeneous.yaml", "--trainer", "megatron", "--dry-run",
                 "--set", "trainer.optimizer.decay_vectors=true", "--set", "trainer.optimizer.weight_decay=0.1"]) == 1
    assert "never decays biases and norms: set decay_vectors to false" in capsys.readouterr().err


def test_console_script_dry_run():
    exe = pathlib.Path(sys.executable).with_name("hetrl")
    out = subprocess.run([str(exe), "train", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["name"] == "tiny_mixed"
