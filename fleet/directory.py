"""Directory: the state of one `kvdepot directory` process, in one object the routes and the
ingest tasks share: the index, the instance registry, the LoRA book, the scorer and the counters.

State: all of the above. Event loop only.

Primitives: Directory(config, deployment_key, key_id) -> .registry / .index / .scorer / .stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleet.hashing import TenantNamer
from fleet.index import ChunkIndex
from fleet.ingest import LoraBook
from fleet.match import Matchers
from fleet.registry import InstanceRegistry
from fleet.score import Scorer
from fleet.spec import DirectoryConfig


@dataclass(slots=True)
class DirectoryStats:
    batches: int = 0
    chunk_events: int = 0
    duplicates: int = 0
    replays: int = 0
    gaps_replayed: int = 0
    """gaps closed by the replay socket"""
    resyncs: dict[str, int] = field(default_factory=dict)
    """inventory resyncs by reason: start, incarnation, restart, replay_short, cleared, no_replay, catchup"""
    resync_failures: int = 0
    bad_batches: int = 0
    registrations: int = 0
    event_disconnects: int = 0
    """KV-event connections lost (a sidecar gone, or a frame past max_event_bytes refused unread)"""
    events_dropped: int = 0
    """KV-event messages dropped past max_queued_event_bytes (the instance is resynced)"""


class Directory:
    def __init__(self, config: DirectoryConfig, deployment_key: bytes | None, key_id: str | None) -> None:
        self.config = config
        self.index = ChunkIndex()
        self.registry = InstanceRegistry(
            self.index, timeout_s=config.instance_timeout_s, max_instances=config.max_instances,
            max_chunks=config.max_chunks_per_instance, forget_after=config.forget_after,
        )  # fmt: skip
        self.lora = LoraBook(per_name=config.max_lora_candidates)
        self.scorer = Scorer(self.registry, TenantNamer(deployment_key), self.lora, config, key_id)
        self.stats = DirectoryStats()
        self.matchers = Matchers(config.match_slots, config.match_max_scopes) if config.match else None
        self.scorer.matchers = self.matchers

    def count_resync(self, reason: str) -> None:
        self.stats.resyncs[reason] = self.stats.resyncs.get(reason, 0) + 1
