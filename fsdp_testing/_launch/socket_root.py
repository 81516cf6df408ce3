"""A launcher's private folder: its logs, its generations and its control socket."""

from __future__ import annotations

import os
import sys
import tempfile

# sun_path holds 108 bytes on Linux (104 on macOS), the terminating NUL included.
_SUN_PATH_MAX = 107 if sys.platform.startswith("linux") else 103
_SHORT_BASES = ("/tmp", "/dev/shm", "/var/tmp")
_SOCKET = "ctl.sock"


def socket_root(prefix: str) -> tuple[str, str]:
    """A new private folder (mode 0700) for a launcher's logs, and its control socket's address
    in it: ``(folder, address)``.

    The folder is made in the temporary directory unless that is too deep for an AF_UNIX
    address (a job's scratch folder, a test's ``tmp_path``): then in the first of /tmp, /dev/shm
    and /var/tmp where the address fits."""
    suffix = "x" * 8  # what mkdtemp appends
    for base in (tempfile.gettempdir(), *_SHORT_BASES):
        address = os.path.join(base, prefix + suffix, _SOCKET)
        if len(os.fsencode(address)) <= _SUN_PATH_MAX and os.access(base, os.W_OK | os.X_OK):
            root = tempfile.mkdtemp(prefix=prefix, dir=base)
            return root, os.path.join(root, _SOCKET)
    raise RuntimeError(
        f"fsdp_testing: the temporary directory {tempfile.gettempdir()!r} is too deep for a "
        f"socket's address ({_SUN_PATH_MAX} bytes at most) and none of {', '.join(_SHORT_BASES)} "
        "is writable: set TMPDIR to a shorter folder"
    )
