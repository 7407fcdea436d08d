"""The adapter registry: every L2 adapter type, one line each — its config class and its builder.

Role: the one place that names the adapter families (storage/<family>/). `ADAPTERS` maps a config's
`type` to the config class (imported when this module is: the settings and the control plane parse
every type) and to the builder (imported at the first build of that type: redis-py loads only
where a Redis tier is configured). `AdapterConfig`, the pydantic union of the config classes
discriminated by `type`, is derived from it; app/settings composes it into `l2.adapters` and the
control plane parses `POST /l2/adapters` bodies with it. Adding an adapter type = its folder
(config, adapter with `build`, tests) + one `register` line below.

A builder is `build(config, context) -> L2Adapter` (context: storage/base.py BuildContext, the data
dir and the deployment's keys): a new adapter that owns what it needs (its executor: named threads
`kvdepot-l2-<adapter name>`, bounded; shut down by `close()`). Building starts no I/O;
`await adapter.start()` readies it, or the first operation does. Where each type keeps its bytes by
default is its builder's to say (disk: <data_dir>/l2-disk[-<name>]; slab: <data_dir>/l2-slab[-<name>]
and its .index; redis: its URL; mock: memory).

State: the table, filled at import and read-only after. Primitives: ADAPTERS.register(type, config,
builder) (dotted "module:attribute" paths), build_adapter(config, data_dir, keys),
default_adapters(), AdapterConfig.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias, Union, cast

from pydantic import Field

from storage.auth import BlobKeys
from storage.base import BuildContext, L2Adapter
from storage.config import AdapterConfigBase

Builder = Callable[[Any, BuildContext], L2Adapter]


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class AdapterRegistry:
    """type -> (config class, builder path), in registration order (the order of the union)."""

    def __init__(self) -> None:
        self._configs: dict[str, type[AdapterConfigBase]] = {}
        self._builders: dict[str, str] = {}

    def register(self, type_: str, config: str, builder: str) -> None:
        """`config` and `builder` as "module:attribute"; the config class is imported now, its
        `type` field must default to `type_`."""
        if type_ in self._configs:
            raise ValueError(f"adapter type {type_!r} is registered already")
        cls = cast(type[AdapterConfigBase], _load(config))
        if cls.model_fields["type"].default != type_:
            raise ValueError(f"{cls.__name__}.type must default to {type_!r}")
        self._configs[type_] = cls
        self._builders[type_] = builder

    def types(self) -> list[str]:
        return list(self._configs)

    def config_class(self, type_: str) -> type[AdapterConfigBase]:
        return self._configs[type_]

    def config_union(self) -> Any:
        """The configs as one pydantic type, discriminated by `type`."""
        classes = tuple(self._configs.values())
        if len(classes) == 1:
            return classes[0]
        return Annotated[Union[classes], Field(discriminator="type")]  # noqa: UP007

    def build(self, config: AdapterConfigBase, context: BuildContext) -> L2Adapter:
        path = self._builders.get(config.type)
        if path is None:
            raise TypeError(f"unknown adapter config {type(config).__name__}")
        builder = cast(Builder, _load(path))
        return builder(config, context)


ADAPTERS = AdapterRegistry()
ADAPTERS.register("disk", "storage.disk.config:DiskAdapterConfig", "storage.disk.adapter:build")
ADAPTERS.register("slab", "storage.slab.config:SlabAdapterConfig", "storage.slab.adapter:build")
ADAPTERS.register("redis", "storage.redis.config:RedisAdapterConfig", "storage.redis.adapter:build")
ADAPTERS.register("mock", "storage.mock.config:MockAdapterConfig", "storage.mock.adapter:build")

if TYPE_CHECKING:  # to the checker, any registered config is an AdapterConfigBase
    AdapterConfig: TypeAlias = AdapterConfigBase
else:
    AdapterConfig = ADAPTERS.config_union()


def default_adapters() -> list[AdapterConfigBase]:
    """`l2.adapters` when the settings name none: a disk tier under the data dir, its defaults."""
    return [ADAPTERS.config_class("disk").model_validate({})]


def build_adapter(config: AdapterConfigBase, data_dir: Path, keys: BlobKeys | None = None) -> L2Adapter:
    """A new adapter for `config`; call `await adapter.close()` to release everything it holds.
    `keys` (the deployment's) seal a Redis adapter's fleet quotas (storage/redis/fleet_quota.py)."""
    return ADAPTERS.build(config, BuildContext(data_dir, keys))
