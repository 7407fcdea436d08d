"""No module of the shipped packages grows past 400 lines: one that does is split by its purpose."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "app",
    "api",
    "engine",
    "storage",
    "gpu",
    "fleet",
    "httpkit",
    "bench",
    "connector/kvdepot_connector",
)
MAX_LINES = 400


def test_no_module_is_longer_than_400_lines() -> None:
    modules = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    assert len(modules) > 200  # the packages are where this test looks for them
    long = {
        str(path.relative_to(ROOT)): n
        for path in modules
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by purpose: {long}"
