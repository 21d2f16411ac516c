"""The asynchronous loop (DESIGN §5): samplers generate continuously, finished groups enter the
staleness-bounded buffer, the trainer steps as soon as a batch is ready and publishes weights.

:mod:`hetrl.orchestrator.loop` is the loop, shared by the backends; :mod:`hetrl.orchestrator.local`
runs samplers and trainer in one process (threads), :mod:`hetrl.orchestrator.ray_backend` in Ray
actors (the route to many machines); :func:`build_orchestrator` picks one from
``config.backend``. :mod:`hetrl.orchestrator.episodes` turns tasks and generations into validated
rollouts; :mod:`hetrl.orchestrator.monitors` writes metric records (JSON lines, TensorBoard
events, optionally W&B) and :mod:`hetrl.orchestrator.report` the console, plots and summary. The loop's parts:
:mod:`~hetrl.orchestrator.ledger` (every group's state), :mod:`~hetrl.orchestrator.tasks` (the
train tasks in passes), :mod:`~hetrl.orchestrator.schedule` (async or lockstep generation),
:mod:`~hetrl.orchestrator.supervisor` (replica health, restarts, quarantine and aborts) and
:mod:`~hetrl.orchestrator.trainer_handle` (the trainer as the loop sees it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetrl.config import RunConfig
    from hetrl.orchestrator.loop import AsyncOrchestrator

__all__ = ["build_orchestrator"]


def build_orchestrator(config: "RunConfig", **kwargs: Any) -> "AsyncOrchestrator":
    """The orchestrator of ``config.backend`` (``local`` or ``ray``) for ``config``; ``kwargs``
    go to its constructor. Only the chosen backend's module (and framework) is imported."""
    if config.backend == "ray":
        from hetrl.orchestrator.ray_backend import RayOrchestrator

        return RayOrchestrator(config, **kwargs)
    from hetrl.orchestrator.local import LocalOrchestrator

    return LocalOrchestrator(config, **kwargs)
