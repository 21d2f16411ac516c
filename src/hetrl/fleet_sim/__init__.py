"""``hetrl fleet``: a discrete-event simulator of the asynchronous loop at cluster scale
(:mod:`~hetrl.fleet_sim.engine`, configured by :mod:`~hetrl.fleet_sim.config`, reported by
:mod:`~hetrl.fleet_sim.report`) and a fleet planner on top of it (:mod:`~hetrl.fleet_sim.plan`)."""
