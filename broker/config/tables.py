"""How a TOML table becomes a typed settings dataclass: unknown keys refused, environment
overrides (``BROKER_<SECTION>_<KEY>``), values converted to the field types. ``broker.config``
declares the sections and validates what they mean; this module only reads and converts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from broker.core.errors import ConfigError

ENV_PREFIX = "BROKER_"


def config_table(
    cls: type[Any], name: str, raw: Mapping[str, Any], env: Mapping[str, str], base_dir: Path
) -> Any:
    """``[name]`` of ``raw`` as an instance of the dataclass ``cls``: unknown keys refused,
    ``BROKER_<NAME>_<KEY>`` overriding the file, every value converted to its field's type.

    Raises:
        ConfigError: naming the first bad key.
    """
    table = raw.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(name, "must be a table")
    allowed = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in allowed:
            raise ConfigError(f"{name}.{key}", "unknown key")
        values[key] = value
    for key in allowed:
        env_name = f"{ENV_PREFIX}{name.upper()}_{key.upper()}"
        if env.get(env_name, ""):  # an empty variable counts as unset (as a shell's ${X:-})
            values[key] = env[env_name]
    converted = {
        key: convert_value(f"{name}.{key}", value, allowed[key].type, base_dir)
        for key, value in values.items()
    }
    return cls(**converted)


def convert_value(key: str, value: Any, type_name: Any, base_dir: Path) -> Any:  # noqa: PLR0911, PLR0912
    """A TOML (or environment-string) value as the field type ``type_name`` names: bool, int,
    float, a path (relative to ``base_dir``), a tuple of strings (comma-separated from the
    environment) or a string."""
    type_text = str(type_name)
    if type_text == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in {"true", "1", "yes", "false", "0", "no"}:
            return value.lower() in {"true", "1", "yes"}
        raise ConfigError(key, "must be a boolean")
    if type_text == "int":
        if isinstance(value, bool):
            raise ConfigError(key, "must be an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        raise ConfigError(key, "must be an integer")
    if type_text == "float":
        if isinstance(value, bool):
            raise ConfigError(key, "must be a number")
        if isinstance(value, int | float):
            return float(value)
        try:
            return float(str(value))
        except ValueError as exc:
            raise ConfigError(key, "must be a number") from exc
    if "Path" in type_text:
        if not isinstance(value, str) or not value:
            raise ConfigError(key, "must be a non-empty path")
        return resolve_path(base_dir, value)
    if "tuple" in type_text:
        if isinstance(value, str):  # from the environment: comma-separated
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(key, "must be a list of strings")
        return tuple(value)
    if not isinstance(value, str):
        raise ConfigError(key, "must be a string")
    return value


def resolve_path(base_dir: Path, value: str) -> Path:
    """``value`` as a path; a relative one is relative to the config file's directory."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base_dir / path).resolve()


SQLITE = "sqlite:///"


def resolve_sqlite_uri(key: str, uri: str, base_dir: Path) -> str:
    """A ``sqlite:///PATH`` store URI with PATH made absolute, as ``sqlite:////ABSOLUTE``.

    SQLAlchemy's convention: ``sqlite:///keys.db`` is relative (here: to ``base_dir``, the config
    file's directory), ``sqlite:////var/lib/broker/keys.db`` absolute. Other URIs are returned
    unchanged.

    Raises:
        ConfigError: ``key`` when a relative PATH would silently stand for another file than
            the absolute one an older broker read (``/PATH`` exists, ``base_dir/PATH`` not).
    """
    if not uri.startswith(SQLITE) or len(uri) == len(SQLITE):
        return uri
    text = uri.removeprefix(SQLITE)
    path = resolve_path(base_dir, text)
    legacy = Path("/" + text)
    if not Path(text).is_absolute() and not path.exists() and legacy.is_file():
        raise ConfigError(
            key,
            f"{uri} is relative to the config file ({path}, absent), but {legacy} exists: "
            f'write "sqlite:///{legacy}" for that file (four slashes: an absolute path)',
        )
    return f"{SQLITE}{path}"


def resolve_local_kek(uri: str, base_dir: Path) -> str:
    """A ``local:PATH`` KEK URI with a relative PATH made absolute against ``base_dir`` (the
    config file's directory); other URIs unchanged."""
    if not uri.startswith("local:") or len(uri) == len("local:"):
        return uri
    return f"local:{resolve_path(base_dir, uri.removeprefix('local:'))}"


def resolve_sqlite_store(uri: str, base_dir: Path) -> str:
    """A ``sqlite:///PATH`` nonce store with a relative PATH made absolute against ``base_dir``
    (the config file's directory), written ``sqlite://`` + the absolute path; others unchanged."""
    if not uri.startswith("sqlite:///"):
        return uri
    return f"sqlite://{resolve_path(base_dir, uri.removeprefix('sqlite:///'))}"
