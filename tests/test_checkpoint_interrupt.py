"""A checkpoint write interrupted halfway (the process dies mid-save): the previous checkpoint
stays the latest loadable one, the unfinished write is cleaned up, and the step can be saved
again. The JAX trainer's Orbax checkpointer and the orchestrator's buffer snapshots."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from hetrl.orchestrator.loop import write_atomic  # noqa: E402
from hetrl.trainer_jax.checkpoint import TrainCheckpointer, abstract_like  # noqa: E402

DIES_MID_SAVE = """
import os, sys
import jax.numpy as jnp
import orbax.checkpoint as ocp
from hetrl.trainer_jax.checkpoint import TrainCheckpointer

ck = TrainCheckpointer(sys.argv[1], keep=3, async_save=False)
ck.save(1, {"w": jnp.full((64, 64), 1.0)}, {"m": jnp.zeros(4)}, {"step": 1})
ck.wait()

def die(*args, **kwargs):  # the process is killed while step 2's items are being written
    os._exit(17)

ocp.JsonCheckpointHandler.save = ocp.JsonCheckpointHandler.async_save = die
ck.save(2, {"w": jnp.full((64, 64), 2.0)}, {"m": jnp.ones(4)}, {"step": 2})
ck.wait()
"""


def _targets():
    return abstract_like({"w": jnp.zeros((64, 64))}), abstract_like({"m": jnp.zeros(4)})


def test_a_save_killed_halfway_leaves_the_previous_checkpoint_loadable(tmp_path):
    directory = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", DIES_MID_SAVE, str(directory)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 17, proc.stderr[-2000:]
    partial = [p.name for p in directory.iterdir() if p.name.startswith("2")]
    assert partial and all("tmp" in name for name in partial)  # step 2 was half written, never finalized
    ck = TrainCheckpointer(directory, keep=3, async_save=False)
    assert ck.all_steps() == [1] and ck.latest_step() == 1
    params, opt_state, meta = ck.restore(*_targets())
    assert meta == {"step": 1} and float(params["w"].min()) == float(params["w"].max()) == 1.0
    ck.save(3, {"w": jnp.full((64, 64), 3.0)}, {"m": jnp.ones(4)}, {"step": 3})  # the run goes on
    ck.wait()
    params, _, meta = ck.restore(*_targets())
    assert ck.all_steps() == [1, 3] and meta == {"step": 3} and float(params["w"][0, 0]) == 3.0
    assert sorted(p.name for p in directory.iterdir()) == ["1", "3"]  # the unfinished write is cleaned up
    ck.close()


def test_a_snapshot_write_interrupted_before_it_completes_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "buffer-3.json"
    write_atomic(path, json.dumps({"version": 1, "step": 3}))

    def crash(src, dst):
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, json.dumps({"version": 1, "step": 3, "pending": ["x" * 1000]}))
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"version": 1, "step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["buffer-3.json"]
