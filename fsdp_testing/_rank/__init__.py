"""What runs on a rank, whatever launched it.

- ``run_task.py``: run one test on this rank and classify how it ended.
- ``context.py``: the values of the rank fixtures.
- ``capture.py``: per-rank capture of what the test prints.
- ``state_reset.py``: per-test state reset on a warm rank.
- ``resolve.py``: importing the test function in a rank process (asserts rewritten).
- ``skips.py``: torch's ``TEST_SKIPS`` exit codes.
"""
