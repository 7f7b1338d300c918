"""The real client: JupyterLab runs each edition, English and Chinese, up to its first chart,
with no network."""

import shutil

import pytest
from conftest import ROOT
from playwright.sync_api import expect

from tools.lab_browser import (
    CHROMIUM,
    charts_drawn,
    error_outputs,
    jupyterlab,
    network_is_cut,
    offline_page,
    open_notebook,
    wait_idle,
)

EDITIONS = {  # notebook -> its screenshot
    "annotated_transformer.ipynb": ROOT / "build" / "smoke" / "lab_first_chart.png",
    "annotated_transformer.zh-CN.ipynb": ROOT / "build" / "smoke" / "lab_first_chart.zh-CN.png",
}
FIRST_CHART = "alt.Chart(pe_frame"  # the positional-encoding chart (the same code in both)

pytestmark = [
    pytest.mark.slow,  # starts JupyterLab and a browser
    pytest.mark.skipif(
        CHROMIUM is None, reason="Chromium is not installed: apt-get install chromium"
    ),
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """One JupyterLab server for both editions, on copies (Lab may save; never touch ours)."""
    tmp_path = tmp_path_factory.mktemp("lab")
    root = tmp_path / "project"
    root.mkdir()
    for notebook in EDITIONS:
        shutil.copy(ROOT / notebook, root / notebook)
    env = {"AT_PRESET": "smoke", "AT_BUILD_DIR": str(tmp_path / "build")}
    with jupyterlab(root, tmp_path / "home", env=env) as (url, token):
        yield url, token


@pytest.mark.parametrize("notebook", EDITIONS)
def test_jupyterlab_draws_the_first_chart_offline(notebook, lab):
    url, token = lab
    screenshot = EDITIONS[notebook]
    with offline_page(height=1200) as (page, blocked):
        open_notebook(page, url, token, notebook)
        kernel = page.locator("[data-jp-item-name='kernelName']")
        expect(kernel).to_have_text("Annotated Transformer (.venv)", timeout=30_000)
        # Select the chart's cell, then Run › Run All Above Selected Cell, then Shift+Enter.
        cell = page.locator(".jp-CodeCell").filter(has_text=FIRST_CHART)
        cell.locator(".jp-InputArea-prompt").click()
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_text("Run All Above Selected Cell", exact=True).click()
        page.wait_for_timeout(1000)
        wait_idle(page, timeout=120)
        cell.locator(".jp-InputArea-prompt").click()
        page.keyboard.press("Shift+Enter")
        cell.locator(".jp-OutputArea-output svg.marks, canvas.marks").wait_for(timeout=60_000)
        cell.scroll_into_view_if_needed()
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=screenshot)
        assert charts_drawn(page) == 1
        assert error_outputs(page) == []
        assert network_is_cut(page), "Chromium could reach the internet"
        assert all(not u.startswith("http://127.0.0.1") for u in blocked)
    assert screenshot.stat().st_size > 20_000  # a blank page compresses to under 10 kB
