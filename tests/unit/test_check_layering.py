"""tests/check_layering.py itself: the tree passes, and each L2-boundary rule refuses what it should
(an engine module importing an adapter family, a family importing another, the storage core
importing one), in a small tree of its own."""

from __future__ import annotations

from pathlib import Path

from tests.check_layering import adapter_families, violations


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


BASE = {
    "storage/__init__.py": "",
    "storage/base.py": "",
    "storage/registry.py": 'ADAPTERS = {"redis": "storage.redis.adapter:build"}\n',
    "storage/codec/__init__.py": "",
    "storage/redis/__init__.py": "",
    "storage/redis/adapter.py": "from storage.base import OK\n",
    "storage/disk/__init__.py": "",
    "storage/disk/files.py": "",
    "engine/__init__.py": "",
    "engine/ok.py": (
        "from storage import codec\nfrom storage.base import L2Adapter\n"
        "from storage.registry import ADAPTERS\n"
    ),
}


def test_the_repository_keeps_the_rules() -> None:
    assert violations() == []
    assert set(adapter_families()) >= {"storage.disk", "storage.slab", "storage.redis", "storage.mock"}
    assert "storage.codec" not in adapter_families()


def test_the_families_are_the_folders_of_storage_but_codec(tmp_path: Path) -> None:
    root = _tree(tmp_path, {**BASE, "storage/newkind/__init__.py": ""})
    assert adapter_families(root) == ("storage.disk", "storage.newkind", "storage.redis")
    assert violations(root) == []


def test_an_engine_or_api_module_importing_a_family_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        **BASE,
        "engine/bad.py": "def f():\n    from storage.redis.adapter import RedisAdapter\n    return 1\n",
        "engine/worse.py": "import storage.disk.files\n",
        "api/__init__.py": "",
        "api/route.py": "from storage.redis.config import RedisAdapterConfig\n",
    })  # fmt: skip
    found = violations(root)
    assert len(found) == 3
    assert found[0] == "api/route.py:1: api must not import storage.redis.config.RedisAdapterConfig"
    assert found[1].startswith("engine/bad.py:2: engine must not import the adapter family storage.redis")
    assert found[2].startswith("engine/worse.py:1: engine must not import the adapter family storage.disk")


def test_a_family_importing_another_or_the_core_importing_one_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        **BASE,
        "storage/redis/lane.py": "from storage.disk.files import Placed\nfrom storage.redis import adapter\n",
        "storage/common.py": "from storage.redis import adapter\n",
    })  # fmt: skip
    assert violations(root) == [
        "storage/common.py:1: the storage core must not import the adapter family storage.redis "
        "(storage.redis.adapter)",
        "storage/redis/lane.py:1: storage.redis must not import the adapter family storage.disk "
        "(storage.disk.files.Placed)",
    ]
