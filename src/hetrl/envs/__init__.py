"""Task environments (DESIGN §1): the multi-turn interface (:mod:`hetrl.envs.base`), the code
sandbox (:mod:`hetrl.envs.sandbox`), the agentic coding environment (:mod:`hetrl.envs.coding`),
its grading outside the sandbox (:mod:`hetrl.envs.typed`, :mod:`hetrl.envs.trusted_check`), its
task families (:mod:`hetrl.envs.tasks_synthetic`, :mod:`hetrl.envs.tasks_realcode`) and task sets
from files (:mod:`hetrl.envs.task_files`), and tool-using repository episodes (:mod:`hetrl.envs.agent`).
"""
