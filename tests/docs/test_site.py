"""The documentation site builds with `mkdocs build --strict`, offline, and its internal links
and anchors resolve: a broken one fails the build (MkDocs 1.6 `validation`, set to warn, and
--strict turns warnings into errors)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures.doc_blocks import ROOT

MKDOCS = [sys.executable, "-m", "mkdocs"]


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # Every proxy variable pointing nowhere: a build that tried to fetch would fail, not hang.
    env.update({k: "http://127.0.0.1:9" for k in ("http_proxy", "https_proxy", "HTTP_PROXY",
                                                   "HTTPS_PROXY", "ALL_PROXY")})
    return subprocess.run([*MKDOCS, "build", "--strict", "--site-dir", str(site)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = build(ROOT, out)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def _config() -> dict:
    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml may use MkDocs' own tags; none is needed to read the keys checked here.
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *a: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def test_the_site_builds_strict_with_every_page_in_nav(site: Path) -> None:
    config = _config()
    assert config["strict"] is True
    assert config["validation"]["anchors"] == "warn"
    assert config["validation"]["omitted_files"] == "warn"
    for page in ("tutorials/first-federation", "reference/cli", "reference/job-file",
                 "reference/environment", "explanation/architecture", "measurements/benchmarks"):
        assert (site / f"{page}.html").is_file(), page
    # BENCHMARKS.md stays at the top of the repository and is included, not copied.
    assert "FedAvg of K updates" in (site / "measurements/benchmarks.html").read_text()


def test_the_site_needs_no_network(site: Path) -> None:
    config = _config()
    assert config["theme"]["font"] is False, "theme.font must be false: no Google Fonts"
    plugins = [p if isinstance(p, str) else next(iter(p)) for p in config.get("plugins", [])]
    assert not {"privacy", "social", "blog"} & set(plugins), plugins
    external = re.compile(r"""<(?:script|link|img)\b[^>]*\b(?:src|href)=["']https?://""")
    for page in site.rglob("*.html"):
        found = external.findall(page.read_text())
        assert not found, f"{page.relative_to(site)} loads {found[:3]} from the network"


def test_generated_reference_is_in_the_built_pages(site: Path) -> None:
    cli = (site / "reference/cli.html").read_text()
    assert 'id="fedgpu-job-submit"' in cli and "FEDGPU_AGGREGATOR" in cli
    keys = (site / "reference/job-file.html").read_text()
    assert "round_deadline_s" in keys and "min_gpu_free_mib" in keys
    assert "<!-- generated:" not in cli + keys


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(ROOT / "tools", tmp_path / "tools")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    shutil.copy(ROOT / "BENCHMARKS.md", tmp_path)
    page = tmp_path / "docs" / "how-to" / "upgrading.md"
    original = page.read_text()
    page.write_text(original + "\nSee [the checks](troubleshooting.md#no-such-heading) and "
                    "[a page](no-such-page.md).\n")
    r = build(tmp_path, tmp_path / "site")
    # Both are reported, naming the page and the link; nothing is built.
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "no-such-heading" in out and "no-such-page.md" in out and "upgrading.md" in out, out
