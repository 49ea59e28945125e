"""Task bundles: a task's sources packed so that the same sources always give the same sha256.

The contract (docs: tutorials/own-task.md), shared by the CLI that packs, the aggregator that stores
and the node that checks and unpacks:

- A bundle directory holds `fedgpu-task.toml` (`name`, `entry = "module:Attribute"`, optional
  `requires = ["dist>=x"]`) and the Python sources beside it. Hidden files and directories
  (a leading dot), `__pycache__/` and `*.pyc`/`*.pyo` are left out; a symbolic link, a device
  file, a FIFO or a socket in it is refused (a bundle carries regular files only).
- The archive is an uncompressed ustar tar of the regular files only, sorted by path, each
  with mtime 0, mode 0644, uid/gid 0 and empty owner names: no compression, so no zlib
  version can change the bytes. Its sha256 names the bundle. An archive in any other form
  (directory entries, other metadata, another order) is refused as not canonical, so a hash
  always means "exactly these files".
- Opening an archive (from the wire or a cache) checks everything before a byte is written:
  size, file count, absolute paths, `..`, links, devices, sparse and extended headers, the
  bytes each member claims, names, the manifest and that its entry module exists and defines
  the attribute (read from its tokens, bounded: never parsed into a tree, never executed).

Pure: no torch, nothing imported from a bundle, no file written except by `unpack`.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import stat
import tarfile
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fedgpu.core.bundle_guard import GuardError, check_member, top_level_names
from fedgpu.core.errors import FedgpuError

MANIFEST = "fedgpu-task.toml"
# Sources, not data: a task's data lives at the sites. Both limits keep a hostile archive from
# filling an aggregator's disk or a node's memory (a bundle is held whole while it is checked).
MAX_BUNDLE_BYTES = 32 << 20
MAX_BUNDLE_FILES = 1000
MAX_MANIFEST_BYTES = 64 << 10
MAX_REQUIRES = 64
# ustar's own limit on a path (prefix 155 + name 100, cut at a slash).
MAX_PATH_CHARS = 255
_COMPONENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SKIPPED_SUFFIXES = (".pyc", ".pyo")
_MANIFEST_KEYS = ("name", "entry", "requires")


class BundleError(FedgpuError):
    """A bundle that cannot be packed, trusted or used; the message says which rule it broke."""

    exit_code = 2


@dataclass(frozen=True)
class Manifest:
    name: str
    entry: str
    requires: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.entry.split(":", 1)[0]

    @property
    def attribute(self) -> str:
        return self.entry.split(":", 1)[1]

    @property
    def top_level(self) -> str:
        """The top-level module a node adds to its import path for this bundle."""
        return self.module.split(".", 1)[0]


@dataclass(frozen=True)
class Bundle:
    """A checked archive: its bytes, digest, manifest and files (path -> content)."""

    data: bytes
    sha256: str
    manifest: Manifest
    files: Mapping[str, bytes]

    @property
    def size(self) -> int:
        return len(self.data)

    def ref(self) -> BundleRef:
        return BundleRef(self.sha256, self.size, self.manifest.name, self.manifest.entry)


@dataclass(frozen=True)
class BundleRef:
    """What names a bundle outside its archive: on the wire, in the job database, on a node."""

    sha256: str
    size: int
    name: str
    entry: str


def check_sha256(text: str, what: str = "bundle hash") -> str:
    """A full lowercase hex sha256, or a BundleError naming `what`."""
    value = text.strip().lower()
    if not _SHA256.match(value):
        raise BundleError(f"{what} must be 64 hexadecimal characters (a sha256), got "
                          f"{text[:80]!r}")
    return value


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- the manifest ---------------------------------------------------------------------------


def parse_manifest(text: str, source: str = MANIFEST) -> Manifest:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BundleError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:
        raise BundleError(f"{source}: not valid TOML: nested too deep") from None
    except ValueError as exc:  # int()'s own refusal (4,300+ digits) gets through tomllib
        raise BundleError(f"{source}: not valid TOML: {str(exc)[:200]}") from None
    unknown = sorted(set(raw) - set(_MANIFEST_KEYS))
    if unknown:
        raise BundleError(f"{source}: unknown key(s) {', '.join(unknown)}; allowed: "
                          f"{', '.join(_MANIFEST_KEYS)}")
    name = raw.get("name")
    if not isinstance(name, str) or not _TASK_NAME.match(name):
        raise BundleError(f"{source}: 'name' must be 1-64 letters, digits, '.', '_' or '-' "
                          f"(starting with a letter or digit), got {name!r}")
    entry = raw.get("entry")
    if not isinstance(entry, str) or not _is_entry(entry):
        raise BundleError(f"{source}: 'entry' must be \"module:Attribute\" (e.g. "
                          f"\"my_task.model:MyTask\"), got {entry!r}")
    requires = raw.get("requires", [])
    if not isinstance(requires, list) or not all(isinstance(r, str) for r in requires):
        raise BundleError(f"{source}: 'requires' must be a list of requirement strings "
                          f"(e.g. [\"numpy>=1.26\"]), got {requires!r}")
    if len(requires) > MAX_REQUIRES:
        raise BundleError(f"{source}: 'requires' has {len(requires)} entries; at most "
                          f"{MAX_REQUIRES}")
    from packaging.requirements import InvalidRequirement, Requirement

    for spec in requires:
        try:
            Requirement(spec)
        except InvalidRequirement as exc:
            raise BundleError(f"{source}: 'requires' entry {spec!r} is not a requirement: "
                              f"{exc}") from None
    return Manifest(name=name, entry=entry, requires=tuple(requires))


def _is_entry(entry: str) -> bool:
    module, sep, attr = entry.partition(":")
    return (bool(sep) and attr.isidentifier()
            and all(part.isidentifier() for part in module.split(".")))


def _check_entry(manifest: Manifest, files: Mapping[str, bytes]) -> None:
    """The entry's module is in the bundle and defines the attribute at its top level."""
    base = manifest.module.replace(".", "/")
    path = next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in files), None)
    if path is None:
        raise BundleError(f"{MANIFEST}: entry {manifest.entry!r} names module "
                          f"{manifest.module!r}, but the bundle has neither {base}.py nor "
                          f"{base}/__init__.py")
    try:
        # Bounded: tokens, not a syntax tree (fedgpu/core/bundle_guard.py says why).
        names = top_level_names(files[path], path)
    except GuardError as exc:
        raise BundleError(str(exc)) from None
    if manifest.attribute not in names and "*" not in names:
        raise BundleError(f"{MANIFEST}: entry {manifest.entry!r}: {path} defines no top-level "
                          f"{manifest.attribute!r}")


