"""The data directory's lock and the admin token file: what a sidecar claims in its data dir first.

Role: `DataDirLock.acquire(data_dir)` proves that this process is the only sidecar on the data dir:
an exclusive `flock` on `<data_dir>/kvdepot.lock`, held on an open descriptor for as long as the
service lives (the kernel drops it when the process dies, however it dies, so no PID is ever
trusted). The file holds the owner's PID, only to name it when a second sidecar is refused.
Everything a previous sidecar on this data dir left behind (its arena, its sockets) may be removed
once the lock is held. `admin_token_from_file(path)` reads the admin token, or generates one into
the file (mode 0600) on first start; `with_admin_token(settings)` puts it into the settings.

State: the lock's open descriptor. Touched by the thread that builds and closes the service.

Primitives in call order: `DataDirLock.acquire(data_dir)`, `release()`; `admin_token_from_file`,
`with_admin_token`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from pathlib import Path

import structlog
from pydantic import SecretStr

from app.errors import ConfigError
from app.settings import Settings

log = structlog.get_logger("kvdepot")

LOCK_FILE = "kvdepot.lock"


class DataDirLock:
    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: Path) -> DataDirLock:
        """Lock `data_dir` for this process; ConfigError (one line) when another process holds it."""
        path = data_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(f"data_dir: cannot open {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"data_dir: another kvdepot (pid {owner}) is running on this data directory"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"data_dir: cannot lock {path}: {exc.strerror}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Let another sidecar have the data dir (the lock file stays; its content is stale then)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the only descriptor of the open file drops the flock


def admin_token_from_file(path: Path) -> str:
    """The admin token in `path` (its first line). A missing file is created with a random token,
    mode 0600, and its path (never the token) is logged. ConfigError (one line) when the file
    cannot be read or written or holds no token."""
    if not path.exists():
        _generate_token(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not text"
        raise ConfigError(f"http.admin_token_file: cannot read {path}: {why}") from None
    lines = text.splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise ConfigError(f"http.admin_token_file: {path} holds no token (its first line is empty)")
    if path.stat().st_mode & 0o077:
        log.warning("admin_token_file_readable_by_others", path=str(path))
    return token


def _generate_token(path: Path) -> None:
    """Write a random token to `path`, whole or not at all (a temporary file linked into place; a
    file that appeared meanwhile is kept)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, (secrets.token_urlsafe(32) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise ConfigError(f"http.admin_token_file: cannot create {path}: {exc.strerror}") from None
    log.info("admin_token_generated", path=str(path))


def with_admin_token(settings: Settings) -> Settings:
    """`settings` with the admin token of `http.admin_token_file` in `http.admin_token` (read, or
    generated on first start) when only the file is set; otherwise `settings` unchanged."""
    http = settings.http
    if http.admin_token is not None or http.admin_token_file is None:
        return settings
    token = SecretStr(admin_token_from_file(http.admin_token_file))
    return settings.model_copy(update={"http": http.model_copy(update={"admin_token": token})})
