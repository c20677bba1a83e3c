"""The documentation site: it builds strictly, every public name documents its arguments, and the built
site renders in a real headless browser without any request leaving the machine."""
import contextlib
import functools
import http.server
import importlib.util
import inspect
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import ampkit
from .blocks import REPO

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
needs_mkdocs = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                                  reason='needs the docs extra: python -m pip install -c constraints.txt -e ".[docs]"')
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (apt-get install chromium)")


# --- docstrings ----------------------------------------------------------------------------

def public_objects():
    """``(qualified name, object)`` for every function and class of ``ampkit.__all__`` and of its
    public submodules (their ``__all__``, else what the module defines itself)."""
    out = []
    for name in ampkit.__all__:
        obj = getattr(ampkit, name)
        if name == "__version__" or isinstance(obj, dict):
            continue
        if inspect.ismodule(obj):
            names = getattr(obj, "__all__", None) or [
                n for n, v in vars(obj).items() if not n.startswith("_") and getattr(v, "__module__", None) == obj.__name__]
            out += [(f"ampkit.{name}.{n}", getattr(obj, n)) for n in names if callable(getattr(obj, n))]
        elif callable(obj):
            out.append((f"ampkit.{name}", obj))
    return out


def undocumented_arguments(obj) -> list:
    """Parameters of ``obj`` (a class: of its ``__init__``) that its docstring never names."""
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and "__init__" in vars(obj):
        doc += "\n" + (inspect.getdoc(obj.__init__) or "")
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in params
            if p.kind not in variadic and p.name not in ("self", "cls") and not re.search(rf"\b{p.name}\b", doc)]


def test_every_public_name_has_a_docstring_that_names_its_arguments():
    objects = public_objects()
    assert len(objects) > 50  # the walk found the submodules' names too
    missing = [name for name, obj in objects if not inspect.getdoc(obj)]
    assert missing == [], f"no docstring: {missing}"
    gaps = {name: undocumented_arguments(obj) for name, obj in objects}
    assert {k: v for k, v in gaps.items() if v} == {}, "arguments the docstrings do not describe"


def test_the_check_sees_an_undocumented_argument():
    def f(alpha, beta=1, *args, **kwargs):
        """Use ``alpha``."""

    assert undocumented_arguments(f) == ["beta"]


# --- the build -----------------------------------------------------------------------------

FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")  # not in the docs extra


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built as the README's docs command builds it: with the docs extra alone, so the
    frameworks that ``ampkit.integrations`` imports fail to import (stand-ins that raise ImportError)."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip('needs the docs extra: python -m pip install -c constraints.txt -e ".[docs]"')
    out, blocked = tmp_path_factory.mktemp("site"), tmp_path_factory.mktemp("no_frameworks")
    for name in FRAMEWORKS:
        (blocked / name).mkdir()
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name}: not installed with the docs extra')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked), str(REPO)]), NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.slow
@needs_mkdocs
@pytest.mark.repo_files("mkdocs.yml", "docs")
def test_the_site_builds_strictly_with_the_generated_parts(site):
    level_page = (site / "choosing-a-level.html").read_text()
    from ampkit._config.levels import OPT_LEVELS

    for level in OPT_LEVELS:
        assert f"<td>{level}</td>" in level_page  # the generated table, one row per level
    assert 'href="api/index.html#ampkit.initialize"' in level_page  # a cross-reference (autorefs)
    api = (site / "api" / "index.html").read_text()
    for name in ("initialize", "scale_loss", "precision_report", "capabilities"):
        assert f'id="ampkit.{name}"' in api, name  # the public path, not the defining module's
    assert '<span class="n">fp8_exclude</span>' in api and "<code>fp8_exclude</code>" in api  # the written signature
    integrations = (site / "api" / "integrations.html").read_text()
    for name in ("lightning.AmpkitPrecision", "accelerate.AmpkitAccelerator", "transformers.AmpkitTrainer"):
        assert f'id="ampkit.integrations.{name}"' in integrations, name  # read statically: no framework imported
    layers = (site / "contributing.html").read_text()
    from tests.test_layers import LAYERS

    assert "<svg" in layers and all(f">{name}</text>" in layers for name, _ in LAYERS)  # the layer picture, every layer
    from ampkit._common.switches import SWITCHES

    assert all(f"<code>{sw.name}</code>" in (site / "environment.html").read_text() for sw in SWITCHES)
    assert "docs/benchmarks/data/" in (site / "benchmarks" / "index.html").read_text()  # the committed path, not a scratch one
    trouble = (site / "troubleshooting.html").read_text()
    assert "<td><code>initialize</code></td>" in trouble and re.search(r"\d+ bad inputs\.", trouble)  # the included table
    assert list((site / "benchmarks" / "figures").glob("*.png"))  # plotted from the committed JSON


