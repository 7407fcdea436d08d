"""BlobKeys: the deployment keys that authenticate L2 blobs (keyed BLAKE3 MACs).

Role: blobs in shared tiers (Redis) carry a MAC so that a writer without the key cannot plant KV
under a tenant's prefix. Every sidecar sharing a tier must hold the same keys. A secret is given
in settings (`l2.auth_keys`: hex or base64, at least 16 bytes) or, when none is, generated at the
first start into `<data_dir>/l2.key` (32 random bytes, mode 0600) and read again on every restart.

Rotation: several secrets; the first signs, all verify. A blob names the key that signed it by an
8-byte key id (derived from the secret, useless for forging), so a check costs one MAC whatever
the number of keys.

Derivation: each secret gives, through BLAKE3's key derivation mode, a 32-byte MAC key and a
key id under distinct contexts; the secret itself never keys a hash.

State: immutable once built; safe from any thread. The MAC itself is computed by storage/codec/__init__.py
(`mac_hasher`), which binds the header's fields into it.

Primitives in call order:
  parse_secret(text)              hex or base64 text -> bytes; ValueError when unusable
  load_or_create_key(path)        the key file's secret, created (0600) when absent; ConfigError
                                  when it cannot be read, has the wrong size or is readable by others
  BlobKeys(secrets)               first signs, all verify
  keys.signer / keys.mac_key(id)  the signing (key id, MAC key); the MAC key of an id or None
"""

from __future__ import annotations

import base64
import binascii
import os
import secrets as _random
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import blake3

from app.errors import ConfigError

KEY_FILE = "l2.key"
KEY_FILE_BYTES = 32
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 1024
KEY_ID_BYTES = 8
_MAC_CONTEXT = "kvdepot 2026 L2 blob MAC key v1"
_ID_CONTEXT = "kvdepot 2026 L2 blob key id v1"


def parse_secret(text: str) -> bytes:
    """A secret given as hex or as base64 (standard or URL-safe), at least MIN_SECRET_BYTES long."""
    raw = _decode(text.strip())
    if raw is None:
        raise ValueError("an L2 auth key must be hex or base64")
    if not MIN_SECRET_BYTES <= len(raw) <= MAX_SECRET_BYTES:
        raise ValueError(
            f"an L2 auth key must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, got {len(raw)}"
        )
    return raw


def _decode(text: str) -> bytes | None:
    try:
        return bytes.fromhex(text)
    except ValueError:
        pass
    padded = text.replace("-", "+").replace("_", "/") + "=" * (-len(text) % 4)
    try:
        return base64.b64decode(padded.encode("ascii"), validate=True)
    except (binascii.Error, ValueError):
        return None


def load_or_create_key(path: Path) -> bytes:
    """The secret in `path`; KEY_FILE_BYTES fresh random bytes written there (mode 0600, created
    exclusively: two starts racing agree on one) when there is no such file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return _read_key(path)
    except OSError as exc:
        raise ConfigError(f"l2 key: cannot create {path}: {exc.strerror}") from None
    try:
        secret = _random.token_bytes(KEY_FILE_BYTES)
        os.write(fd, secret)
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise ConfigError(f"l2 key: cannot write {path}: {exc.strerror}") from None
    os.close(fd)
    return secret


def _read_key(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError(f"l2 key: cannot read {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"l2 key: {path} is accessible to other users; chmod 600 it")
        if st.st_size != KEY_FILE_BYTES:
            raise ConfigError(f"l2 key: {path} holds {st.st_size} bytes, expected {KEY_FILE_BYTES}")
        return os.pread(fd, KEY_FILE_BYTES, 0)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class MacKey:
    key_id: bytes
    key: bytes = field(repr=False)


def _derive(secret: bytes) -> MacKey:
    mac_key = blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()
    key_id = blake3.blake3(secret, derive_key_context=_ID_CONTEXT).digest(length=KEY_ID_BYTES)
    return MacKey(key_id, mac_key)


class BlobKeys:
    """The deployment's MAC keys: `signer` signs, every key verifies. Never printed."""

    __slots__ = ("_by_id", "signer")

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if not secrets:
            raise ValueError("BlobKeys needs at least one secret")
        derived = [_derive(s) for s in secrets]
        self.signer = derived[0]
        self._by_id = {k.key_id: k.key for k in derived}

    @classmethod
    def from_settings(cls, texts: Sequence[str], key_file: Path) -> BlobKeys:
        """The configured secrets, else the key file's (created at the first start)."""
        if texts:
            return cls([parse_secret(t) for t in texts])
        return cls([load_or_create_key(key_file)])

    def mac_key(self, key_id: bytes) -> bytes | None:
        return self._by_id.get(bytes(key_id))

    def __repr__(self) -> str:
        return f"BlobKeys({len(self._by_id)} keys)"
