"""A folder built once per set of parameters (the e2e checkpoints: make_model.py, make_mm_model.py,
make_lora.py). The files are written into a fresh folder beside the target, a marker file records
the parameters, and the folder is renamed into place: a crash leaves no half-built target, a second
build with the same parameters is a no-op, and of two concurrent builds the first to finish wins.

    build_once(out_dir, marker, params, builder, write)   # write(tmp) writes the files

Imported by the builders as scripts run by `.venv-vllm` (their folder is on sys.path): standard
library only.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def is_built(out_dir: Path, marker: str, params: dict[str, Any]) -> bool:
    """Whether `out_dir` holds a build with exactly `params`."""
    try:
        return bool(json.loads((out_dir / marker).read_text()) == params)
    except (OSError, ValueError):
        return False


def build_once(
    out_dir: Path, marker: str, params: dict[str, Any], builder: str, write: Callable[[Path], None]
) -> Path:
    """`out_dir`, holding what `write(tmp)` writes, unless it already holds a build of `params`.

    `out_dir` must be absent, empty, or a folder `builder` built before (it is replaced).
    """
    out_dir = Path(out_dir)
    if is_built(out_dir, marker, params):
        return out_dir
    if not (out_dir / marker).is_file() and out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty and was not built by {builder}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        write(tmp)
        (tmp / marker).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)
        if is_built(out_dir, marker, params):  # a concurrent build finished first
            shutil.rmtree(tmp)
            return out_dir
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