# ---- packing --------------------------------------------------------------------------------


def _skipped(name: str) -> bool:
    return name.startswith(".") or name == "__pycache__" or name.endswith(_SKIPPED_SUFFIXES)


def collect(directory: Path) -> dict[str, bytes]:
    """The files a bundle of `directory` holds (path -> content), refusing what it can't."""
    root = Path(directory)
    if not root.is_dir():
        raise BundleError(f"task directory {root} does not exist or is not a directory")
    files: dict[str, bytes] = {}
    total = 0

    def walk(folder: Path, prefix: str) -> None:
        nonlocal total
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if _skipped(entry.name):
                    continue
                rel = prefix + entry.name
                st = os.lstat(entry.path)
                if stat.S_ISLNK(st.st_mode):
                    raise BundleError(f"{root / rel} is a symbolic link: a bundle holds regular "
                                      "files only (copy the file in instead)")
                if stat.S_ISDIR(st.st_mode):
                    walk(Path(entry.path), rel + "/")
                    continue
                if not stat.S_ISREG(st.st_mode):
                    raise BundleError(f"{root / rel} is a {_kind(st.st_mode)}: a bundle holds "
                                      "regular files only")
                check_path(rel)
                total += st.st_size
                if len(files) >= MAX_BUNDLE_FILES:
                    raise BundleError(f"{root} holds more than {MAX_BUNDLE_FILES} files: a "
                                      "bundle is a task's sources (data stays at the sites)")
                if total > MAX_BUNDLE_BYTES:
                    raise BundleError(f"{root} holds more than {MAX_BUNDLE_BYTES >> 20} MiB: a "
                                      "bundle is a task's sources (data stays at the sites)")
                files[rel] = Path(entry.path).read_bytes()

    walk(root, "")
    return files


def _kind(mode: int) -> str:
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device file"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def pack_files(files: Mapping[str, bytes]) -> bytes:
    """The canonical archive of `files`: ustar, sorted paths, fixed metadata, no compression.

    tarfile writes the headers; every field it would take from the file system is set here.
    """
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path in sorted(files):
            data = files[path]
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def pack_dir(directory: Path) -> Bundle:
    """Pack a task directory; the result is checked exactly as a node would check it."""
    files = collect(directory)
    if MANIFEST not in files:
        raise BundleError(f"{directory} has no {MANIFEST} (name, entry, requires): "
                          "'fedgpu task new NAME' writes a working one")
    return open_archive(pack_files(files))


# ---- opening --------------------------------------------------------------------------------


