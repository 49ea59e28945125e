"""Saved connections: named aggregator addresses with the operator's credential, in one small
TOML file of the user's (as Flower keeps named SuperLink connections).

The file is `$FEDGPU_CONFIG_DIR/connections.toml` (default `$XDG_CONFIG_HOME/fedgpu`, i.e.
`~/.config/fedgpu`). It holds paths, never secrets: an operator token saved with a
connection lives in its own 0600 file beside it (`tokens/NAME`), named by `token_file`.
Every change is a read-modify-write under a lock and lands by an atomic rename of a 0600
file, so two writers (`make up` and `fedgpu certs` at once) lose nothing and a crash leaves
the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from fedgpu.core.errors import ConfigError

FILE_NAME = "connections.toml"
TOKENS_DIR = "tokens"
# A hand-edited file this big is not a list of connections: refuse it rather than parse it.
MAX_FILE_BYTES = 1 << 20
MAX_TOKEN_BYTES = 4096
MAX_CONNECTIONS = 1000
LOCK_WAIT_S = 10.0
# Bare TOML keys, file names and shell words alike.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_FIELDS = ("address", "tls_ca", "tls_cert", "tls_key", "token_file", "insecure")
_PATH_FIELDS = ("tls_ca", "tls_cert", "tls_key", "token_file")


@dataclass(frozen=True)
class SavedConnection:
    """One named aggregator: where it is and what this operator presents to it. Relative
    paths in the file are relative to the file's directory; saved ones are absolute."""

    name: str
    address: str
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    token_file: Path | None = None
    # Plaintext gRPC even where TLS material is set in the environment.
    insecure: bool = False

    def to_dict(self) -> dict[str, object]:
        doc: dict[str, object] = {"name": self.name, "address": self.address}
        for key in _PATH_FIELDS:
            value = getattr(self, key)
            doc[key] = str(value) if value is not None else None
        doc["insecure"] = self.insecure
        return doc


@dataclass(frozen=True)
class Connections:
    default: str | None = None
    saved: dict[str, SavedConnection] = field(default_factory=dict)

    def get(self, name: str, path: Path) -> SavedConnection:
        if name not in self.saved:
            known = ", ".join(sorted(self.saved)) or "none saved yet"
            raise ConfigError(f"no saved connection {name!r} in {path} (known: {known}); "
                              "'fedgpu connection add NAME --address HOST:PORT ...' saves one")
        return self.saved[name]


def config_dir() -> Path:
    """Where fedgpu keeps the user's settings: $FEDGPU_CONFIG_DIR, else
    $XDG_CONFIG_HOME/fedgpu, else ~/.config/fedgpu."""
    given = os.environ.get("FEDGPU_CONFIG_DIR")
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME")
    if not base:
        try:
            base = str(Path.home() / ".config")
        except (RuntimeError, KeyError):  # no HOME and no passwd entry (some containers)
            raise ConfigError("no home directory to keep saved connections in: set "
                              "FEDGPU_CONFIG_DIR") from None
    return Path(base).expanduser() / "fedgpu"


def file_path() -> Path:
    return config_dir() / FILE_NAME


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ConfigError(f"connection name {name!r}: use 1-64 letters, digits, '-', '_' or "
                          "'.', starting with a letter or digit")
    return name


def load(path: Path | None = None) -> Connections:
    """The saved connections; none when the file does not exist. A damaged file is a
    ConfigError naming it and the problem (it is never rewritten from a bad read)."""
    if path is None:
        try:
            path = file_path()
        except ConfigError:
            return Connections()  # nowhere to keep any: none saved
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return Connections()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path} is larger than {MAX_FILE_BYTES} bytes: not a connections "
                          "file")
    try:
        raw = tomllib.loads(data.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path} is not valid TOML ({exc}); fix or remove it") from None
    return _parse(raw, path)


