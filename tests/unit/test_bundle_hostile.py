"""Hostile task bundles (issue 24): archives and modules built to make whoever checks them
(the aggregator at submission, a node at fetch) allocate, recurse or crash. Each is refused
as a BundleError with a bounded message, in bounded memory and time. Archives are made byte
by byte with tarfile, as an attacker would, never through the packer."""

from __future__ import annotations

import io
import tarfile
import time
import tracemalloc

import pytest

from fedgpu.core import bundle_guard
from fedgpu.core.bundles import BundleError, open_archive, pack_files

MANIFEST = b'name = "demo"\nentry = "demo_task.model:DemoTask"\n'
MODEL = b"class DemoTask:\n    pass\n"


def files(**extra: bytes) -> dict[str, bytes]:
    base = {"fedgpu-task.toml": MANIFEST, "demo_task/model.py": MODEL}
    base.update(extra)
    return base


def tar_of(fmt: int, members: dict[str, bytes], patch: dict[str, dict[str, str]] | None = None,
           sparse: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            if patch and name in patch:
                info.pax_headers = patch[name]
            tar.addfile(info, io.BytesIO(data))
    raw = bytearray(buf.getvalue())
    if sparse is not None:
        _make_sparse(raw, sparse)
    return bytes(raw)


def _make_sparse(raw: bytearray, name: str, claimed: int = 1 << 30) -> None:
    """Turn member `name` of a GNU-format archive into a sparse member claiming `claimed`
    bytes: one tiny data region at the end of a 1 GiB hole."""
    offset = 0
    while offset < len(raw):
        header = raw[offset:offset + 512]
        if header[:len(name)] == name.encode():
            break
        size = int(header[124:136].strip(b"\0 ") or b"0", 8)
        offset += 512 + (size + 511) // 512 * 512
    else:
        raise AssertionError(f"no member {name}")
    header = raw[offset:offset + 512]
    header[156:157] = b"S"
    # GNU sparse map: (offset, numbytes) of the data, then the real (claimed) size.
    header[386:398] = f"{claimed - 16:011o}\0".encode()
    header[398:410] = f"{16:011o}\0".encode()
    header[483:495] = f"{claimed:011o}\0".encode()
    header[148:156] = b" " * 8
    checksum = sum(header)
    header[148:156] = f"{checksum:06o}\0 ".encode()
    raw[offset:offset + 512] = header


def refused(data: bytes, match: str) -> str:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(BundleError, match=match) as err:
            open_archive(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"checking the archive took {peak >> 20} MiB"
    assert time.perf_counter() - started < 20
    message = str(err.value)
    assert len(message) < 1000
    return message


def test_a_sparse_member_claiming_a_gibibyte_is_refused_from_its_header() -> None:
    # ~10 KB on the wire; tarfile reports it as a regular file and read() fills its holes.
    data = tar_of(tarfile.GNU_FORMAT, files(), sparse="demo_task/model.py")
    assert len(data) < 20_000
    info = tarfile.open(fileobj=io.BytesIO(data)).getmember("demo_task/model.py")
    assert info.isreg() and info.size == 1 << 30  # what made the old check pass
    refused(data, "sparse member")


def test_a_pax_size_past_the_archive_is_refused() -> None:
    # tarfile.ReadError escaped BundleError: the Admin call answered UNKNOWN.
    data = tar_of(tarfile.PAX_FORMAT, files(),
                  patch={"demo_task/model.py": {"size": str(1 << 30)}})
    refused(data, "pax extended header|past the end")


def test_a_pax_header_claiming_a_gibibyte_is_refused() -> None:
    good = pack_files(files())
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = 1 << 30
    head = info.tobuf(format=tarfile.USTAR_FORMAT)
    refused(head + b"30 path=demo_task/model.py\n".ljust(512, b"\0") + good, "tar")
    refused(good[:-1024] + head + b"\0" * 1024, "pax|canonical|tar")


def test_a_manifest_nested_too_deep_is_refused() -> None:
    deep = b"x = " + b"[" * 20_000 + b"]" * 20_000 + b"\n"
    data = pack_files(files(**{"fedgpu-task.toml": deep[:60_000]}))
    refused(data, "nested too deep|not valid TOML")
    huge_int = b'name = "demo"\nentry = "demo_task.model:DemoTask"\nx = ' + b"9" * 5000
    refused(pack_files(files(**{"fedgpu-task.toml": huge_int})), "not valid TOML")


def test_an_oversized_entry_module_is_refused_before_it_is_read() -> None:
    # 4 MB of `1+1+...+1`: ast.parse took +814 MiB and ended in a RecursionError.
    huge = b"class DemoTask:\n    pass\nx = " + b"1+" * (2 << 20) + b"1\n"
    message = refused(pack_files(files(**{"demo_task/model.py": huge})),
                      f"at most {bundle_guard.MAX_MODULE_BYTES} bytes")
    assert "demo_task/model.py" in message
    # An entry module under the module cap but over the entry's: refused before it is read.
    big = b"class DemoTask:\n    pass\n" + b"# padding\n" * (30 << 10)
    refused(pack_files(files(**{"demo_task/model.py": big})),
            f"entry module is at most {bundle_guard.MAX_ENTRY_BYTES} bytes")


def test_a_deep_expression_under_the_cap_is_read_in_bounded_memory() -> None:
    # Far past what ast.parse can take (it gives up on 10,000 terms).
    deep = b"x = " + b"1+" * 30_000 + b"1\nclass DemoTask:\n    pass\n"
    assert len(deep) < bundle_guard.MAX_ENTRY_BYTES
    tracemalloc.start()
    try:
        bundle = open_archive(pack_files(files(**{"demo_task/model.py": deep})))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert bundle.manifest.attribute == "DemoTask"
    assert peak < 32 << 20, f"{peak >> 20} MiB"
    with pytest.raises(BundleError, match="defines no top-level 'DemoTask'"):
        open_archive(pack_files(files(**{"demo_task/model.py": deep.replace(b"DemoTask",
                                                                             b"Other")})))


@pytest.mark.parametrize(("source", "names"), [
    (b"class DemoTask:\n    x = 1\n", {"DemoTask"}),
    (b"@decorate\ndef f(a=1):\n    g = 2\nasync def h():\n    pass\n", {"f", "h"}),
    (b"import a.b as c, d\nimport e.f\n", {"c", "d", "e"}),
    (b"from m import (x as y,\n    z)\nfrom .impl import Impl as DemoTask\n",
     {"y", "z", "DemoTask"}),
    (b"from q import *\n", {"*"}),
    (b"a = b = 1\nc: int = 2\nd: str\nr = 1; s = 2\n", {"a", "b", "c", "d", "r", "s"}),
    (b"if x:\n    hidden = 1\nelse:\n    other = 2\nif y: inline = 3\n", set()),
    (b"t[0] = 1\nu.v = 2\nf(k=1)\nn += 1\nw == 3\n(lambda q: q)(1)\n", set()),
    (b'"""a docstring\nDemoTask = 1\n"""\n# DemoTask = 2\n', set()),
])
def test_top_level_names_are_read_from_tokens_as_from_the_syntax_tree(
        source: bytes, names: set[str]) -> None:
    assert bundle_guard.top_level_names(source, "m.py") == names


def test_source_that_does_not_tokenize_is_refused() -> None:
    with pytest.raises(bundle_guard.GuardError, match="not valid Python"):
        bundle_guard.top_level_names(b"class DemoTask:\n    x = (\n", "m.py")
