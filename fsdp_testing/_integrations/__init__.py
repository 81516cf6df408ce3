"""How the plugin fits with the plugins a CI already runs: coverage on the ranks
(``rank_coverage``), one timeout story with pytest-timeout and ``faulthandler_timeout``
(``timeouts``), post-mortems on a rank's own frames and ``breakpoint()`` on a rank
(``debugging``), per-rank seeds under pytest-randomly (``seeds``) and each rank's ending as a
report property for ``--junitxml`` (``rank_properties``). None imports torch; the rank side of
each (what ``run_task`` and a rank process call) does nothing unless its plugin is active. See
docs/pytest-api.md, "With other plugins".
"""
