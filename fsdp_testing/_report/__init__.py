"""From what the ranks did to what pytest reports.

- ``observation.py``: what a launcher saw of one task (the verdict's input).
- ``verdict.py``: one outcome for the test from every rank's result; the failure report.
- ``hang_report.py``: the report of a test that timed out (divergence, stacks).
- ``collective_log.py``: the per-rank log of collectives, readable while a rank is blocked.
- ``divergence.py``: where the ranks' collective logs diverge.
- ``text.py``: phrases every report shares.
"""
