"""Shared by the orchestrator tests of every backend: the invariants a finished run must
satisfy (the fault-injecting sampler wrappers are :mod:`hetrl.samplers.faults`)."""

import json

import numpy as np

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def check_outputs(result, steps: int, eval_steps: list[int]) -> None:
    """Every step logged to the JSONL and, as the same float32 scalars, to the TensorBoard events;
    held-out scores at ``eval_steps`` (0: the starting policy, before the first step); a
    checkpoint with its buffer snapshot at the end; plots and summary written."""
    assert result.final["version"] == steps
    assert [r["step"] for r in result.history] == ([0] if 0 in eval_steps else []) + list(range(1, steps + 1))
    lines = [json.loads(x) for x in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [r["step"] for r in result.history]
    assert all("mismatch/k3" in r and "reward/mean" in r and "staleness/max" in r for r in lines if r["step"])
    assert [r["step"] for r in lines if "eval/success" in r] == eval_steps
    (events,) = result.tensorboard_dir.glob("events.out.tfevents.*")
    reader = EventAccumulator(str(events), size_guidance={"scalars": 0})  # TensorBoard's own reader, all events
    reader.Reload()
    scalars = {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}
    for key in ("reward/mean", "mismatch/k3", "staleness/max", "eval/success"):
        # the JSONL writes a non-finite value as null, TensorBoard keeps it
        expected = [(r["step"], float("nan") if r[key] is None else r[key]) for r in lines if key in r]
        assert [s for s, _ in scalars[key]] == [s for s, _ in expected], key
        # float32 storage: a relative error of at most 2^-24
        np.testing.assert_allclose([v for _, v in scalars[key]], [v for _, v in expected], rtol=2**-23)
    assert result.checkpoint_steps and result.checkpoint_steps[-1] == steps
    for step in result.checkpoint_steps:
        snap = json.loads((result.checkpoint_dir / f"buffer-{step}.json").read_text())
        assert snap["version"] == 1
    assert {p.name for p in result.plots} == {"reward.png", "heldout.png", "mismatch.png"}
    assert all(p.stat().st_size > 1000 for p in result.plots)
    assert json.loads((result.output_dir / "summary.json").read_text())["version"] == steps


def check_monotone_versions(result) -> None:
    """Per replica, first-token weight versions never decrease, and new weights reached the fleet."""
    assert result.rollout_versions
    for key, versions in result.rollout_versions.items():
        assert versions == sorted(versions), key
    assert max(max(v) for v in result.rollout_versions.values()) >= 1


def check_staleness(result, max_staleness: int) -> None:
    """No trained group is older than ``max_staleness`` versions."""
    assert result.trained
    assert all(trainer_v - min_v <= max_staleness for _, _, min_v, trainer_v in result.trained)
    assert result.final["max_staleness"] <= max_staleness


def check_requeued_exactly_once(result, lost_groups: set[str], dead_replica: str) -> None:
    """The groups a dead replica held were finished elsewhere (buffered, or rejected at admission
    when a poisoned pool got them); nothing was buffered or trained twice."""
    assert lost_groups, "the killed replica never held work"
    assert result.final["requeues"] >= 1
    assert lost_groups <= set(result.received) | set(result.rejected)
    assert not set(result.received) & set(result.rejected)
    ids = [g for g, *_ in result.trained]
    assert len(ids) == len(set(ids))
    assert len(result.received) == len(set(result.received))
    assert set(ids) <= set(result.received) <= set(result.submitted)
    assert dead_replica not in result.rollout_versions
