"""What a startup kit holds and how it is written and read.

A site's kit: its certificate and key (signed by the federation's CA), the CA certificate, and
`node.toml`, the flags `fedgpu node start` needs (aggregator address, name, TLS files; the data
directory and GPU policy when given; the site's policy file, `policy.toml`, when given). An
operator's kit: the operator certificate and key, the
CA certificate, and `connections.toml`, a saved connection whose paths are relative to the kit
(`FEDGPU_CONFIG_DIR=KIT fedgpu status --connection NAME`).

The policy file belongs to the site, not to whoever made the kit: the site may edit or
replace `policy.toml` in its kit at any time (the node reads it at start). The aggregator
never sees the file, only what the node advertises from it.

A kit is written whole or not at all: into a temporary directory beside it, then renamed into
place; an existing kit is replaced only when asked (--force). Key files are 0600 from the
start, the kit directory 0700.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tarfile
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fedgpu.core.errors import ConfigError

NODE_CONFIG = "node.toml"
CONNECTIONS = "connections.toml"
# The site's policy (fedgpu/core/site_policy.py) as a kit carries it, beside node.toml.
POLICY_FILE = "policy.toml"
# A hand-edited node.toml this large is not one: refuse it rather than parse it.
MAX_CONFIG_BYTES = 64 << 10
_NODE_KEYS = {"aggregator": str, "name": str, "tls_cert": str, "tls_key": str, "tls_ca": str,
              "data": str, "gpu": str, "policy": str}


@dataclass(frozen=True)
class NodeKit:
    """`node.toml` of a site's kit, its paths resolved against the kit's directory."""

    aggregator: str
    name: str
    tls_cert: Path
    tls_key: Path
    tls_ca: Path
    data: Path | None = None
    gpu: str | None = None
    policy: Path | None = None


def node_toml(aggregator: str, name: str, data: Path | None, gpu: str | None,
              cert: str, key: str, ca: str, policy: str | None = None) -> str:
    """The text of a site's node.toml (strings as JSON strings: TOML reads them the same)."""
    lines = [f"# fedgpu startup kit of site {name}: 'fedgpu node start --kit DIR' reads this",
             "# file; a flag given on the command line wins over its line here.",
             f"aggregator = {json.dumps(aggregator)}", f"name = {json.dumps(name)}",
             f"tls_cert = {json.dumps(cert)}", f"tls_key = {json.dumps(key)}",
             f"tls_ca = {json.dumps(ca)}"]
    if data is not None:
        lines.append(f"data = {json.dumps(str(data))}")
    if gpu is not None:
        lines.append(f"gpu = {json.dumps(gpu)}")
    if policy is not None:
        lines += ["# The site's own policy (which jobs it trains for): the site may replace "
                  "this file.", f"policy = {json.dumps(policy)}"]
    return "\n".join(lines) + "\n"


def read_node_kit(kit: Path) -> NodeKit:
    """A site's kit as `fedgpu node start --kit` uses it; a clear ConfigError when it is not
    one (missing, too large, a bad key, a file it names absent)."""
    path = kit / NODE_CONFIG
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"--kit {kit}: cannot read {path} ({exc.strerror}); a site's kit "
                          "comes from 'fedgpu kit site NAME'") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path} is over {MAX_CONFIG_BYTES >> 10} KiB: not a kit's node.toml")
    try:
        doc = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    unknown = sorted(set(doc) - set(_NODE_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)} (known: "
                          f"{', '.join(sorted(_NODE_KEYS))})")
    for key, kind in _NODE_KEYS.items():
        if key in doc and not isinstance(doc[key], kind):
            raise ConfigError(f"{path}: {key} must be a string")
    missing = [k for k in ("aggregator", "name", "tls_cert", "tls_key", "tls_ca") if k not in doc]
    if missing:
        raise ConfigError(f"{path} lacks {', '.join(missing)}: remake the kit with "
                          "'fedgpu kit site NAME --force'")

    def local(key: str) -> Path:
        p = kit / doc[key]
        if not p.is_file():
            raise ConfigError(f"{path}: {key} = {doc[key]!r}, but {p} is not a file")
        return p

    return NodeKit(doc["aggregator"], doc["name"], local("tls_cert"), local("tls_key"),
                   local("tls_ca"), Path(doc["data"]) if "data" in doc else None,
                   doc.get("gpu"), local("policy") if "policy" in doc else None)


@contextlib.contextmanager
def writing(out: Path, force: bool) -> Iterator[Path]:
    """A fresh directory to fill; on success it becomes `out` (an old kit there is replaced
    only with `force`), on failure nothing is left behind."""
    if out.exists() and not force:
        raise ConfigError(f"{out} already exists: pass --force to replace that kit")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        os.chmod(tmp, 0o700)
        yield tmp
        if out.exists():
            shutil.rmtree(out) if out.is_dir() and not out.is_symlink() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_file(src: Path, dest: Path, private: bool = False) -> None:
    """A copy of `src`; a private one (a key) is 0600 from the moment it exists."""
    data = src.read_bytes()
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def write_text(dest: Path, text: str) -> None:
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def archive(kit: Path, force: bool) -> Path:
    """KIT.tar.gz beside the kit, its members under KIT's name with their modes (keys stay
    0600 when unpacked); written to a temporary name, then renamed."""
    target = kit.with_name(kit.name + ".tar.gz")
    if target.exists() and not force:
        raise ConfigError(f"{target} already exists: pass --force to replace it")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh, tarfile.open(fileobj=fh, mode="w:gz") as tar:
            for path in sorted(kit.iterdir()):
                info = tar.gettarinfo(str(path), arcname=f"{kit.name}/{path.name}")
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                with open(path, "rb") as member:
                    tar.addfile(info, member)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return target
