"""The exceptions the CLI turns into a single line: UserError (exit 2) and Interrupted (exit 128 + signum)."""

import contextlib
import signal


class UserError(Exception):
    """Bad input or environment: the message names the file or flag and the fix, on one line."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT stopped a command that cleans up on the way out (`ttt data prepare`); the CLI
    exits with 128 + signum. A KeyboardInterrupt, so `except Exception` cleanup code never swallows it.
    `outcome` is what the signal left, for the CLI's one line (None: the CLI says it from what was
    committed, see cli/__init__.py)."""

    def __init__(self, signum: int, outcome: str | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.outcome = outcome


@contextlib.contextmanager
def writing(flag: str, path):
    """Around a command's writes whose outputs appear together or not at all (fileio.Staged, atomic_write):
    an OSError there (a full disk, a quota, a read-only or missing folder) becomes one UserError line naming
    the flag and the file, instead of a traceback."""
    try:
        yield
    except OSError as e:
        where = f" writing {e.filename}" if e.filename and str(e.filename) != str(path) else ""
        raise UserError(
            f"{flag} {path}: {e.strerror or e}{where}; nothing was written: free space or pass a writable folder"
        ) from None
