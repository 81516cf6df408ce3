"""Launch strategies: how the ranks of one test are started and waited for.

- ``spec.py``: the ``distributed`` marker's arguments (torch-free: read at collection).
- ``base.py``: the :class:`Launcher` protocol every strategy implements.
- ``deadline.py``: the one timeout / failure-grace rule all strategies wait by.
- ``pool.py``: process mode, parent side: the warm pool of rank processes.
- ``fork_server.py``: the process that imports torch once and forks rank processes.
- ``rank_process.py``: the main loop of one rank process (join the group, serve tasks).
- ``threads.py``: thread mode and fake mode, in this process.
- ``torchrun.py``: tests run in place when pytest is itself a rank of a torchrun job.

The public entry point is :mod:`fsdp_testing.launcher`.
"""
