"""The names of the generated tasks (``experiments.tasks.ruler`` builds them).

Kept apart from the generator so that a config can be checked against them before anything
heavy loads (``config_check``), without ``experiments/common`` importing the task layer above
it. The order is part of every sample's seed (``ruler.generate``): append, never reorder.
"""

TASKS = ("passkey", "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
         "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe",
         "fwe", "qa", "qa_multi")
