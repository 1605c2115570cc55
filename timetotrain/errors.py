"""The one exception type the CLI turns into a single line and a non-zero exit."""


class UserError(Exception):
    """Bad input or environment: the message names the file or flag and the fix, on one line."""
