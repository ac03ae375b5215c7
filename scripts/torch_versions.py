"""Record one suite run on a torch minor in docs/torch-versions.md (``make test-torch`` calls it).

    python scripts/torch_versions.py record --junit .cache/torch-2.10.0/junit.xml --torch-npu 2.10.0.post4

The run's row (date, commit, torch, torch_npu, passed / failed / skipped, wall time) replaces the row of
the same torch between the file's result markers; the skip reasons and failed tests follow the table.
Run it with the venv's python: the torch it imports is the one the suite ran on.
"""

import argparse
import datetime
import re
import subprocess
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "torch-versions.md"
BEGIN, END = "<!-- results: scripts/torch_versions.py writes this part -->", "<!-- /results -->"
HEADER = ("| torch | torch_npu | date | commit | passed | failed | skipped | wall |\n"
          "|---|---|---|---|---|---|---|---|")


def outcome(junit: Path) -> dict:
    root = ET.parse(junit).getroot()
    seconds = sum(float(suite.get("time", 0)) for suite in root.iter("testsuite"))
    failed, skipped, passed = [], Counter(), 0
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif (skip := case.find("skipped")) is not None:
            reason = re.search(r"Skipped: (.*?)'?\)?$", (skip.text or "").strip())  # a module skipped at collection
            skipped[reason.group(1) if reason else (skip.get("message") or "").strip()] += 1
        else:
            passed += 1
    return {"passed": passed, "failed": failed, "skipped": skipped, "seconds": seconds}


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            f":!{DOC.relative_to(REPO)}"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


def row(torch_version: str, torch_npu: str, result: dict) -> tuple:
    """(the table row, the notes under it) of one run."""
    line = (f"| {torch_version} | {torch_npu} | {datetime.date.today().isoformat()} | {commit()} | "
            f"{result['passed']} | {len(result['failed'])} | {sum(result['skipped'].values())} | "
            f"{result['seconds'] / 60:.0f} min |")
    notes = [f"- torch {torch_version}, skipped: {n} x {why or 'no reason given'}"
             for why, n in sorted(result["skipped"].items())]
    notes += [f"- torch {torch_version}, failed: `{name}`" for name in result["failed"]]
    return line, notes


def record(torch_version: str, torch_npu: str, result: dict) -> None:
    text = DOC.read_text()
    head, rest = text.split(BEGIN)
    body, tail = rest.split(END)
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| (\d[^ |]*) \|.*$", body, re.M)}
    notes = [n for n in re.findall(r"^- torch .*$", body, re.M) if not n.startswith(f"- torch {torch_version},")]
    rows[torch_version], new_notes = row(torch_version, torch_npu, result)
    ordered = sorted(rows, key=lambda v: tuple(int(p) for p in re.findall(r"\d+", v)))
    notes = sorted(notes + new_notes, key=lambda n: tuple(int(p) for p in re.findall(r"\d+", n.split(",")[0])))
    table = "\n".join([HEADER, *(rows[v] for v in ordered)])
    DOC.write_text(f"{head}{BEGIN}\n{table}\n\n" + ("\n".join(notes) + "\n" if notes else "") + f"{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="write one run's row")
    rec.add_argument("--junit", type=Path, required=True, help="pytest's --junitxml file of the run")
    rec.add_argument("--torch-npu", required=True, help="the torch_npu the offline GE tests used")
    args = parser.parse_args()
    import torch

    record(torch.__version__.split("+")[0], args.torch_npu, outcome(args.junit))
    print(f"recorded torch {torch.__version__} in {DOC.relative_to(REPO)}")


if __name__ == "__main__":
    main()
