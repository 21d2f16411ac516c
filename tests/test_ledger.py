"""The group ledger and the task source of the loop (hetrl.orchestrator.ledger / .tasks):
every group's state in one record, outstanding work derived from it, and memory that stays
flat however many passes over the data a run makes."""

import pathlib

import numpy as np
import pytest

from hetrl.envs.tasks_synthetic import SuiteConfig, synthetic_suite
from hetrl.orchestrator.ledger import GroupLedger, GroupSpec
from hetrl.orchestrator.loop import RunResult
from hetrl.orchestrator.tasks import NoTaskFits, TaskSource

SUITE = synthetic_suite(SuiteConfig(seed=0, max_per_tier=20))


def _prompt_ids(task):
    return np.frombuffer(task.task_id.encode(), np.uint8).astype(np.int32)


def _source(seed=0):
    return TaskSource(SUITE, np.random.default_rng(seed), _prompt_ids)


def _spec(gid, task, source):
    return GroupSpec(gid, task, source.prompt(task), 0.0)


def test_transitions_and_the_outstanding_count():
    src, led = _source(), GroupLedger(pending=["old"])
    tasks = [src.next() for _ in range(5)]
    for i, t in enumerate(tasks):
        led.submit(_spec(f"g{i}", t, src))
    assert led.outstanding == 6 and [s.group_id for s in led.in_flight()] == ["g0", "g1", "g2", "g3", "g4"]
    with pytest.raises(ValueError, match="already live"):
        led.submit(_spec("g0", tasks[0], src))
    led.receive("g0")
    led.close("g1", "rejected")
    led.close("g2", "retracted")
    led.close("g3", "refused")
    assert led.spec("g1") is None and led.spec("g0") is None and led.spec("g4").task == tasks[4]
    assert led.outstanding == 3  # g4 in flight, g0 and the resumed 'old' buffered
    led.train([("g0", "p", 0), ("old", "p", 0)], 1)
    assert led.outstanding == 1 and led.trained == [("g0", "p", 0, 1), ("old", "p", 0, 1)]
    led.receive("g4")
    led.drop(["g4"])
    assert led.outstanding == 0 and led.dropped == 1
    assert led.closed == {"rejected": ["g1"], "retracted": ["g2"], "failed": [], "refused": ["g3"]}


def test_the_task_source_resolves_a_task_of_any_pass():
    src = _source()
    first = [src.next() for _ in range(len(SUITE.train))]
    later = src.next()  # pass 1 starts
    assert later.task_id.endswith("@1") and src.resolve(later.task_id) is later
    assert src.resolve(first[3].task_id) == first[3]  # pass 0 rebuilt from the suite
    with pytest.raises(KeyError):
        src.resolve("no-such-task@1")


def test_tasks_whose_prompt_does_not_fit_are_skipped_once_each_pass_and_none_fitting_is_an_error(caplog):
    lengths = sorted(len(_prompt_ids(t)) for t in SUITE.train)
    limit = lengths[len(lengths) // 2]  # about half the tasks fit
    fits = lambda prompt: prompt.shape[0] <= limit
    too_long = {t.task_id for t in SUITE.train if not fits(_prompt_ids(t))}  # of pass 0
    assert 0 < len(too_long) < len(SUITE.train)
    plain, src = _source(seed=5), TaskSource(SUITE, np.random.default_rng(5), _prompt_ids, fits)
    drawn = [src.next() for _ in range(len(SUITE.train) - len(too_long))]  # pass 0's tasks that fit
    first_pass = [plain.next().task_id for _ in range(len(SUITE.train))]
    assert [t.task_id for t in drawn] == [i for i in first_pass if i not in too_long]  # its order, overlong left out
    assert src.overlong <= too_long
    assert fits(src.prompt(src.next())) and src.passes == 2 and too_long <= src.overlong  # pass 0 used up
    assert sum("skipped" in m for m in caplog.messages) == len(src.overlong)  # one warning per task
    with pytest.raises(NoTaskFits, match="lower async.max_new_tokens"):
        TaskSource(SUITE, np.random.default_rng(0), _prompt_ids, lambda prompt: False).next()


def test_the_data_order_continues_from_its_state():
    a = _source(seed=3)
    for _ in range(len(SUITE.train) + 7):
        a.next()
    b = _source(seed=99)
    b.restore(a.state())
    assert [b.next().task_id for _ in range(20)] == [a.next().task_id for _ in range(20)]


def test_memory_stays_flat_over_many_passes():
    """The loop's pattern, driven for ten passes: keep ``target`` groups live; each finished
    group is trained, rejected, retracted (its task submitted again), or evicted as stale and
    regenerated from its task id, possibly a task of an earlier pass."""
    rng = np.random.default_rng(0)
    src, led, target = _source(), GroupLedger(), 8
    gid, held, buffered, regen = 0, [], [], []

    def submit(task):
        nonlocal gid
        led.submit(_spec(f"g{gid:06d}", task, src))
        gid += 1

    while src.passes <= 10:
        while led.outstanding < target:
            submit(src.resolve(regen.pop()) if regen else src.next())
        spec = led.in_flight()[0]
        fate = rng.choice(["train", "reject", "retract", "stale"], p=[0.6, 0.1, 0.1, 0.2])
        if fate in ("reject", "retract"):
            led.close(spec.group_id, "rejected" if fate == "reject" else "retracted")
            if fate == "retract":
                submit(spec.task)
            continue
        led.receive(spec.group_id)
        buffered.append((spec.group_id, spec.task.task_id))
        if fate == "stale":  # held a while, then evicted: its prompt regenerated under a new id
            old, task_id = buffered.pop(0)
            led.drop([old])
            regen.append(task_id)
        elif len(buffered) >= 2:
            led.train([(g, "p", 0) for g, _ in buffered], 1)
            buffered.clear()
        held.append((src.passes, led.outstanding, len(led.in_flight()), src.held()))
    per_pass = len(SUITE.train)
    assert gid > 10 * per_pass  # ten passes of groups went through
    assert max(h[1] for h in held) <= target + 1 and max(h[2] for h in held) <= target + 1
    assert max(h[3] for h in held) <= 3 * per_pass  # the current pass, its prompts, one other pass
    late = [h[3] for h in held if h[0] >= 9]
    early = [h[3] for h in held if h[0] == 2]
    assert max(late) <= max(early) + per_pass  # no growth with the passes
    # and the outcome lists still balance (the RunResult audit)
    result = RunResult([], {"groups_dropped": led.dropped, "groups_pending": len(buffered)}, led.trained,
                       led.received, led.submitted, led.closed["retracted"], {}, {}, [], *[pathlib.Path(".")] * 3, [],
                       pathlib.Path("."), rejected=led.closed["rejected"], unfinished=[s.group_id for s in led.in_flight()])
    audit = result.audit()
    assert audit["lost"] == [] and audit["duplicated"] == [] and audit["unaccounted"] == 0, audit
