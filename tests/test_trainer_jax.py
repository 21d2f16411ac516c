"""The JAX trainer: loss consistency with the numpy core, learning, sharded and multi-process
steps against one device, exact resume from Orbax checkpoints, HF export.

Multi-device and multi-process runs happen in subprocesses (tests/trainer_jax_worker.py), since
XLA_FLAGS and jax.distributed must be set before JAX starts. Every run here is float32.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from hetrl.core.correction import LossInputs, PRESETS, grpo_advantages, mismatch_metrics, policy_loss, replay_logprobs
from hetrl.models.hf_io import load_state_dict
from hetrl.models.tiny import TINY_QWEN3
from hetrl.trainer_jax import MeshConfig, make_mesh
from trainer_jax_worker import (
    MESHES, RESUME_CONFIG, TRAIN_CONFIG, model_logits_fn, model_matched_batch, read_result,
    make_trainer, rollouts_for_prompts, step_prompts,
)
from xla_env import host_devices

WORKER = pathlib.Path(__file__).with_name("trainer_jax_worker.py")
VOCAB = TINY_QWEN3.vocab_size
SUBPROCESS_TIMEOUT_S = 240

pytestmark = pytest.mark.slow


# ====================================================================== fixtures
@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> pathlib.Path:
    return tiny_checkpoint(TINY_QWEN3, seed=0, init_std=0.08)


@pytest.fixture(scope="module")
def logits_fn(ckpt):
    return model_logits_fn(ckpt)


@pytest.fixture(scope="module")
def batch(logits_fn):
    return model_matched_batch(logits_fn, VOCAB, seed=0, batch=8)


@pytest.fixture(scope="module")
def batch_file(batch, tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("batch") / "batch.safetensors"
    path.write_bytes(batch.to_bytes())
    return path


@pytest.fixture(scope="module")
def one_device():
    return make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])


@pytest.fixture(scope="module")
def reference(ckpt, batch, one_device):
    """One step of the fp32 hetrl-corrected trainer on one device, with what surrounds it."""
    trainer = make_trainer(ckpt, TRAIN_CONFIG, mesh=one_device)
    before = trainer.export_hf_weights()
    logprobs = trainer.logprobs(batch)
    metrics = trainer.train_step(batch)
    return dict(trainer=trainer, before=before, logprobs=logprobs, metrics=metrics, after=trainer.export_hf_weights())


def _run(args: list[str], env: dict[str, str] | None = None, timeout: int = SUBPROCESS_TIMEOUT_S) -> None:
    proc = subprocess.run([sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"worker {args[0]} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"


def _env(devices: int) -> dict[str, str]:
    return os.environ | host_devices(devices)


def _assert_weights_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol: float = 1e-5) -> None:
    """Every tensor within ``rtol`` of its own scale: max|got − want| ≤ rtol · max|want|."""
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        err = float(np.max(np.abs(got[name].astype(np.float64) - ref)))
        assert err <= rtol * float(np.max(np.abs(ref))), f"{name}: max error {err:.3e}, scale {np.max(np.abs(ref)):.3e}"


def _assert_rel(got: float, want: float, rtol: float = 1e-5) -> None:
    assert abs(got - want) <= rtol * abs(want), f"{got!r} vs {want!r} (rel {abs(got - want) / abs(want):.2e})"


# ====================================================================== consistency and learning
def test_export_after_load_equals_the_checkpoint_exactly(reference, ckpt):
    state = load_state_dict(ckpt)
    assert sorted(reference["before"]) == sorted(state)
    for name, value in state.items():
        got = reference["before"][name]
        assert got.dtype == np.float32 and np.array_equal(got, value), name


def test_step_moves_every_tensor_and_reports_metrics(reference):
    m = reference["metrics"]
    assert all(np.isfinite(v) for v in m.values())
    assert m["version"] == 0 and reference["trainer"].version == 1
    assert m["learning_rate"] == pytest.approx(1e-3) and m["grad_norm"] > 0 and m["loss"] != 0
    for key in ("mismatch/k3", "mismatch/ess", "pool/b200-bf16/mismatch/k1", "pool/mi300x-fp8/mismatch/masked_frac/sequence",
                "mismatch/staleness_max", "entropy"):
        assert key in m, key
    assert 0 < m["mismatch/masked_frac/sequence"] < 1  # some rows kept, some masked by the geometric bounds
    for name, value in reference["after"].items():
        assert not np.array_equal(value, reference["before"][name]), f"{name} did not move"


def _numpy_loss_inputs(batch, logits):
    adv = grpo_advantages(batch.reward.astype(np.float64), batch.group_index, batch.num_groups)
    return LossInputs(
        logits=logits, target_ids=batch.target_ids, loss_mask=batch.loss_mask,
        sampler_logprobs=batch.sampler_logprobs.astype(np.float64), support_ids=batch.support_ids,
        support_mask=batch.support_mask, support_logprobs=batch.support_logprobs.astype(np.float64),
        support_kept=batch.support_kept, advantages=adv, temperature=batch.temperature.astype(np.float64),
    )


def test_loss_and_metrics_match_numpy_float64(reference, batch, logits_fn):
    logits = logits_fn(batch.input_ids, batch.attention_mask).astype(np.float64)
    loss, stats = policy_loss(_numpy_loss_inputs(batch, logits), PRESETS["hetrl"])
    _assert_rel(reference["metrics"]["loss"], float(loss))
    metrics = mismatch_metrics(stats, batch.loss_mask, batch.pool_index, batch.pool_names, batch.policy_version, 0)
    for key in ("mismatch/k1", "mismatch/k3", "mismatch/ess", "mismatch/masked_frac/any", "pool/mi300x-fp8/mismatch/chi2_token"):
        assert reference["metrics"][key] == pytest.approx(float(metrics[key]), rel=1e-4, abs=1e-6), key


def test_logprobs_replay_kept_supports_and_match_numpy(reference, batch, logits_fn):
    logits = logits_fn(batch.input_ids, batch.attention_mask).astype(np.float64)
    replayed, _ = replay_logprobs(logits, batch.target_ids, batch.support_ids, batch.support_mask, batch.temperature.astype(np.float64))
    full = logits / batch.temperature[:, None, None]
    full = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)
    full = np.take_along_axis(full, batch.target_ids[..., None].astype(np.int64), axis=-1)[..., 0]
    want = np.where(batch.support_kept[:, None], replayed, full)
    got = reference["logprobs"]
    mask = batch.loss_mask
    assert got.shape == batch.target_ids.shape
    np.testing.assert_allclose(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert not np.allclose(got[mask & batch.support_kept[:, None]], full[mask & batch.support_kept[:, None]], atol=1e-3)


def test_steps_raise_logprob_of_positive_advantage_tokens(ckpt, batch, one_device):
    trainer = make_trainer(ckpt, TRAIN_CONFIG, correction_preset="none", optimizer=dict(learning_rate=3e-3),
                           mesh=one_device)
    adv = grpo_advantages(batch.reward.astype(np.float64), batch.group_index, batch.num_groups)
    up = batch.loss_mask & (adv > 0)[:, None]
    down = batch.loss_mask & (adv < 0)[:, None]
    assert up.any() and down.any()
    history = [trainer.logprobs(batch)]
    for _ in range(3):
        trainer.train_step(batch)
        history.append(trainer.logprobs(batch))
    ups = [lp[up].mean() for lp in history]
    downs = [lp[down].mean() for lp in history]
    assert all(b > a for a, b in zip(ups, ups[1:])), ups
    assert downs[-1] < downs[0], downs


def test_ppo_clip_needs_old_logprobs_and_starts_at_minus_mean_advantage(ckpt, batch, one_device):
    trainer = make_trainer(ckpt, TRAIN_CONFIG, correction_preset="none", correction_overrides=dict(ppo_clip=(0.2, 0.2)),
                           mesh=one_device)
    with pytest.raises(ValueError, match="old_logprobs"):
        trainer.train_step(batch)
    metrics = trainer.train_step(batch, old_logprobs=trainer.logprobs(batch))
    adv = grpo_advantages(batch.reward.astype(np.float64), batch.group_index, batch.num_groups)
    mask = batch.loss_mask
    want = -float((adv[:, None] * mask).sum() / mask.sum())  # ratio exp(log p − log p_old) = 1 at p_old = p
    assert metrics["loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_bf16_compute_keeps_fp32_master_weights(ckpt, batch, one_device, reference):
    trainer = make_trainer(ckpt, TRAIN_CONFIG, compute_dtype="bf16", mesh=one_device)
    metrics = trainer.train_step(batch)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(trainer.params))
    assert metrics["loss"] != reference["metrics"]["loss"]  # BF16 really is used...
    assert metrics["loss"] == pytest.approx(reference["metrics"]["loss"], rel=0.1)  # ...and stays close


def test_save_hf_writes_a_loadable_checkpoint_with_its_version(reference, tmp_path):
    out = reference["trainer"].save_hf(tmp_path / "export")
    state = load_state_dict(out)
    assert all(np.array_equal(state[k], v) for k, v in reference["after"].items()) and sorted(state) == sorted(reference["after"])
    assert (out / "hetrl_version.txt").read_text().strip() == "1"


# ====================================================================== sharded and multi-process
def test_sharded_steps_match_one_device(reference, ckpt, batch_file, tmp_path):
    out = tmp_path / "sharded.safetensors"
    _run(["sharded", str(ckpt), str(batch_file), str(out)], env=_env(4))
    result = read_result(out)
    for name in MESHES:
        _assert_rel(float(result[f"loss.{name}"][0]), reference["metrics"]["loss"])
        _assert_weights_close({k.split("/", 1)[1]: v for k, v in result.items() if k.startswith(name + "/")}, reference["after"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_take_the_single_process_step(reference, ckpt, batch_file, tmp_path):
    port, out = _free_port(), tmp_path / "multihost.safetensors"
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), "multihost", str(ckpt), str(batch_file), str(out), str(i), "2", str(port)],
                         env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    errors = []
    for i, proc in enumerate(procs):
        try:
            _, stderr = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            _, stderr = proc.communicate()
            errors.append(f"process {i} timed out:\n{stderr[-4000:]}")
            continue
        if proc.returncode != 0:
            errors.append(f"process {i} exited {proc.returncode}:\n{stderr[-4000:]}")
    assert not errors, "\n\n".join(errors)
    result = read_result(out)
    assert (result["first_row"][0], result["num_rows"][0]) == (0, 4)  # process 0 loaded only its half
    _assert_rel(float(result["loss"][0]), reference["metrics"]["loss"])
    _assert_weights_close({k: v for k, v in result.items() if k in reference["after"]}, reference["after"])


# ====================================================================== checkpoints
def test_resume_in_a_fresh_process_is_exact_and_retention_holds(ckpt, tmp_path):
    run_dir = tmp_path / "run"
    trainer = make_trainer(ckpt, RESUME_CONFIG, checkpoint=dict(directory=str(run_dir), every=1, keep=2))
    for step in range(3):
        trainer.train_step(rollouts_for_prompts(step_prompts(step), VOCAB))
        assert trainer.save(force=False)
    assert trainer.checkpoint_steps() == [2, 3]
    assert sorted(p.name for p in run_dir.iterdir() if p.name.isdigit()) == ["2", "3"]
    metrics = trainer.train_step(rollouts_for_prompts(step_prompts(3), VOCAB))  # the uninterrupted 4th step
    weights = trainer.export_hf_weights()
    trainer.close()

    out = tmp_path / "resumed.safetensors"
    _run(["resume", str(ckpt), str(run_dir), str(out)], env=os.environ.copy())
    result = read_result(out)
    assert result["restored_step"][0] == 3
    assert result["loss"][0] == metrics["loss"]
    for name, value in weights.items():
        assert np.array_equal(result[name], value), name


def test_restore_rejects_a_missing_checkpoint(ckpt, tmp_path, one_device):
    trainer = make_trainer(ckpt, TRAIN_CONFIG, checkpoint=dict(directory=str(tmp_path / "empty")), mesh=one_device)
    with pytest.raises(FileNotFoundError):
        trainer.restore()
    trainer.close()

