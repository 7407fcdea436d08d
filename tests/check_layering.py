"""Import-layering gate: api -> engine -> {storage, gpu}; app wires everything; fleet/ (pure logic of
the directory and the router) never imports api/; the connector
imports none of the sidecar, and the sidecar uses only the connector's pure modules (the wire
protocol and the layout arithmetic); storage/, gpu/ and engine/ own their config types and use
only app's error vocabulary and app.redact (never app.settings). Parses every module
(function-level imports included) with `ast`.

Run: python tests/check_layering.py   (exit 1 and one line per violation when a rule is broken)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "api", "engine", "storage", "gpu", "fleet", "kvdepot_connector")
# where a package lives, when not at the root (the connector is a distribution of its own)
HOMES = {"kvdepot_connector": ROOT / "connector"}
SHARED_APP = ("app.errors", "app.settings", "app.__version__", "app.redact")  # what any layer may use
# layers below api/ whose config types live with them: only app's error vocabulary is theirs to use
LOWER_LAYERS = ("storage", "gpu", "engine", "fleet")
LOWER_APP = ("app.errors", "app.__version__", "app.redact")  # app.redact: pure, masks URLs
# What the sidecar's packages may use of the connector: pure modules (stdlib and msgspec only).
CONNECTOR_PURE = (
    "kvdepot_connector.protocol", "kvdepot_connector.wire", "kvdepot_connector.kv_sharing",
    "kvdepot_connector.layout", "kvdepot_connector.lifeline",
)  # fmt: skip
SIDECAR = ("app", "api", "engine", "storage", "gpu", "fleet")
# fleet/ (the directory's pure logic) may use of engine/ only the key arithmetic
FLEET_ENGINE = ("engine.keys",)

# package -> packages it must never import (prefix match on dotted names)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "api": ("storage", "gpu"),
    "kvdepot_connector": ("app", "api", "engine", "storage", "gpu", "fleet"),
    "fleet": ("api", "storage", "gpu"),
    "storage": ("engine", "api", "gpu", "fleet"),
    "gpu": ("engine", "api", "storage", "fleet"),
    "engine": ("api", "fleet"),
}
# modules only the wiring may import
WIRING_ONLY = ("app.main", "app.wiring", "app.cli", "app.bench", "app.directory", "app.route")
# the benchmarks play the engine: they drive the sidecar through the connector's client
ENGINE_SIDE = ("app.bench",)


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


def _connector_pure(name: str) -> bool:
    return name == "kvdepot_connector" or any(_under(name, pure) for pure in CONNECTOR_PURE)


def _pure_dependency(name: str) -> bool:
    top = name.partition(".")[0]
    return top in sys.stdlib_module_names or top == "msgspec" or _connector_pure(name)


def violations(root: Path = ROOT) -> list[str]:
    out: list[str] = []
    for package in PACKAGES:
        home = root / HOMES[package].relative_to(ROOT) if package in HOMES else root
        for path in sorted((home / package).rglob("*.py")):
            rel = path.relative_to(root)
            module = ".".join(path.relative_to(home).with_suffix("").parts)
            for lineno, name in _imports(path):
                for banned in FORBIDDEN.get(package, ()):
                    if _under(name, banned):
                        out.append(f"{rel}:{lineno}: {package} must not import {name}")
                if (
                    package in SIDECAR
                    and _under(name, "kvdepot_connector")
                    and not _connector_pure(name)
                    and not any(_under(module, m) for m in ENGINE_SIDE)
                ):
                    out.append(f"{rel}:{lineno}: {package} must not import {name} (not a pure module)")
                if (
                    package == "fleet"
                    and _under(name, "engine")
                    and not any(_under(name, m) for m in FLEET_ENGINE)
                ):
                    out.append(f"{rel}:{lineno}: fleet may use only engine.keys of engine/, not {name}")
                if module in CONNECTOR_PURE and not _pure_dependency(name):
                    out.append(f"{rel}:{lineno}: a pure module may import the stdlib and msgspec, not {name}")
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
