"""Import-layering gate: api -> engine -> {storage, gpu}; app wires everything; the connector
imports none of the sidecar; storage/, gpu/ and engine/ own their config types and use only app's
error vocabulary (never app.settings). Parses every module (function-level imports included) with `ast`.

Run: python tests/check_layering.py   (exit 1 and one line per violation when a rule is broken)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "api", "engine", "storage", "gpu", "kvdepot_connector")
SHARED_APP = ("app.errors", "app.settings", "app.__version__")  # what every layer may use of app/
# layers below api/ whose config types live with them: only app's error vocabulary is theirs to use
LOWER_LAYERS = ("storage", "gpu", "engine")
LOWER_APP = ("app.errors", "app.__version__")

# package -> packages it must never import (prefix match on dotted names)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "storage": ("engine", "api", "gpu", "kvdepot_connector"),
    "gpu": ("engine", "api", "storage", "kvdepot_connector"),
    "engine": ("api", "kvdepot_connector"),
    "api": ("storage", "gpu"),
    "kvdepot_connector": ("app", "api", "engine", "storage", "gpu"),
}
# modules only the wiring may import
WIRING_ONLY = ("app.main", "app.cli", "app.bench")


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _shared_app(name: str) -> bool:
    return any(_under(name, allowed) for allowed in SHARED_APP)


def _lower_app(name: str) -> bool:
    return any(_under(name, allowed) for allowed in LOWER_APP)


def violations(root: Path = ROOT) -> list[str]:
    out: list[str] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            module = ".".join(rel.with_suffix("").parts)
            for lineno, name in _imports(path):
                for banned in FORBIDDEN.get(package, ()):
                    if _under(name, banned):
                        out.append(f"{rel}:{lineno}: {package} must not import {name}")
                if package != "app" and _under(name, "app") and not _shared_app(name):
                    out.append(f"{rel}:{lineno}: {package} may use only app.errors/app.settings, not {name}")
                elif package in LOWER_LAYERS and _under(name, "app") and not _lower_app(name):
                    out.append(f"{rel}:{lineno}: {package} may use only app.errors of app/, not {name}")
                if any(_under(name, w) for w in WIRING_ONLY) and not any(
                    _under(module, w) for w in WIRING_ONLY
                ):
                    out.append(f"{rel}:{lineno}: only the CLI and benchmarks may import {name}")
    return out


def main() -> int:
    found = violations()
    for line in found:
        print(line)
    if found:
        print(f"layering: {len(found)} violation(s)")
        return 1
    print("layering: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
