"""Which checkpoint directories are whole: the ``COMPLETE`` manifest a checkpoint gets last.

The trainer's `arealite.trainer.checkpoint` writes the manifest (the files the directory
holds) once every rank's files are on disk; resuming, and the launcher choosing whether a
run resumes, read it here. Plain files only, so the launcher needs no torch to look.
"""

from __future__ import annotations

import json
from pathlib import Path

#: The manifest file of a checkpoint directory: ``{"files": [...]}``, written last.
COMPLETE = "COMPLETE"


def _is_complete(path: Path) -> bool:
    manifest = path / COMPLETE
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((path / f).is_file() for f in files)


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first."""
    out = []
    r = Path(root)
    if not r.is_dir():
        return out
    for p in r.iterdir():
        num = p.name[len("step_"):]
        if p.is_dir() and p.name.startswith("step_") and num.isdigit() and _is_complete(p):
            out.append((int(num), p))
    return sorted(out)
