"""Settings loading: builds the one Settings object from its sources and says in one line what is wrong.

Sources, highest precedence first: the command-line flags (dotted names, passed as init values),
`KVDEPOT_` environment variables, the optional TOML file, then the models' defaults (app/settings.py).
An unknown KVDEPOT_ variable is refused before anything is built, like an unknown key in the file.

State: none; each call builds a fresh, frozen Settings. Called once at start-up by the CLI (and by the
benchmarks), never at import, never from the event loop's hot path.

Primitives in call order:
  load_settings(overrides, config_file)   -> Settings; ConfigError with one line naming the setting
    sourced_settings(cls, file, environment)  the subclass reading flags, (environment), the file
    _check_env_names(environ)             unknown KVDEPOT_ names are errors
    settings_errors(file)                 what building raises, as ConfigError
    describe_validation_error(exc)        the one line: dotted name, what is wrong, the value shown
                                          (secrets masked by _shown)
  env_overrides_present()                 the KVDEPOT_ names in effect, for the start-up log line
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, TomlConfigSettingsSource

from app.errors import ConfigError
from app.redact import redact_text
from app.settings import Settings

__all__ = [
    "describe_validation_error",
    "env_overrides_present",
    "load_settings",
    "settings_errors",
    "sourced_settings",
]

S = TypeVar("S", bound=BaseSettings)


def _deep_set(target: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        target = target.setdefault(part, {})
    target[parts[-1]] = value


def load_settings(overrides: Mapping[str, Any] | None = None, config_file: Path | None = None) -> Settings:
    """Build the settings. `overrides` are dotted names from flags (`{"l1.size_gb": 2}`).

    Raises ConfigError with one line naming the offending setting.
    """
    init: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if value is not None:
            _deep_set(init, key, value)
    sourced = sourced_settings(Settings, config_file, environment=True)
    _check_env_names(os.environ)
    with settings_errors(config_file):
        built = sourced(**init)
    # Hand out the plain class so nothing depends on the per-call subclass.
    return Settings.model_construct(**dict(built))


def sourced_settings(settings_cls: type[S], config_file: Path | None, *, environment: bool) -> type[S]:
    """A subclass of `settings_cls` read from, highest precedence first: its init values, the
    `KVDEPOT_` environment (when `environment`), the TOML file (when given), the defaults.

    Raises ConfigError when `config_file` is given but is not a file.
    """
    if config_file is not None and not config_file.is_file():
        raise ConfigError(f"config: file {config_file} does not exist")

    class Sourced(settings_cls):  # type: ignore[misc,valid-type]  # a class given at run time
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources = [init_settings, env_settings] if environment else [init_settings]
            if config_file is not None:
                sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_file))
            return tuple(sources)

    return cast("type[S]", Sourced)


@contextmanager
def settings_errors(config_file: Path | None) -> Iterator[None]:
    """Turns what building settings raises into ConfigError with one line: a validation error
    named by `describe_validation_error`, a TOML syntax error (a ValueError) by the file."""
    try:
        yield
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    except ValueError as exc:  # a TOML syntax error surfaces as ValueError (tomllib.TOMLDecodeError)
        raise ConfigError(f"config: {config_file}: {exc}") from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line: the setting's dotted name, what is wrong, and the value given (secrets masked)."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "settings"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown setting")
        elif isinstance(err.get("input"), (dict, list)):
            parts.append(f"{loc}: {msg}")
        else:
            parts.append(f"{loc}: {msg} (got {_shown(err['loc'], err.get('input'))})")
    return "invalid setting " + "; ".join(parts)


_SECRET_NAME = re.compile(r"token|secret|password|(^|_)keys?$")


def _shown(loc: tuple[int | str, ...], value: Any) -> str:
    """`value` as an error line may show it: never a secret (a token, a key, a URL's password)."""
    if any(isinstance(p, str) and _SECRET_NAME.search(p) for p in loc):
        return "***"
    return repr(redact_text(value) if isinstance(value, str) else value)


def _check_env_names(environ: Mapping[str, str]) -> None:
    """An unknown KVDEPOT_ variable is an error, like an unknown key in the file (a typo such as
    KVDEPOT_L1_SIZE_GB for KVDEPOT_L1__SIZE_GB must not be silently ignored)."""
    fields = set(Settings.model_fields)
    for name in environ:
        if not name.upper().startswith("KVDEPOT_"):
            continue
        top = name[len("KVDEPOT_") :].split("__", 1)[0].lower()
        if top not in fields:
            raise ConfigError(
                f"unknown setting {name} (environment); settings are {', '.join(sorted(fields))}"
            )


def env_overrides_present() -> list[str]:
    """Names of KVDEPOT_ environment variables in effect (for the start-up log line)."""
    return sorted(k for k in os.environ if k.upper().startswith("KVDEPOT_"))
