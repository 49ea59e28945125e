"""The bounded checks of a task bundle from the wire (fedgpu/core/bundles.py opens archives
with them): what a member header may claim before a byte of it is read, and what the entry
module defines, found without building a syntax tree.

Why not `tarfile` alone: it reports GNU sparse members as regular files, and reading one
fills its holes, so a 10 KB archive claiming a 1 GiB sparse member cost ~2 GB before it was
refused; a pax `size` past the archive's end surfaced as tarfile.ReadError. A canonical bundle
is plain ustar with regular members only, so anything else (sparse, pax or GNU extension
headers) is refused from the header, and every member must lie within the archive.

Why not `ast.parse`: a 4 MB module `x = 1+1+...+1` cost 814 MiB and a RecursionError while the
aggregator checked the bundle. Each module is capped (MAX_MODULE_BYTES, the entry module
MAX_ENTRY_BYTES), and the entry's top-level names are read from the token stream: linear
time, constant depth, nothing held but the current statement's state. Syntax errors are left
to the worker that imports the module (`fedgpu task check` runs one).
"""

from __future__ import annotations

import io
import keyword
import tarfile
import tokenize

from fedgpu.core.errors import FedgpuError

# Sources, not data: larger modules are generated data in disguise.
MAX_MODULE_BYTES = 1 << 20
# The entry module is the one read here (a token costs ~3 us: this is about a second at
# worst); an entry this large is better split into modules it imports.
MAX_ENTRY_BYTES = 256 << 10


class GuardError(FedgpuError):
    """A member or module the bounded checks refuse (bundles.py turns it into BundleError)."""


def check_member(info: tarfile.TarInfo, archive_size: int, read_so_far: int,
                 limit: int) -> None:
    """Refuse a member from its header alone: sparse or extended headers, data past the
    archive's end, total bytes past `limit`, oversized modules."""
    if info.type == tarfile.GNUTYPE_SPARSE or info.sparse is not None:
        raise GuardError(f"{info.name[:200]!r}: sparse member in a bundle; a bundle holds "
                         "plain regular files only")
    if info.pax_headers:
        raise GuardError(f"{info.name[:200]!r}: pax extended header in a bundle; bundles are "
                         "plain ustar")
    if info.size < 0 or info.offset_data + info.size > archive_size:
        raise GuardError(f"{info.name[:200]!r} claims {info.size} bytes, past the end of the "
                         f"{archive_size}-byte archive")
    if read_so_far + info.size > limit:
        raise GuardError(f"the bundle's files add up to more than {limit} bytes")
    if info.name.endswith(".py") and info.size > MAX_MODULE_BYTES:
        raise GuardError(f"{info.name[:200]!r} is {info.size} bytes; a module in a bundle is "
                         f"at most {MAX_MODULE_BYTES} bytes")


def top_level_names(source: bytes, path: str) -> set[str]:
    """Names a module binds at its top level: def/class, plain-name assignment targets,
    imports (the rules bundles.py applied to a syntax tree's body), from the token stream."""
    if len(source) > MAX_ENTRY_BYTES:
        raise GuardError(f"{path} is {len(source)} bytes; the entry module is at most "
                         f"{MAX_ENTRY_BYTES} bytes (move code into modules it imports)")
    scan = _Scan()
    try:
        for tok in tokenize.tokenize(io.BytesIO(source).readline):
            if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.ENCODING):
                scan.feed(tok)
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError) as exc:
        raise GuardError(f"{path}: not valid Python: {exc}") from None
    return scan.names


class _Scan:
    """A state machine over tokens that keeps a few fields per statement, never the tokens:
    a 4 MB one-line statement costs no more memory than a short one."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.indent = self.depth = 0
        self._new_statement()

    def _new_statement(self) -> None:
        self.first = ""            # the statement's first token
        self.mode = ""             # def | import | from | from-names
        self.prev = ""             # the previous token's text
        self.current = ""          # the name an import statement binds so far
        self.candidate = ""        # a NAME that would be bound if '=' came next

    def feed(self, tok: tokenize.TokenInfo) -> None:
        kind, text = tok.type, tok.string
        if kind == tokenize.INDENT:
            self.indent += 1
            return
        if kind == tokenize.DEDENT:
            self.indent -= 1
            return
        if kind in (tokenize.NEWLINE, tokenize.ENDMARKER) or (
                text == ";" and kind == tokenize.OP and self.depth == 0):
            self._bind_import()
            self._new_statement()
            return
        if kind == tokenize.OP and text in "([{":
            self.depth += 1
        elif kind == tokenize.OP and text in ")]}":
            self.depth = max(0, self.depth - 1)
        if self.indent == 0:
            self._top(kind, text)
        self.prev = text

    def _top(self, kind: int, text: str) -> None:
        first = not self.first
        if first:
            self.first = text
            if text in ("def", "class", "async"):
                self.mode = "def"
            elif text in ("import", "from"):
                self.mode = text
        if self.mode == "def":
            if kind == tokenize.NAME and text not in ("def", "class", "async"):
                self.names.add(text)
                self.mode = "done"
        elif self.mode in ("import", "from-names"):
            self._import_token(kind, text)
        elif self.mode == "from":
            if text == "import":
                self.mode = "from-names"
        elif kind == tokenize.OP and self.depth == 0 and (
                text == "=" or (text == ":" and self.prev == self.first)) and self.candidate:
            self.names.add(self.candidate)
        if kind == tokenize.NAME and not keyword.iskeyword(text) and self.depth == 0 and (
                first or self.prev == "="):
            self.candidate = text
        elif not (kind == tokenize.OP and text in ("=", ":")):
            self.candidate = ""

    def _import_token(self, kind: int, text: str) -> None:
        # import a.b as c, d  ->  c, d ;  from m import (x as y, z)  ->  y, z ;  from m import *
        if text == "*":
            self.names.add("*")
        elif kind == tokenize.NAME and text != "as" and self.prev in ("import", ",", "(",
                                                                        "as"):
            if self.prev != "as":
                self._bind_import()
            self.current = text
        elif text in (",", ")"):
            self._bind_import()

    def _bind_import(self) -> None:
        if self.current:
            self.names.add(self.current)
            self.current = ""
