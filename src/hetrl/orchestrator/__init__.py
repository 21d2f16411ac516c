"""The asynchronous loop (DESIGN §5): samplers generate continuously, finished groups enter the
staleness-bounded buffer, the trainer steps as soon as a batch is ready and publishes weights.

:mod:`hetrl.orchestrator.local` is the LOCAL backend (threads in one process);
:mod:`hetrl.orchestrator.episodes` turns tasks and generations into validated rollouts;
:mod:`hetrl.orchestrator.report` writes metrics, the live display and plots. A Ray backend
(pools and trainer as actors, for many machines) is not implemented yet.
"""

from hetrl.orchestrator.local import LocalOrchestrator, RunResult, run_local

__all__ = ["LocalOrchestrator", "RunResult", "run_local"]
