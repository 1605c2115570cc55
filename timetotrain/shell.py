"""Writing shell scripts from values ttt did not choose (log fields, paths, names).

Every value written into a generated script goes through `quote`, so nothing a log holds (`$(...)`,
backticks, `;`, newlines) is ever read by the shell as code; `Var` marks the few words that are meant
to expand (a variable the script itself sets), `line` joins a command from both, and `comment` writes
text a reader sees after `#` on one line."""

from __future__ import annotations

import shlex
from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    """A reference to a shell variable of the script, written as "$NAME" (expanded, one word)."""

    name: str

    def __post_init__(self):
        if not self.name.isidentifier() or not self.name.isascii():
            raise ValueError(f"not a shell variable name: {self.name!r}")


def quote(value) -> str:
    """`value` as one literal shell word: the one quoting helper of every generated script."""
    return shlex.quote(str(value))


def line(words) -> str:
    """A command line from literal values (quoted) and `Var`s (expanded in double quotes)."""
    return " ".join(f'"${w.name}"' if isinstance(w, Var) else quote(w) for w in words)


def comment(text) -> str:
    """`# text`, with line breaks and other control characters shown as spaces, so the text cannot end
    the comment and start a command on the next line."""
    return "# " + "".join(c if c.isprintable() else " " for c in str(text))