def check_path(path: str) -> None:
    """A member path a bundle may hold: relative, inside it, plain names."""
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise BundleError(f"{path!r}: absolute path in a bundle")
    if "\\" in path:
        raise BundleError(f"{path!r}: backslash in a path (use '/')")
    parts = path.split("/")
    if ".." in parts:
        raise BundleError(f"{path!r}: '..' would leave the bundle's directory")
    if len(path) > MAX_PATH_CHARS:
        raise BundleError(f"{path!r}: longer than {MAX_PATH_CHARS} characters")
    for part in parts:
        if not _COMPONENT.match(part) or len(part) > 100:
            raise BundleError(f"{path!r}: file names in a bundle are letters, digits, '_', "
                              "'.', '+' and '-', not starting with '.' or '-', at most 100 "
                              "characters each")


def open_archive(data: bytes, expected_sha256: str | None = None) -> Bundle:
    """Check an archive from anywhere (wire, cache, disk) and return its files in memory."""
    if len(data) > MAX_BUNDLE_BYTES:
        raise BundleError(f"bundle of {len(data)} bytes is over the limit of "
                          f"{MAX_BUNDLE_BYTES} bytes")
    sha = digest(data)
    if expected_sha256 is not None and sha != expected_sha256:
        raise BundleError(f"bundle content does not match its hash: expected "
                          f"{expected_sha256}, got {sha}")
    files = _read_members(data)
    if MANIFEST not in files:
        raise BundleError(f"bundle {sha[:12]} has no {MANIFEST} at its top")
    if len(files[MANIFEST]) > MAX_MANIFEST_BYTES:
        raise BundleError(f"{MANIFEST} is over {MAX_MANIFEST_BYTES} bytes")
    try:
        text = files[MANIFEST].decode("utf-8")
    except UnicodeDecodeError:
        raise BundleError(f"{MANIFEST} is not UTF-8 text") from None
    manifest = parse_manifest(text)
    _check_entry(manifest, files)
    if pack_files(files) != data:
        raise BundleError(f"bundle {sha[:12]} is not in canonical form (regular files only, "
                          "sorted, mtime 0, mode 0644, no owner names, uncompressed ustar): "
                          "pack it with 'fedgpu task check DIR' or fedgpu.core.bundles.pack_dir")
    return Bundle(data=data, sha256=sha, manifest=manifest, files=files)


def _read_members(data: bytes) -> dict[str, bytes]:
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")
    except tarfile.TarError as exc:
        raise BundleError(f"not an uncompressed tar archive: {exc}") from None
    files: dict[str, bytes] = {}
    read = 0
    with tar:
        while True:
            try:
                info = tar.next()
            except tarfile.TarError as exc:
                raise BundleError(f"damaged tar archive: {exc}") from None
            if info is None:
                return files
            if info.issym() or info.islnk():
                kind = "symbolic" if info.issym() else "hard"
                raise BundleError(f"{info.name!r}: {kind} link in a bundle (to "
                                  f"{info.linkname!r}); a bundle holds regular files only")
            if info.ischr() or info.isblk():
                raise BundleError(f"{info.name!r}: device file in a bundle; a bundle holds "
                                  "regular files only")
            if not info.isreg():
                raise BundleError(f"{info.name!r}: {_member_kind(info)} in a bundle; a bundle "
                                  "holds regular files only")
            check_path(info.name)
            if info.name in files:
                raise BundleError(f"{info.name!r} appears twice in the bundle")
            if len(files) >= MAX_BUNDLE_FILES:
                raise BundleError(f"bundle holds more than {MAX_BUNDLE_FILES} files")
            try:
                # From the header alone, before a byte is read (sparse members, sizes).
                check_member(info, len(data), read, MAX_BUNDLE_BYTES)
                member = tar.extractfile(info)
                assert member is not None  # a regular file
                files[info.name] = member.read(info.size)
            except GuardError as exc:
                raise BundleError(str(exc)) from None
            except tarfile.TarError as exc:
                raise BundleError(f"damaged tar archive: {exc}") from None
            read += len(files[info.name])


def _member_kind(info: tarfile.TarInfo) -> str:
    if info.isdir():
        return "directory entry"
    if info.isfifo():
        return "FIFO"
    return f"member of type {info.type!r}"


def unpack(bundle: Bundle, dest: Path) -> Path:
    """Write a checked bundle's files under `dest` (which must not exist yet)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=False)
    for path, content in bundle.files.items():
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        # O_EXCL|O_NOFOLLOW: nothing written through a link someone placed meanwhile.
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(content)
    return dest
