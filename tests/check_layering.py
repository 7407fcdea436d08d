"""Import-layering gate. Arrows point down only, checked on every import of every module
(function-level ones included) parsed with `ast`:

- the sidecar: api -> engine -> {storage, gpu}; app wires everything; storage/, gpu/ and engine/
  own their config types and use only app's error vocabulary, app.redact and app.tasks (never
  app.settings);
  in api/, the data plane (api/dataplane) and the control plane (api/http) never import each
  other (what both use, the audit log, is api/audit.py);
- the fleet wing, the same three layers: fleet/*.py pure logic (may use of engine/ only the key
  arithmetic, of app/ only its error vocabulary) <- fleet/http (the edge: its apps and
  subscriptions) <- fleet/wiring (the processes); it never imports the sidecar's api/, nor
  storage/ but the deployment key's derivation (storage.auth, for the wiring);
- httpkit/ (the HTTP toolkit both the sidecar and the fleet use) imports nothing of kvdepot but
  app's error vocabulary;
- bench/ (the benchmarks) stays out of the sidecar's import graph: no sidecar package imports it
  but the command line (app.cli), and that only inside a function (`kvdepot bench ...`); the
  benchmarks play the engine and may import every layer;
- the connector imports none of the sidecar, and the sidecar uses only the connector's pure
  modules (the wire protocol and the layout arithmetic);
- the L2 boundary: engine/ imports no adapter family (every folder of storage/ but codec/:
  storage.disk, storage.slab, storage.redis, storage.mock, and any added later), only the storage
  core (base, config, registry, ...) and storage.codec (api/ imports no storage at all); a family
  imports no other family, and the core none at all (the registry names them as strings, loaded on
  use).

Run: python tests/check_layering.py   (exit 1 and one line per violation when a rule is broken)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "api", "engine", "storage", "gpu", "fleet", "httpkit", "bench", "kvdepot_connector")
# where a package lives, when not at the root (the connector is a distribution of its own)
HOMES = {"kvdepot_connector": ROOT / "connector"}
# layers inside a package with rules of their own (a module's layer: the longest that holds it)
SUBLAYERS = ("api.http", "api.dataplane", "fleet.http", "fleet.wiring")

# What each layer may use of app/ (prefixes of dotted names); a layer not named: all of it.
SHARED_APP = ("app.errors", "app.settings", "app.__version__", "app.redact", "app.complaints", "app.tasks")
# layers below api/ whose config types live with them: only app's error vocabulary is theirs to use
LOWER_APP = ("app.errors", "app.__version__", "app.redact", "app.tasks")  # redact, tasks: pure
# the fleet's processes: besides, what every kvdepot process starts with (listener, logging,
# settings sources, supervised tasks); never the sidecar's own wiring
FLEET_WIRING_APP = (*SHARED_APP, "app.serving", "app.logs", "app.settings_load", "app.supervisor")
APP_ALLOWED: dict[str, tuple[str, ...]] = {
    "api": SHARED_APP, "api.http": SHARED_APP, "api.dataplane": SHARED_APP,
    "storage": LOWER_APP, "gpu": LOWER_APP, "engine": LOWER_APP, "httpkit": LOWER_APP,
    "fleet": LOWER_APP, "fleet.http": SHARED_APP, "fleet.wiring": FLEET_WIRING_APP,
}  # fmt: skip

# What the sidecar's packages may use of the connector: pure modules (stdlib and msgspec only).
CONNECTOR_PURE = (
    "kvdepot_connector.protocol", "kvdepot_connector.wire", "kvdepot_connector.kv_sharing",
    "kvdepot_connector.layout", "kvdepot_connector.lifeline",
)  # fmt: skip
SIDECAR = ("app", "api", "engine", "storage", "gpu", "fleet", "httpkit")
# the fleet (every layer of it) may use of engine/ only the key arithmetic
FLEET_ENGINE = ("engine.keys",)

# layer -> what it must never import (prefix match on dotted names), but its EXCEPT
_API = ("storage", "gpu", "fleet", "bench")
_FLEET = ("api", "storage", "gpu", "bench")
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "app": ("bench",),  # but BENCH_ENTRY, inside a function
    "api": _API,
    "api.http": (*_API, "api.dataplane"),
    "api.dataplane": (*_API, "api.http"),
    "kvdepot_connector": ("app", "api", "engine", "storage", "gpu", "fleet", "httpkit", "bench"),
    "fleet": (*_FLEET, "httpkit", "fleet.http", "fleet.wiring"),
    "fleet.http": (*_FLEET, "fleet.wiring"),
    "fleet.wiring": _FLEET,
    "httpkit": ("api", "engine", "storage", "gpu", "fleet", "bench", "kvdepot_connector"),
    "storage": ("engine", "api", "gpu", "fleet", "httpkit", "bench"),
    "gpu": ("engine", "api", "storage", "fleet", "httpkit", "bench"),
    "engine": ("api", "fleet", "httpkit", "bench"),
}
# layer -> what it may import although FORBIDDEN names a prefix of it
EXCEPT: dict[str, tuple[str, ...]] = {
    "fleet.wiring": ("storage.auth",),  # the deployment key, derived as the sidecars derive it
}
# storage/'s folders that are not adapter families: the engine may use them
STORAGE_SHARED = ("codec",)
# layers that must not reach past the L2 boundary into a family (api/, fleet/, gpu/: no storage at all)
BOUNDARY_USERS = ("engine",)


def adapter_families(root: Path = ROOT) -> tuple[str, ...]:
    """storage.<folder> for every package folder of storage/ but the shared ones: the families."""
    return tuple(
        f"storage.{d.name}"
        for d in sorted((root / "storage").iterdir())
        if d.is_dir() and (d / "__init__.py").is_file() and d.name not in STORAGE_SHARED
    )


# modules only the wiring may import
WIRING_ONLY = ("app.main", "app.wiring", "app.cli", "bench", "fleet.wiring")
# the benchmarks play the engine: they drive the sidecar through the connector's client; and, as
# the wiring does, they may use every layer and app/ whole
ENGINE_SIDE = ("bench",)
# the one sidecar module that may import bench/ (function-level only: `kvdepot bench ...`)
BENCH_ENTRY = "app.cli"


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, dotted name, whether inside a function) of every absolute import of a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    in_functions = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for inner in ast.walk(node)
    }
    found: list[tuple[int, str, bool]] = []
    for node in ast.walk(tree):
        local = id(node) in in_functions
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, local) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend((node.lineno, f"{node.module}.{alias.name}", local) for alias in node.names)
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _layer(package: str, module: str) -> str:
    return max((layer for layer in SUBLAYERS if _under(module, layer)), key=len, default=package)


def _connector_pure(name: str) -> bool:
    return name == "kvdepot_connector" or any(_under(name, pure) for pure in CONNECTOR_PURE)


def _pure_dependency(name: str) -> bool:
    top = name.partition(".")[0]
    return top in sys.stdlib_module_names or top == "msgspec" or _connector_pure(name)


def _banned(layer: str, module: str, name: str, local: bool) -> bool:
    if any(_under(name, allowed) for allowed in EXCEPT.get(layer, ())):
        return False
    if local and module == BENCH_ENTRY and _under(name, "bench"):
        return False
    return any(_under(name, banned) for banned in FORBIDDEN.get(layer, ()))


def _family(name: str, families: tuple[str, ...]) -> str | None:
    return next((f for f in families if _under(name, f)), None)


def violations(root: Path = ROOT) -> list[str]:
    out: list[str] = []
    families = adapter_families(root)
    for package in PACKAGES:
        home = root / HOMES[package].relative_to(ROOT) if package in HOMES else root
        for path in sorted((home / package).rglob("*.py")):
            rel = path.relative_to(root)
            module = ".".join(path.relative_to(home).with_suffix("").parts)
            layer = _layer(package, module)
            app_allowed = APP_ALLOWED.get(layer)
            for lineno, name, local in _imports(path):
                if _banned(layer, module, name, local):
                    out.append(f"{rel}:{lineno}: {layer} must not import {name}")
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
                if (
                    app_allowed is not None
                    and _under(name, "app")
                    and not any(_under(name, allowed) for allowed in app_allowed)
                ):
                    allowed = ", ".join(app_allowed)
                    out.append(f"{rel}:{lineno}: {layer} may use only {allowed} of app/, not {name}")
                family = _family(name, families)
                if family is not None and package in BOUNDARY_USERS:
                    out.append(
                        f"{rel}:{lineno}: {package} must not import the adapter family {family} "
                        f"({name}): use the storage core (storage.base capabilities, storage.config, "
                        "storage.registry)"
                    )
                owner = _family(module, families) if package == "storage" else None
                if family is not None and package == "storage" and owner != family:
                    out.append(
                        f"{rel}:{lineno}: {owner or 'the storage core'} must not import the adapter "
                        f"family {family} ({name})"
                    )
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
