"""Task environments (DESIGN §1): the multi-turn interface (:mod:`hetrl.envs.base`), the code
sandbox (:mod:`hetrl.envs.sandbox`), the agentic coding environment (:mod:`hetrl.envs.coding`)
and its task families (:mod:`hetrl.envs.tasks_synthetic`, :mod:`hetrl.envs.tasks_realcode`).
"""
