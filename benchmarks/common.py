"""Shared helpers: timing side by side, and writing results with their command."""

import datetime
import json
import platform
import sys
from pathlib import Path

import torch


RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, rows: list, notes: str, markdown: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
    }
    (RESULTS / f"{name}.json").write_text(json.dumps({**meta, "notes": notes, "rows": rows}, indent=2))
    header = "\n".join(f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in meta.items())
    path = RESULTS / f"{name}.md"
    path.write_text(f"# {name}\n\n{header}\n\n{notes}\n\n{markdown}\n")
    return path


def table(rows: list, columns: list) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row[c]) for c in columns) + " |")
    return "\n".join(lines)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