@pytest.mark.slow
@needs_mkdocs
@pytest.mark.repo_files("mkdocs.yml", "docs")
def test_the_built_api_pages_show_public_paths_only(site):
    from .test_api_pages import BUILTIN_DOCS, ROLE, public_path_problem

    for page in sorted((site / "api").glob("*.html")):
        html = page.read_text()
        problems = [p for p in map(public_path_problem, re.findall(r'id="(ampkit\.[\w.]+)"', html)) if p]
        assert problems == [], page.name
        text = re.sub(r"<[^>]+>", "", html)
        assert [b for b in BUILTIN_DOCS if b in text] == [], f"{page.name} renders a builtin's docstring"
        assert not ROLE.search(text), f"{page.name} shows a raw Sphinx role"


OUTSIDE = re.compile(r"""<(?:script|link|img|iframe|source)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//""", re.I)


@pytest.mark.slow
@needs_mkdocs
@pytest.mark.repo_files("mkdocs.yml", "docs")
def test_no_page_loads_anything_from_outside(site):
    for page in site.rglob("*.html"):
        assert not OUTSIDE.search(page.read_text()), f"{page.relative_to(site)} loads a remote resource"
    for css in site.rglob("*.css"):
        assert not re.search(r"(?:url\(|@import)\s*['\"]?https?:", css.read_text()), css


# --- a real browser ------------------------------------------------------------------------

@contextlib.contextmanager
def recording_proxy():
    """A proxy on 127.0.0.1 that answers nothing and records every request line sent to it."""
    seen, server = [], socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1)
                with contextlib.suppress(OSError):
                    data = conn.recv(4096)
                    if data:  # chromium may open a connection to its proxy and close it unused: no request
                        seen.append(data.split(b"\r\n", 1)[0].decode(errors="replace"))
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], seen
    finally:
        stop.set()
        thread.join()
        server.close()


@contextlib.contextmanager
def serving(root: Path):
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    handler = functools.partial(handler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


# chromium's own services (updates, clock, sign-in, autofill), which it calls whatever the page:
# requests to these exact hosts are the browser's, not the site's (a CDN font host is not among them)
BROWSER_HOSTS = ("clients2.google.com", "update.googleapis.com", "accounts.google.com",
                 "content-autofill.googleapis.com", "optimizationguide-pa.googleapis.com", "safebrowsingohttpgateway.googleapis.com")


def from_the_page(requests: list) -> list:
    hosts = [re.match(r"\S+ (?:https?://)?([^/:\s]+)", r) for r in requests]
    return [r for r, h in zip(requests, hosts) if not (h and h[1] in BROWSER_HOSTS)]


def dump_dom(url: str, proxy_port: int, profile: Path) -> str:
    """The DOM after scripts ran, in headless chromium whose every non-loopback request goes to the proxy."""
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           "--disable-default-apps", "--disable-domain-reliability", f"--user-data-dir={profile}",
                           f"--proxy-server=http://127.0.0.1:{proxy_port}", "--virtual-time-budget=4000",
                           "--dump-dom", url], capture_output=True, text=True, timeout=120)
    return proc.stdout


@pytest.mark.slow
@needs_mkdocs
@needs_chromium
@pytest.mark.repo_files("mkdocs.yml", "docs")
def test_the_site_renders_in_a_browser_and_stays_on_the_machine(site, tmp_path):
    with recording_proxy() as (port, seen), serving(site) as base:
        index = dump_dom(f"{base}/index.html", port, tmp_path)
        guide = dump_dom(f"{base}/choosing-a-level.html", port, tmp_path)
    for dom in (index, guide):
        assert 'class="md-search__input"' in dom  # the search box
        assert "md-content" in dom and "md-nav" in dom
    assert "Where to go" in index and "Getting started" in index
    assert "Which level do I want" in guide and "stochastic" in guide and "<td>O8</td>" in guide
    assert from_the_page(seen) == [], f"requests that left the machine: {from_the_page(seen)}"


@pytest.mark.slow
@needs_chromium
def test_the_proxy_sees_a_request_to_the_outside(tmp_path):
    """The check above can fail: a page that loads a remote font reaches the proxy, and is not taken
    for the browser's own traffic."""
    page = tmp_path / "page.html"
    page.write_text('<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto"><p>x</p>')
    with recording_proxy() as (port, seen), serving(tmp_path) as base:
        dump_dom(f"{base}/page.html", port, tmp_path / "profile")
    assert any("fonts.googleapis.com" in line for line in from_the_page(seen)), seen
