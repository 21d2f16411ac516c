"""``hetrl experiment``: the grid of DESIGN §6 on the tiny CPU setup, with a report.

One module per job: :mod:`~hetrl.experiment.config` (the typed grid: arms x seeds, analyses
E1..E4, the any-mixture sweep, the quick scale), :mod:`~hetrl.experiment.fleets` (random
fleets from the accelerator catalogue), :mod:`~hetrl.experiment.plan` (the validated runs),
:mod:`~hetrl.experiment.runner` (``hetrl train`` subprocesses, resumable, in parallel),
:mod:`~hetrl.experiment.measures` (per-run values from ``metrics.jsonl``),
:mod:`~hetrl.experiment.statistics` (intervals over seeds), :mod:`~hetrl.experiment.claims`
(the public claims and their verdicts), :mod:`~hetrl.experiment.plots` and
:mod:`~hetrl.experiment.report` (``REPORT.md``); :mod:`~hetrl.experiment.command` is the CLI.
"""
