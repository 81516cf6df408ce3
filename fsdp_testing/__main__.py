"""``python -m fsdp_testing``: the ``fsdp-testing`` command line."""

import sys

from fsdp_testing.cli import main

if __name__ == "__main__":
    sys.exit(main())
