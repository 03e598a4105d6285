"""The files of ``python -m hiersync bench``: bench.json (raw), bench.csv, bench.md and the plots.

Every file is written atomically (a failed write leaves the previous one intact). The rows
come from :mod:`.bench_rows`, the table from :mod:`.bench_table`, the claims from
:mod:`.bench_claims`, the cost model's table from :mod:`.bench_model`, the plots from
:mod:`.bench_plots`.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from pathlib import Path

from hiersync._io import atomic_write_bytes, atomic_write_json, atomic_write_text

from .bench_claims import check_claims, format_claims, format_peer_ratios, peer_ratios
from .bench_model import format_comparison, format_model_targets
from .bench_plots import plots as make_plots
from .bench_table import format_table

__all__ = ["write_outputs"]


def write_outputs(results_dir: str | os.PathLike, raw: dict, rows: Sequence[dict], plots: bool = True) -> list[Path]:
    """Write bench.json (raw), bench.csv, bench.md and the PNG plots atomically; return the paths."""
    d = Path(results_dir)
    paths = [atomic_write_json(d / "bench.json", {**raw, "rows": list(rows)})]
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    paths.append(atomic_write_text(d / "bench.csv", buf.getvalue()))
    md = [
        "# hiersync bench",
        "",
        f"`{raw['command']}`",
        "",
        raw["testbed"]["describe"],
        "",
        format_table(rows, markdown=True),
    ]
    options = raw.get("torchft_options") or []
    if options:
        md += ["```", *options, "```", ""]
    ratios = format_peer_ratios(peer_ratios(rows))
    if ratios:
        md += ["```", ratios, "```", ""]
    claims = check_claims(rows, environment=raw.get("environment"))
    if claims:
        md += ["", "```", format_claims(claims), "```", ""]
    model = raw.get("model") or {}
    if model.get("entries"):
        md += ["", "```", format_comparison(model["entries"], model["source"])]
        if model.get("targets"):
            md.append(format_model_targets(model["targets"]))
        md += ["```", ""]
    paths.append(atomic_write_text(d / "bench.md", "\n".join(md)))
    if plots and rows:
        for name, data in make_plots(rows).items():
            paths.append(atomic_write_bytes(d / name, data))
    return paths
