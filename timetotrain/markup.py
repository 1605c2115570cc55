"""Values from logs and file names, escaped for the text formats ttt writes around them, so a value is
always shown as the text it is and never read as markup:

- `md`: Markdown (summary.md, a package's README): the characters that start emphasis, code, links,
  images, tables, HTML, headings, math or a bare-URL link are backslash-escaped, line breaks become
  spaces;
- `plotly`: Plotly labels (trace names, category ticks, titles), which Plotly reads as its own
  pseudo-HTML (`<a href>`, `<b>`, `<br>`, entities): `&`, `<` and `>` become entities it shows as text;
- `mpl`: Matplotlib labels, where a pair of `$` starts mathtext (and a bad formula fails the plot).
"""

from __future__ import annotations

import html
import re

# CommonMark lets any ASCII punctuation be backslash-escaped; these are the ones that can change what a
# line renders as. `_` only emphasises at a word boundary, so `llama31_8b` keeps its plain underscore.
_MD_ALWAYS = re.compile(r"([\\`*\[\]<>|~!#&$])")
_MD_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
# At the start of a value (a list item's text, a heading's): what would open a nested list.
_MD_LEADING = re.compile(r"^([-+=]|\d+(?=[.)](\s|$)))")
# GitHub turns bare `http://...` and `www....` into links: a backslash in them stops it.
_MD_AUTOLINK = re.compile(r"(?<=[A-Za-z])(:)(?=//)|(?<=\bwww)(\.)", re.IGNORECASE)


def md(value) -> str:
    text = " ".join(str(value).splitlines())
    text = _MD_ALWAYS.sub(r"\\\1", text)
    text = _MD_UNDERSCORE.sub(r"\\_", text)
    text = _MD_AUTOLINK.sub(lambda m: "\\" + m.group(0), text)
    return _MD_LEADING.sub(
        lambda m: m.group(1) + "\\" if m.group(1)[0].isdigit() else "\\" + m.group(1), text
    )


def plotly(value) -> str:
    return html.escape(str(value), quote=False)


def mpl(value) -> str:
    return str(value).replace("$", r"\$")
