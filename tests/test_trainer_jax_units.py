"""Fast unit tests of the JAX trainer's parts: config, mesh helpers, schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from hetrl.trainer_jax import DistributedConfig, JaxTrainerConfig, MeshConfig, OptimizerConfig, initialize_distributed, make_mesh
from hetrl.trainer_jax.mesh import fit_spec, local_batch_rows, local_rows_to_numpy, shard_batch
from hetrl.trainer_jax.optim import learning_rate_schedule, make_optimizer


def test_mesh_config_fills_the_free_axis_and_rejects_bad_shapes():
    assert MeshConfig().resolve(8) == (1, 8, 1)
    assert MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == (2, 2, 2)
    assert MeshConfig(data=2, fsdp=2, tensor=1).resolve(4) == (2, 2, 1)
    with pytest.raises(ValueError, match="needs 4 devices"):
        MeshConfig(data=2, fsdp=2, tensor=1).resolve(8)
    with pytest.raises(ValueError, match="cannot be split"):
        MeshConfig(data=3, fsdp=-1).resolve(8)
    with pytest.raises(ValueError, match="at most one"):
        MeshConfig(data=-1, fsdp=-1)
    assert MeshConfig(tensor=2, pipeline=2).resolve(8) == (1, 2, 2)  # pipeline stages take their share


def test_config_round_trips_and_rejects_what_the_trainer_cannot_do():
    config = JaxTrainerConfig(compute_dtype="fp32", mesh=MeshConfig(fsdp=1, tensor=-1),
                              optimizer=OptimizerConfig(schedule="linear", decay_steps=9, min_learning_rate=1e-7))
    assert JaxTrainerConfig.model_validate(config.model_dump(mode="json")) == config
    with pytest.raises(ValueError, match="decay_steps > warmup_steps"):
        OptimizerConfig(schedule="cosine", warmup_steps=10, decay_steps=5)
    with pytest.raises(ValueError, match="min_learning_rate must not exceed"):
        OptimizerConfig(learning_rate=1e-6, min_learning_rate=1e-5)
    with pytest.raises(ValueError, match="no pipeline parallelism"):
        JaxTrainerConfig(mesh=MeshConfig(pipeline=2))
    with pytest.raises(ValueError, match="correction_preset"):
        JaxTrainerConfig(correction_preset="mis")  # the run config's correction section owns it


@pytest.mark.parametrize("schedule, halfway", [("cosine", 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 0.5))),
                                               ("linear", 0.1 + 0.9 * 0.5)])
def test_schedule_warms_up_linearly_then_decays(schedule, halfway):
    sched = learning_rate_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=4, schedule=schedule, decay_steps=14,
                                                   min_learning_rate=0.1))
    values = [float(sched(t)) for t in range(16)]
    np.testing.assert_allclose(values[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    np.testing.assert_allclose(values[9], halfway, rtol=1e-6)
    np.testing.assert_allclose(values[14:], [0.1, 0.1], rtol=1e-6)
    assert float(learning_rate_schedule(OptimizerConfig(learning_rate=0.5))(0)) == 0.5


def test_optimizer_clips_the_global_norm_and_decays_matrices_only():
    config = OptimizerConfig(learning_rate=0.1, b1=0.0, b2=0.0, eps=1e-12, weight_decay=0.5, grad_clip=1.0)
    tx = make_optimizer(config)
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((3,))}
    grads = {"w": jnp.zeros((2, 2)), "b": jnp.asarray([30.0, 40.0, 0.0])}  # norm 50 -> clipped to 1
    updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((2, 2)), rtol=1e-6)  # decay only, no gradient
    np.testing.assert_allclose(updates["b"], [-0.1, -0.1, 0.0], atol=1e-6)  # Adam sign step, no decay on vectors


def test_fit_spec_replicates_dimensions_the_mesh_does_not_divide():
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    assert fit_spec(PartitionSpec("fsdp"), (3, 5), mesh) == PartitionSpec("fsdp", None)
    fake = type("M", (), {"shape": {"data": 1, "fsdp": 2, "tensor": 4}})()
    assert fit_spec(PartitionSpec("fsdp", "tensor"), (6, 6), fake) == PartitionSpec("fsdp", None)
    assert fit_spec(PartitionSpec(("data", "fsdp"), None), (4, 3), fake) == PartitionSpec(("data", "fsdp"), None)


def test_single_process_batches_hold_every_row():
    mesh = make_mesh(MeshConfig(fsdp=-1))
    n = 2 * jax.device_count()
    assert local_batch_rows(mesh, n) == slice(0, n)
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    arrays = shard_batch({"x": x}, mesh, n)
    assert np.array_equal(local_rows_to_numpy(arrays["x"]), x)
    with pytest.raises(ValueError, match="rows"):
        shard_batch({"x": x[:-1]}, mesh, n)


def test_initialize_distributed_is_a_no_op_without_a_coordinator(monkeypatch):
    monkeypatch.delenv("HETRL_COORDINATOR", raising=False)
    assert initialize_distributed(DistributedConfig()) is False
