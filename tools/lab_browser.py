"""JupyterLab on localhost, driven by headless Chromium with the network cut off.

Used by tests/test_lab.py and by tools/measure_renderers.py. Chromium is Debian's
`chromium` binary, driven through Playwright (no browser download).
"""

import contextlib
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from plumbing import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--no-first-run",
    # no network: every name but localhost fails to resolve, any proxy use goes nowhere
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--proxy-server=127.0.0.1:9",
]
# A chart is drawn when Vega has put its marks into an SVG or a canvas.
CHART = ".jp-OutputArea-output svg.marks, .jp-OutputArea-output canvas.marks"
# An output that shows an exception. JupyterLab 4 draws an exception with the renderer of
# stderr text, so it is told from a warning by its text: a traceback, or an error's name.
ERROR_OUTPUT = (
    "[data-mime-type='application/vnd.jupyter.error'],"
    " [data-mime-type='application/vnd.jupyter.stderr']"
)
ERROR_TEXT = re.compile(r"Traceback \(most recent call last\)|\b\w*(Error|Exception)\b")


@contextlib.contextmanager
def jupyterlab(root: Path, home: Path, env: dict | None = None, timeout: float = 60):
    """Serve `root` with JupyterLab on 127.0.0.1 with a random token; yield its base URL."""
    port, token = free_port(), secrets.token_hex(16)
    settings = home / "settings"
    # Lab's news and update checks would reach for the network: switch them off.
    notification = settings / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True, exist_ok=True)
    (notification / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false", "checkForUpdates": false}'
    )
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--allow-root",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={settings}",
        f"--LabApp.workspaces_dir={home / 'workspaces'}",
        "--LabApp.news_url=",
    ]
    run_env = {**os.environ, **(env or {}), "JUPYTER_RUNTIME_DIR": str(home / "runtime")}
    log = (home / "lab.log").open("wb")
    server = subprocess.Popen(command, env=run_env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"JupyterLab did not start: see {home / 'lab.log'}"
                    ) from None
                time.sleep(0.5)
        yield url, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@contextlib.contextmanager
def offline_page(width: int = 1400, height: int = 1000):
    """A Chromium page that may reach 127.0.0.1 only; yields (page, blocked request URLs)."""
    from playwright.sync_api import sync_playwright

    blocked: list[str] = []

    def gate(route):
        if route.request.url.startswith(("http://127.0.0.1", "ws://127.0.0.1", "file://")):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort("internetdisconnected")

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS
        )
        try:
            context = browser.new_context(viewport={"width": width, "height": height})
            context.route("**/*", gate)
            yield context.new_page(), blocked
        finally:
            browser.close()


def network_is_cut(page) -> bool:
    """True when the page cannot fetch from a public CDN."""
    return page.evaluate(
        """() => fetch("https://cdn.jsdelivr.net/npm/vega@5", {mode: "no-cors"})
                 .then(() => false, () => true)"""
    )


def open_notebook(page, url: str, token: str, name: str) -> None:
    """Open `name` in JupyterLab and wait until its kernel is idle."""
    page.goto(f"{url}/lab/tree/{name}?token={token}&reset")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    wait_idle(page, timeout=60)


def wait_idle(page, timeout: float) -> None:
    """Wait until no cell shows [*] (queued or running) and the kernel reports idle."""
    page.wait_for_function(
        """() => {
            const prompts = [...document.querySelectorAll('.jp-InputArea-prompt')];
            const busy = prompts.some(p => p.textContent.includes('*'));
            const status = document.querySelector('.jp-Notebook-ExecutionIndicator');
            const idle = !status || status.getAttribute('data-status') === 'idle';
            return !busy && idle;
        }""",
        timeout=timeout * 1000,
        polling=500,
    )


def charts_drawn(page) -> int:
    return page.locator(CHART).count()


def error_outputs(page) -> list[str]:
    """The text of every output that shows an exception."""
    return page.locator(ERROR_OUTPUT).filter(has_text=ERROR_TEXT).all_inner_texts()
