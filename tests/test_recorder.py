"""The step recorder: a step's per-pool figures travel typed (PoolStep) to the console and the
fleet's averages, while the flat record the monitors write keeps the run's metric names.

Real fleet (test-double samplers), real buffer, real mismatch metrics; the monitors and the
console are stand-ins that keep what they are given (the recorder is under test)."""

import numpy as np

from factories import random_rollout
from hetrl.core.buffer import RolloutBuffer, RolloutGroup
from hetrl.core.correction import TokenStats, mismatch_metrics
from hetrl.core.schema import collate
from hetrl.orchestrator.recorder import StepRecorder
from hetrl.samplers.base import SamplerHealth
from hetrl.samplers.fleet import Fleet, PoolConfig

POOLS = (PoolConfig(name="b200-bf16", accelerator="b200", weight_precision="bf16", replicas=2),
         PoolConfig(name="l40s-fp8", accelerator="l40s", weight_precision="fp8_e4m3"))
NAMES = tuple(p.name for p in POOLS)


class Idle:
    def __init__(self, pool):
        self.info = pool.numerics().sampler_info(pool.name, pool.engine, "fake")

    def health(self):
        return SamplerHealth(healthy=True, weight_version=0)


class Kept:
    """Keeps what it is given (a monitor and a console)."""

    def __init__(self):
        self.logged, self.shown = [], []

    def log(self, record):
        self.logged.append(dict(record))

    def step(self, record, pools):
        self.shown.append((dict(record), pools))


def _groups(rng):
    """Three groups of two rollouts, two from the first pool and one from the second."""
    out = []
    for i, pool in enumerate((NAMES[0], NAMES[1], NAMES[0])):
        rollouts = tuple(random_rollout(rng, vocab=40, response_len=5, pool=pool, version=0, group_id=f"g{i}",
                                        rollout_id=f"g{i}/{j}")[0] for j in range(2))
        out.append(RolloutGroup(f"g{i}", f"t{i}", rollouts))
    return out


def _metrics(batch, rng):
    B, L = batch.loss_mask.shape
    d = rng.normal(size=(B, L)) * 0.3
    ones = np.ones((B, L))
    stats = TokenStats(logp=-ones, log_ratio=d, weight=np.exp(d), token_keep=batch.loss_mask,
                       sequence_keep=np.ones(B, bool), veto_keep=np.ones(B, bool), support_size=ones,
                       sampler_head_mass=ones, train_head_mass=ones)
    return {"loss": 0.5, **{k: float(v) for k, v in
                            mismatch_metrics(stats, batch.loss_mask, batch.pool_index, batch.pool_names).items()}}


def test_a_step_is_recorded_flat_for_the_monitors_and_typed_per_pool_for_the_console():
    rng = np.random.default_rng(0)
    fleet = Fleet([(p, Idle(p)) for p in POOLS for _ in range(p.replicas)])
    buffer = RolloutBuffer(max_staleness=2)
    groups = _groups(rng)
    for g in groups:
        assert buffer.put(g)
    taken = buffer.take(3, trainer_version=1)
    batch = collate([r for g in taken for r in g.rollouts], pool_names=NAMES)
    sink, console = Kept(), Kept()
    recorder = StepRecorder(fleet, buffer, sources=[lambda: {"admission/admitted": 6.0}], monitors=sink,
                            display=console, total_steps=3, log_every=2)
    steps = []
    for step in (2, 3):
        metrics = _metrics(batch, rng)
        steps.append(metrics)
        record = recorder.record(step, trained_at=1, groups=taken, batch=batch, metrics=metrics, wait_s=0.1,
                                 step_s=0.2, counts={"groups_trained": 3, "retracted": 1})
        recorder.commit(record)
    # the flat record keeps the run's names: the trainer's per-pool keys as given, the loop's own
    flat = record.scalars
    for k, v in steps[-1].items():
        assert flat[k] == v
    assert flat["batch/pool/b200-bf16/groups"] == 2 and flat["batch/pool/l40s-fp8/groups"] == 1
    assert flat["rollout/retracted"] == 1 and flat["admission/admitted"] == 6 and flat["staleness/max"] == 1
    assert flat[f"pool/{NAMES[0]}/buffer/groups_out"] == 2 and "fleet/tokens" in flat
    # typed per pool: the step's mismatch of that pool, and the fleet's token-weighted run averages
    first, second = record.pools
    assert (first.pool, first.batch_groups, second.batch_groups) == (NAMES[0], 2, 1)
    for p in record.pools:
        assert p.mismatch["k3"] == steps[-1][f"pool/{p.pool}/mismatch/k3"]
        n = [s[f"pool/{p.pool}/mismatch/num_tokens"] for s in steps]
        k3 = [s[f"pool/{p.pool}/mismatch/k3"] for s in steps]
        assert np.isclose(p.figures.mismatch_avg["k3"], np.dot(n, k3) / sum(n))
        assert fleet.metrics()[f"pool/{p.pool}/mismatch_avg/k3"] == p.figures.mismatch_avg["k3"]
    assert first.buffer.groups_out == 2 and first.figures.replicas == 2
    # logged at every 2nd step and at the last; shown at every step, pools as rows
    assert [r["step"] for r in sink.logged] == [2, 3] and [r["step"] for r in recorder.history] == [2, 3]
    shown_record, rows = console.shown[-1]
    assert shown_record == flat
    assert [r["pool"] for r in rows] == list(NAMES) and rows[0]["alive"] == "2/2"
    assert rows[1]["k3"] == second.figures.mismatch_avg["k3"] and rows[0]["numerics"] == "b200 bf16/bf16"
    fleet.quarantine(NAMES[1], "too many rejections")
    record = recorder.record(4, trained_at=3, groups=taken, batch=batch, metrics=_metrics(batch, rng), wait_s=0.0,
                             step_s=0.0, counts={})
    assert record.pools[1].row()["alive"] == "quarantined"
