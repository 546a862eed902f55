"""The Today tables of docs/benchmarks.md from a results folder the GPU suite wrote: one table per
machine and revision that measured (one table for a suite run on one host), one number per cell,
the peer of the same run beside it, and on every row a link to the stage file that holds it.

    python -m benchmarks.gpu_suite --out docs/results/DATE_GPU --report --docs

A row is only as current as the run that measured it, so each stage's machine and revision are
recorded when it runs (`measured.json` in the results folder, written by `record_measured`);
stages run apart may meet different hosts or revisions, and then get tables of their own. A
results folder from before that record takes every stage's from `stage_env.json`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.suite.rows import Row

BEGIN, END = "<!-- scoreboard:present -->", "<!-- /scoreboard:present -->"
COLUMNS = ("benchmark", "pagedserve", "peer, same run", "target", "verdict", "raw output")
MEASURED_FILE = "measured.json"


@dataclass(frozen=True, slots=True)
class Measured:
    """Where, at which revision and on which day one stage's numbers were taken."""

    machine: str  # "1 x NVIDIA H100 80GB HBM3": how many GPUs of which name
    revision: str  # the pagedserve revision the stage ran (`git rev-parse --short HEAD`)
    date: str  # YYYY-MM-DD


@dataclass(frozen=True, slots=True)
class Section:
    """The rows whose numbers one stage's file holds."""

    stage: str  # the stage name: its numbers are in OUT/stage_<stage>.json
    rows: tuple[Row, ...]
    peers_from: str | None = None  # the stage whose file holds the rows' peers, if another one


def measured_from_env(env: dict[str, Any] | None) -> Measured:
    """The machine, revision and date an env stage recorded. Pure."""
    env = env or {}
    gpu = env.get("gpu")
    smi_lines = [line for line in str(env.get("nvidia_smi") or "").splitlines() if line.strip()]
    machine = f"{max(len(smi_lines), 1)} x {gpu}" if gpu else "machine not recorded"
    revision = str(env.get("pagedserve_revision") or "unrecorded")
    return Measured(machine, revision, str(env.get("date") or "date not recorded"))


def read_measured(out: Path) -> dict[str, Measured]:
    """Each stage's `Measured` from OUT/measured.json; stages without an entry there (a folder
    written before the record existed) get the env stage's, under the key "*"."""
    path = out / MEASURED_FILE
    recorded = json.loads(path.read_text()) if path.is_file() else {}
    env_path = out / "stage_env.json"
    found = {"*": measured_from_env(json.loads(env_path.read_text()) if env_path.is_file() else None)}
    found.update({stage: Measured(**fields) for stage, fields in recorded.items()})
    return found


def record_measured(out: Path, stage: str, measured: Measured) -> None:
    """Add (or replace) `stage`'s entry in OUT/measured.json, keeping the other stages'."""
    path = out / MEASURED_FILE
    recorded = json.loads(path.read_text()) if path.is_file() else {}
    recorded[stage] = asdict(measured)
    path.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def today_block(sections: Sequence[Section], stages_found: Sequence[str], out: Path, doc: Path) -> str:
    """The markdown between the Today markers of `doc` for the results in `out`: the measured rows
    of every stage whose file is in `out` (`stages_found`), grouped by `Measured`, links relative
    to `doc`'s folder. Raises ValueError when `out` is not inside that folder (the links would
    leave the repository's docs)."""
    out, base = out.resolve(), doc.resolve().parent
    if not out.is_relative_to(base):
        raise ValueError(
            f"{out} is not inside {base}: the Today table links each row to its file there; "
            "write the results under docs/results/ (or copy them there) and run again"
        )
    measured = read_measured(out)

    def where(stage: str) -> Measured:
        return measured.get(stage, measured["*"])

    def link(path: Path) -> str:
        return f"[{path.name}]({Path(os.path.relpath(path, base)).as_posix()})"

    groups: dict[Measured, list[tuple[str, str]]] = {}  # Measured -> [(stage, table line)]
    shown = set()
    for section in sections:
        if section.stage not in stages_found:
            continue
        here = where(section.stage)
        for row in section.rows:
            if row.verdict == "not run":
                continue
            peer = row.peer
            if peer and section.peers_from is not None and where(section.peers_from) != here:
                other = where(section.peers_from)
                peer += f" ({other.machine}, {other.revision}, {other.date}: not this run)"
            verdict = f"**{row.verdict}**" if row.verdict == "missed" else row.verdict
            cells = (row.benchmark, row.ours, peer, row.target, verdict)
            line = "| " + " | ".join(_cell(c) for c in cells)
            line += f" | {link(out / f'stage_{section.stage}.json')} |"
            groups.setdefault(here, []).append((section.stage, line))
            shown.add(section.stage)
    lines = [
        f"Generated from {link(out)} by `python -m benchmarks.gpu_suite --out OUT --report --docs`; "
        "one table per machine and revision that measured.",
        "",
    ]
    for m, entries in groups.items():
        run_stages = list(dict.fromkeys(stage for stage, _ in entries))
        lines += [f"**{m.machine}, revision {m.revision}, {m.date}**", ""]
        lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += [line for _, line in entries]
        lines += ["", f"Command: `python -m benchmarks.gpu_suite --out OUT --peers PEERS_DIR --stages "
                  f"{','.join(run_stages)}`", ""]  # fmt: skip
    missing = [s.stage for s in sections if s.stage not in shown]
    if missing:
        lines += [f"Not measured in this run: the stages {', '.join(dict.fromkeys(missing))}.", ""]
    return "\n".join(lines)


def replace_today(doc_text: str, block: str) -> str:
    """`doc_text` with the text between the Today markers replaced by `block`. Raises ValueError
    when the markers are missing. Pure."""
    start, end = doc_text.find(BEGIN), doc_text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} block to replace: add the two markers where the table goes")
    return doc_text[: start + len(BEGIN)] + "\n" + block + doc_text[end:]
