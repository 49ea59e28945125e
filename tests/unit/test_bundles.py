"""The task bundle format (fedgpu/core/bundles.py): deterministic packing, and every archive
safety rule refused with a message that names it. Archives are made byte by byte with tarfile,
as a hostile or careless producer would, not through the packer under test."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from fedgpu.core import bundle_requires, bundles
from fedgpu.core.bundles import BundleError, open_archive, pack_dir, pack_files, unpack

MANIFEST = 'name = "demo"\nentry = "demo_task.model:DemoTask"\n'
MODEL = "class DemoTask:\n    name = 'demo'\n"


def task_dir(root: Path, manifest: str = MANIFEST, model: str = MODEL) -> Path:
    d = root / "task"
    (d / "demo_task").mkdir(parents=True)
    (d / "fedgpu-task.toml").write_text(manifest)
    (d / "demo_task" / "__init__.py").write_text("")
    (d / "demo_task" / "model.py").write_text(model)
    return d


def files(**extra: bytes) -> dict[str, bytes]:
    base = {"fedgpu-task.toml": MANIFEST.encode(), "demo_task/__init__.py": b"",
            "demo_task/model.py": MODEL.encode()}
    base.update(extra)
    return base


def raw_tar(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    """An archive with exactly these members, in this order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.mode = 0o644
    return info


def good_members() -> list[tuple[tarfile.TarInfo, bytes]]:
    return [(member(k), v) for k, v in sorted(files().items())]


# ---- packing ---------------------------------------------------------------------------


