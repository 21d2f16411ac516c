"""The metric monitors (hetrl.orchestrator.monitors): the JSONL file, TensorBoard events read back
by TensorBoard's own reader, an offline W&B run, and the fan-out."""

import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest

from hetrl.config import ConfigError, load_config
from hetrl.orchestrator.monitors import JsonlMonitor, Monitors, TensorBoardMonitor, WandbMonitor, build_monitors

RECORDS = [
    {"step": 1, "reward/mean": np.float32(0.25), "mismatch/k3": 4.73e-4, "eval/success": float("nan"),
     "flag": True, "note": "text", "arr": np.arange(2)},
    {"step": 2, "reward/mean": 0.5, "mismatch/k3": np.float64(1e-5), "staleness/max": np.int64(3)},
]


def _tensorboard_scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = directory.glob("events.out.tfevents.*")
    reader = EventAccumulator(str(events), size_guidance={"scalars": 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def test_jsonl_plain_values_and_null_for_non_finite(tmp_path):
    m = JsonlMonitor(tmp_path / "sub" / "metrics.jsonl")
    for r in RECORDS:
        m.log(r)
    m.close()
    lines = [json.loads(x) for x in (tmp_path / "sub" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 1, "reward/mean": 0.25, "mismatch/k3": 4.73e-4, "eval/success": None,
                        "flag": True, "note": "text", "arr": [0, 1]}
    assert lines[1]["staleness/max"] == 3


def test_tensorboard_events_read_back_by_tensorboard(tmp_path):
    m = TensorBoardMonitor(tmp_path / "tb")
    for r in RECORDS:
        m.log(r)
    m.close()
    scalars = _tensorboard_scalars(tmp_path / "tb")
    assert set(scalars) == {"reward/mean", "mismatch/k3", "eval/success", "staleness/max"}  # no step, bool, text, array
    assert scalars["reward/mean"] == [(1, 0.25), (2, 0.5)]
    (s1, v1), (s2, v2) = scalars["mismatch/k3"]
    assert (s1, s2) == (1, 2)
    np.testing.assert_allclose([v1, v2], [4.73e-4, 1e-5], rtol=2**-23)  # float32 storage
    assert [s for s, _ in scalars["eval/success"]] == [1] and math.isnan(scalars["eval/success"][0][1])


def test_the_tensorboard_monitor_does_not_import_torch_and_torch_still_imports_after_it(tmp_path):
    """A fresh process (this one may have torch loaded): a JAX run's monitor leaves torch unloaded
    (tensorboardX would import it), its events are written, and ``import torch`` works afterwards."""
    script = (
        "import sys\n"
        "from hetrl.orchestrator.monitors import TensorBoardMonitor\n"
        f"m = TensorBoardMonitor({str(tmp_path / 'tb')!r}); m.log({{'step': 1, 'loss': 0.5}}); m.close()\n"
        "print('torch loaded:', 'torch' in sys.modules)\n"
        "import torch\n"
        "print('torch imports:', torch.ones(2).sum().item())\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["torch loaded: False", "torch imports: 2.0"]
    assert _tensorboard_scalars(tmp_path / "tb") == {"loss": [(1, 0.5)]}


def test_fan_out_logs_to_all_and_closes_all_on_error(tmp_path):
    seen, closed = [], []

    class Probe:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def log(self, record):
            seen.append((self.name, record["step"]))

        def close(self):
            closed.append(self.name)
            if self.fail:
                raise OSError(f"{self.name} failed")

    m = Monitors([Probe("a", fail=True), Probe("b")])
    m.log({"step": 7})
    assert seen == [("a", 7), ("b", 7)]
    with pytest.raises(OSError, match="a failed"):
        m.close()
    assert closed == ["a", "b"]


def _config(tmp_path, *extra):
    return load_config("tiny_mixed.yaml", [f"output_dir={tmp_path}", *extra])


def test_build_monitors_default_is_jsonl_and_tensorboard(tmp_path):
    m = build_monitors(_config(tmp_path), tmp_path / "metrics.jsonl", tmp_path / "tb")
    assert [type(x).__name__ for x in m.monitors] == ["JsonlMonitor", "TensorBoardMonitor"]
    m.close()


def test_wandb_offline_writes_run_files_with_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (the optional `wandb` extra)")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = _config(tmp_path, "logging.wandb={project: hetrl-test, tags: [ci]}")
    m = build_monitors(config, tmp_path / "metrics.jsonl", tmp_path / "tb")
    (w,) = [x for x in m.monitors if isinstance(x, WandbMonitor)]
    assert w.mode == "offline"
    for r in RECORDS:
        m.log(r)
    m.close()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")  # inside output_dir, to `wandb sync` later
    (data,) = run_dir.glob("run-*.wandb")
    # the run's transaction log: the config and every logged key are in it. wandb's service process
    # may still be writing it when finish() returns (under load in CI the file held only its header)
    deadline = time.monotonic() + 60
    while b"staleness/max" not in (content := data.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"batch_groups" in content and b"max_staleness" in content  # the resolved run config
    assert b"mismatch/k3" in content and b"staleness/max" in content


def test_wandb_section_is_typed(tmp_path):
    with pytest.raises(ConfigError, match="logging.wandb"):
        _config(tmp_path, "logging.wandb={projekt: x}")


def test_wandb_missing_is_one_clear_config_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"wandb is not installed: pip install 'hetrl\[wandb\]'"):
        _config(tmp_path, "logging.wandb={project: x}")
