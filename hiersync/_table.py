"""Every table hiersync prints (plan, project, calibrate, bench, check, collbench, the benchmarks'
reports): one layout, tabulate's.

The callers format their own cells (units, digits, "-" for a missing number); this lays them out,
as plain text with columns two spaces apart or as a markdown pipe table. It sits beside the
runtime core, not in :mod:`hiersync.tools`, so that the pure cost model (``plan``, ``project``)
may use it too (the cost model never imports the tools).
"""

from __future__ import annotations

from collections.abc import Sequence

from tabulate import tabulate

__all__ = ["render"]


def render(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    align: str = "lr",
    markdown: bool = False,
    indent: str = "",
) -> str:
    """``rows`` under ``headers``, plain text or (``markdown``) a pipe table whose separator says the alignment.

    ``align``: one ``"l"`` or ``"r"`` per column, its last letter repeated for the columns after it
    (``"lr"``: a name, then numbers; ``"llr"``: two names, then numbers). Cells are printed as
    given: tabulate's number parsing is off (it would print "0.100" as "0.1"). A short row is
    padded with empty cells. ``indent`` starts every line of a plain-text table (a table under a heading).
    """
    if not align or set(align) - {"l", "r"}:
        raise ValueError(f"align={align!r}: one 'l' or 'r' per column (the last one repeats)")
    n = len(headers)
    colalign = ["left" if a == "l" else "right" for a in (align + align[-1] * n)[:n]]
    cells = [list(r) + [""] * (n - len(r)) for r in rows]
    if markdown:
        return tabulate(cells, headers=list(headers), tablefmt="pipe", colalign=colalign, disable_numparse=True)
    # the headers as the first row: tabulate widens a headed column to its header + 2 (MIN_PADDING),
    # which would double the two spaces between columns
    text = tabulate([list(headers), *cells], tablefmt="plain", colalign=colalign, disable_numparse=True)
    return "\n".join(indent + line.rstrip() for line in text.splitlines())