def test_the_same_sources_give_the_same_hash_whatever_the_file_system_says(
        tmp_path: Path) -> None:
    d = task_dir(tmp_path)
    first = pack_dir(d)
    # Timestamps, permissions and byte-code caches are not part of the sources.
    for path in d.rglob("*"):
        os.utime(path, (1, 1))
    (d / "demo_task" / "model.py").chmod(0o600)
    (d / "demo_task" / "__pycache__").mkdir()
    (d / "demo_task" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0" * 40)
    (d / ".git").mkdir()
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (d / "notes.pyc").write_bytes(b"x")
    again = pack_dir(d)
    assert again.sha256 == first.sha256 and again.data == first.data
    assert sorted(first.files) == ["demo_task/__init__.py", "demo_task/model.py",
                                   "fedgpu-task.toml"]


def test_one_byte_changed_is_another_bundle(tmp_path: Path) -> None:
    d = task_dir(tmp_path)
    before = pack_dir(d).sha256
    text = (d / "demo_task" / "model.py").read_bytes()
    (d / "demo_task" / "model.py").write_bytes(text.replace(b"'demo'", b"'demO'"))
    assert pack_dir(d).sha256 != before


def test_the_archive_is_canonical_ustar(tmp_path: Path) -> None:
    bundle = pack_dir(task_dir(tmp_path))
    with tarfile.open(fileobj=io.BytesIO(bundle.data), mode="r:") as tar:
        infos = tar.getmembers()
    assert [i.name for i in infos] == sorted(i.name for i in infos)
    assert {(i.mtime, i.mode, i.uid, i.gid, i.uname, i.gname, i.type) for i in infos} == {
        (0, 0o644, 0, 0, "", "", tarfile.REGTYPE)}
    assert bundle.sha256 == bundles.digest(bundle.data)


def test_unpack_writes_the_files(tmp_path: Path) -> None:
    bundle = open_archive(pack_files(files()))
    out = unpack(bundle, tmp_path / "out")
    assert (out / "demo_task" / "model.py").read_text() == MODEL
    with pytest.raises(FileExistsError):
        unpack(bundle, tmp_path / "out")  # never over an existing directory


# ---- archive safety: each rule, a message naming it -------------------------------------


def test_absolute_path_refused() -> None:
    data = raw_tar(*good_members(), (member("/etc/cron.d/x"), b"evil"))
    with pytest.raises(BundleError, match="absolute path"):
        open_archive(data)


def test_dot_dot_refused() -> None:
    data = raw_tar(*good_members(), (member("demo_task/../../outside.py"), b"evil"))
    with pytest.raises(BundleError, match=r"'\.\.' would leave"):
        open_archive(data)


def test_symlink_in_archive_refused() -> None:
    data = raw_tar(*good_members(), (member("demo_task/link.py", tarfile.SYMTYPE,
                                            "/etc/passwd"), b""))
    with pytest.raises(BundleError, match="symbolic link"):
        open_archive(data)


def test_hard_link_in_archive_refused() -> None:
    data = raw_tar(*good_members(), (member("demo_task/x.py", tarfile.LNKTYPE,
                                            "fedgpu-task.toml"), b""))
    with pytest.raises(BundleError, match="hard link"):
        open_archive(data)


def test_device_file_in_archive_refused() -> None:
    data = raw_tar(*good_members(), (member("demo_task/mem", tarfile.CHRTYPE), b""))
    with pytest.raises(BundleError, match="device file"):
        open_archive(data)


def test_symlink_in_directory_refused(tmp_path: Path) -> None:
    d = task_dir(tmp_path)
    (d / "demo_task" / "secret.py").symlink_to("/etc/hostname")
    with pytest.raises(BundleError, match="symbolic link"):
        pack_dir(d)


def test_fifo_in_directory_refused(tmp_path: Path) -> None:
    d = task_dir(tmp_path)
    os.mkfifo(d / "demo_task" / "pipe")
    with pytest.raises(BundleError, match="FIFO"):
        pack_dir(d)


def test_over_the_size_limit_refused(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="over the limit"):
        open_archive(b"\0" * (bundles.MAX_BUNDLE_BYTES + 1))
    d = task_dir(tmp_path)
    (d / "weights.bin").write_bytes(b"\0" * (bundles.MAX_BUNDLE_BYTES + 1))
    with pytest.raises(BundleError, match="more than 32 MiB"):
        pack_dir(d)


def test_too_many_files_refused(tmp_path: Path) -> None:
    many = files(**{f"demo_task/m{i}.py": b"" for i in range(bundles.MAX_BUNDLE_FILES)})
    data = raw_tar(*[(member(k), v) for k, v in sorted(many.items())])
    with pytest.raises(BundleError, match=f"more than {bundles.MAX_BUNDLE_FILES} files"):
        open_archive(data)
    d = task_dir(tmp_path)
    for i in range(bundles.MAX_BUNDLE_FILES):
        (d / "demo_task" / f"m{i}.py").write_text("")
    with pytest.raises(BundleError, match=f"more than {bundles.MAX_BUNDLE_FILES} files"):
        pack_dir(d)


def test_manifest_whose_entry_module_is_missing_refused() -> None:
    data = pack_files(files(**{"fedgpu-task.toml": b'name = "demo"\n'
                                                   b'entry = "demo_task.nothere:DemoTask"\n'}))
    with pytest.raises(BundleError, match="neither demo_task/nothere.py nor"):
        open_archive(data)


def test_manifest_whose_entry_attribute_is_missing_refused() -> None:
    data = pack_files(files(**{"demo_task/model.py": b"class Other:\n    pass\n"}))
    with pytest.raises(BundleError, match="defines no top-level 'DemoTask'"):
        open_archive(data)


def test_entry_found_through_an_import_or_assignment() -> None:
    for source in (b"from demo_task.impl import DemoTask\n", b"DemoTask = object\n",
                   b"from .impl import Impl as DemoTask\n"):
        open_archive(pack_files(files(**{"demo_task/model.py": source})))


def test_no_manifest_refused(tmp_path: Path) -> None:
    d = task_dir(tmp_path)
    (d / "fedgpu-task.toml").unlink()
    with pytest.raises(BundleError, match="has no fedgpu-task.toml"):
        pack_dir(d)
    data = pack_files({k: v for k, v in files().items() if k != "fedgpu-task.toml"})
    with pytest.raises(BundleError, match="no fedgpu-task.toml"):
        open_archive(data)


@pytest.mark.parametrize(("manifest", "message"), [
    ('name = "demo"\nentry = "demo_task.model:DemoTask"\nversion = 2\n', "unknown key"),
    ('name = "no spaces"\nentry = "demo_task.model:DemoTask"\n', "'name' must be"),
    ('name = "demo"\nentry = "demo_task.model"\n', "'entry' must be"),
    ('name = "demo"\nentry = "demo_task.model:DemoTask"\nrequires = "numpy"\n',
     "'requires' must be a list"),
    ('name = "demo"\nentry = "demo_task.model:DemoTask"\nrequires = ["numpy >>> 1"]\n',
     "is not a requirement"),
    ('name = "demo"\nentry = \n', "not valid TOML"),
])
def test_bad_manifests_refused(manifest: str, message: str) -> None:
    with pytest.raises(BundleError, match=message):
        bundles.parse_manifest(manifest)


def test_archive_not_in_canonical_form_refused() -> None:
    infos = good_members()
    infos[0][0].mtime = 1_700_000_000  # a tar made by `tar -cf`, with real timestamps
    with pytest.raises(BundleError, match="not in canonical form"):
        open_archive(raw_tar(*infos))
    # Unsorted entries: the same files, another hash, so refused too.
    with pytest.raises(BundleError, match="not in canonical form"):
        open_archive(raw_tar(*reversed(good_members())))


def test_directory_entries_and_compressed_archives_refused() -> None:
    with pytest.raises(BundleError, match="directory entry"):
        open_archive(raw_tar((member("demo_task", tarfile.DIRTYPE), b""), *good_members()))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in good_members():
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(BundleError, match="not an uncompressed tar"):
        open_archive(buf.getvalue())


def test_content_that_does_not_match_the_expected_hash_refused() -> None:
    data = pack_files(files())
    with pytest.raises(BundleError, match="does not match its hash"):
        open_archive(data, "0" * 64)


def test_requirements_checked_against_installed_metadata() -> None:
    import numpy

    assert bundle_requires.unmet_requirements(["numpy>=1.0", f"numpy=={numpy.__version__}",
                                       'missing-dist; python_version < "3"']) == []
    problems = bundle_requires.unmet_requirements(["numpy>=999", "surely-not-installed-dist>=1"])
    assert problems == [f"numpy>=999: numpy {numpy.__version__} is installed",
                        "surely-not-installed-dist>=1: surely-not-installed-dist is not "
                        "installed"]
