"""How the plugin fits with the plugins a CI already runs: coverage on the ranks
(``rank_coverage``), one timeout story with pytest-timeout and ``faulthandler_timeout``
(``timeouts``), post-mortems on a rank's own frames (``debugging``) and per-rank seeds under
pytest-randomly (``seeds``). Each module is imported only where its plugin is active, and none
imports torch. See docs/pytest-api.md, "With other plugins".
"""