def _parse(raw: dict[str, object], path: Path) -> Connections:
    unknown = set(raw) - {"default", "connections"}
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}")
    table = raw.get("connections", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [connections] must be a table")
    if len(table) > MAX_CONNECTIONS:
        raise ConfigError(f"{path}: more than {MAX_CONNECTIONS} connections")
    saved = {}
    for name, entry in table.items():
        check_name(name)
        if not isinstance(entry, dict):
            raise ConfigError(f"{path}: connections.{name} must be a table")
        bad = set(entry) - set(_FIELDS)
        if bad:
            raise ConfigError(f"{path}: connections.{name}: unknown key(s) "
                              f"{', '.join(sorted(bad))} (known: {', '.join(_FIELDS)})")
        address = entry.get("address")
        if not isinstance(address, str) or ":" not in address:
            raise ConfigError(f"{path}: connections.{name}.address must be \"HOST:PORT\"")
        paths: dict[str, Path | None] = {}
        for key in _PATH_FIELDS:
            value = entry.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{path}: connections.{name}.{key} must be a path (a string)")
            # Relative to the file, so a hand-written file can sit beside its certificates.
            paths[key] = (path.parent / Path(value).expanduser()) if value else None
        insecure = entry.get("insecure", False)
        if not isinstance(insecure, bool):
            raise ConfigError(f"{path}: connections.{name}.insecure must be true or false")
        saved[name] = SavedConnection(name, address, insecure=insecure, **paths)
    default = raw.get("default")
    if default is not None and (not isinstance(default, str) or default not in saved):
        raise ConfigError(f"{path}: default = {default!r} names no saved connection")
    return Connections(default, saved)


def dumps(conns: Connections) -> str:
    """The file's text. Strings are written as JSON strings, which TOML reads the same way."""
    lines = ["# fedgpu saved connections: 'fedgpu connection add|remove|use' writes this "
             "file.", ""]
    if conns.default is not None:
        lines += [f"default = {json.dumps(conns.default)}", ""]
    for name in sorted(conns.saved):
        c = conns.saved[name]
        lines.append(f"[connections.{check_name(name)}]")
        lines.append(f"address = {json.dumps(c.address)}")
        for key in _PATH_FIELDS:
            value = getattr(c, key)
            if value is not None:
                lines.append(f"{key} = {json.dumps(str(value))}")
        if c.insecure:
            lines.append("insecure = true")
        lines.append("")
    return "\n".join(lines)


@contextlib.contextmanager
def editing(path: Path | None = None) -> Iterator[list[Connections]]:
    """Read, let the caller replace box[0], write back atomically; one writer at a time."""
    path = path or file_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = os.open(path.parent / f".{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _lock(lock, path)
        box = [load(path)]
        before = box[0]
        yield box
        if box[0] != before:
            write_private(path, dumps(box[0]).encode())
    finally:
        os.close(lock)


def _lock(fd: int, path: Path) -> None:
    """An exclusive lock for one edit, or a ConfigError after LOCK_WAIT_S: another edit
    holds it only for a moment, so a longer wait means a stuck process."""
    end = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > end:
                raise ConfigError(f"{path} is being changed by another process for over "
                                  f"{LOCK_WAIT_S:g}s; try again") from None
            time.sleep(0.05)


def write_private(path: Path, data: bytes) -> None:
    """`data` into `path`, mode 0600, by an atomic rename of a fsynced temporary file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # also when a stale temporary file had other modes
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def save_token(name: str, token: str, path: Path | None = None) -> Path:
    """Keep an operator token for connection `name` in its own 0600 file; its path."""
    token = token.strip()
    if not token or len(token.encode()) > MAX_TOKEN_BYTES or "\n" in token:
        raise ConfigError(f"an operator token is one line of at most {MAX_TOKEN_BYTES} bytes")
    folder = (path or file_path()).parent / TOKENS_DIR
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    target = folder / check_name(name)
    write_private(target, token.encode() + b"\n")
    return target


def read_token(token_file: Path) -> str:
    try:
        with open(token_file, "rb") as fh:
            data = fh.read(MAX_TOKEN_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the operator token file {token_file}: "
                          f"{exc.strerror}") from None
    token = data.decode(errors="replace").strip()
    if not token or len(data) > MAX_TOKEN_BYTES or "\n" in token:
        raise ConfigError(f"{token_file} must hold one line: the operator token")
    return token


def put(conns: Connections, conn: SavedConnection, make_default: bool) -> Connections:
    saved = {**conns.saved, conn.name: conn}
    if len(saved) > MAX_CONNECTIONS:
        raise ConfigError(f"at most {MAX_CONNECTIONS} saved connections")
    default = conn.name if make_default or conns.default is None else conns.default
    return Connections(default, saved)


def without(conns: Connections, name: str) -> Connections:
    saved = {k: v for k, v in conns.saved.items() if k != name}
    return replace(conns, saved=saved, default=None if conns.default == name else conns.default)


def forget(name: str) -> SavedConnection | None:
    """Remove a saved connection, and the token file saved with it; what was removed, or None
    when there was no such connection."""
    with editing() as box:
        gone = box[0].saved.get(name)
        if gone is None:
            return None
        box[0] = without(box[0], name)
    own = file_path().parent / TOKENS_DIR / name
    if gone.token_file is not None and gone.token_file == own:
        own.unlink(missing_ok=True)
    return gone
