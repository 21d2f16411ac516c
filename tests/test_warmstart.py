"""Warm start: SFT packing and loss, the transcripts' split hygiene, and `hetrl warmstart` end to
end on a very small setting (the learning figures are in BENCHMARKS.md, not asserted here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hetrl.envs.tasks_synthetic import synthetic_suite
from hetrl.models.config import ModelConfig
from hetrl.models.hf_io import check_state_dict, load_state_dict
from hetrl.warmstart.config import WarmstartConfig
from hetrl.warmstart.train import RESULT_FILE, training_tasks

SMALL = {
    "suite": {"tiers": [1], "max_per_tier": 20},
    "model": {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1},
    "training": {"steps": 40, "batch_size": 8, "seq_len": 128, "variants": 2, "warmup_steps": 5, "learning_rate": 3e-3},
    "eval": {"tasks": 4, "samples": 2, "max_new_tokens": 24},
}


def test_pack_examples_learns_exactly_the_answer_tokens():
    from hetrl.trainer_jax.sft import pack_examples

    data = pack_examples([([5, 6, 7], [8, 9]), ([3], [4, 5, 6])], seq_len=6, pad_id=0)
    # row 0: tokens 5 6 7 8 9 -> inputs 5 6 7 8, targets 6 7 8 9, learned where the target is 8 or 9
    assert data["input_ids"][0].tolist() == [5, 6, 7, 8, 0, 0]
    assert data["target_ids"][0].tolist() == [6, 7, 8, 9, 0, 0]
    assert data["loss_mask"][0].tolist() == [False, False, True, True, False, False]
    assert data["loss_mask"][1].tolist() == [True, True, True, False, False, False]
    assert data["attention_mask"][1].tolist() == [True, True, True, False, False, False]
    with pytest.raises(ValueError, match="more than seq_len"):
        pack_examples([([1] * 6, [2, 3])], seq_len=6, pad_id=0)


def test_sft_loss_is_the_masked_mean_cross_entropy():
    import jax.numpy as jnp

    from hetrl.trainer_jax.sft import sft_loss

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32)
    target = rng.integers(0, 11, size=(2, 5))
    mask = rng.random((2, 5)) < 0.6
    mask[0, 0] = True
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, target[..., None], -1)[..., 0][mask].mean()
    loss, accuracy = sft_loss(jnp.asarray(logits), {"target_ids": jnp.asarray(target), "loss_mask": jnp.asarray(mask)})
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    assert float(accuracy) == pytest.approx(float((logits.argmax(-1) == target)[mask].mean()))


@pytest.mark.parametrize("split", ["functions", "instances"])
def test_training_transcripts_never_show_a_heldout_task(split):
    c = WarmstartConfig.model_validate({**SMALL, "suite": {"tiers": [1, 2], "max_per_tier": 60, "split": split},
                                        "training": {"variants": 3}})
    tasks = training_tasks(c)
    heldout = synthetic_suite(c.suite).heldout
    assert heldout
    if split == "functions":
        assert not {t.task_id for t in heldout} & {t.task_id for t in tasks}
    else:  # every function is trained on, never with a held-out task's examples
        assert {t.task_id for t in heldout} <= {t.task_id for t in tasks}
        assert not {t.prompt for t in heldout} & {t.prompt for t in tasks}
    # each train function appears with `variants` different example draws
    by_id: dict[str, set] = {}
    for t in tasks:
        by_id.setdefault(t.task_id, set()).add(t.prompt)
    assert all(len(prompts) == 3 for prompts in by_id.values())


def test_config_key_tracks_training_settings_only():
    a = WarmstartConfig.model_validate(SMALL)
    assert a.key() == WarmstartConfig.model_validate({**SMALL, "eval": {"tasks": 9}}).key()
    assert a.key() != WarmstartConfig.model_validate({**SMALL, "seed": 1}).key()
    with pytest.raises(ValueError, match="num_attention_heads"):
        WarmstartConfig.model_validate({"model": {"hidden_size": 30, "num_attention_heads": 4}})


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    from hetrl.cli import main

    out = tmp_path_factory.mktemp("warm") / "ckpt"
    args = ["warmstart", "--out", str(out), "--no-progress"]
    for section in ("suite", "model", "training", "eval"):
        for key, value in SMALL[section].items():
            args += ["--set", f"{section}.{key}={value}"]
    assert main(args) == 0
    return out


@pytest.mark.slow
def test_warmstart_writes_a_loadable_hf_checkpoint_and_learns(warm):
    config = ModelConfig.load(warm)
    check_state_dict(config, load_state_dict(warm))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (warm / name).exists()
    result = json.loads((warm / RESULT_FILE).read_text())
    assert result["key"] == WarmstartConfig.model_validate(SMALL).key()
    curve = result["curve"]
    assert curve[-1]["step"] == SMALL["training"]["steps"]
    assert curve[-1]["loss"] < 0.7 * curve[0]["loss"]  # it learned something: random init is ~log(V)
    for mode, episodes in (("sampled", 4 * 2), ("greedy", 4)):
        scores = result["eval"][mode]
        assert scores["tasks"] == episodes and 0.0 <= scores["success"] <= 1.0 and 0.0 <= scores["reward"] <= 1.0


@pytest.mark.slow
def test_run_config_builds_the_warm_start_once(warm, tmp_path):
    from hetrl.config import ModelSection
    from hetrl.models.resolve import resolve_model
    from hetrl.warmstart.command import default_directory

    section = ModelSection.model_validate({"warmstart": SMALL, "cache_dir": str(tmp_path)})
    target = default_directory(section.warmstart.key(), tmp_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    import shutil

    shutil.copytree(warm, target)  # a finished warm start with these settings is reused, not retrained
    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(section, "unused", console=False) == target
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="exactly one"):
        ModelSection.model_validate({"warmstart": SMALL, "tiny": "qwen3"})
