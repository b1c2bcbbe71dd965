"""The live dashboard: its JSON endpoint, and the page in a real headless Chromium
against the live stack under load (skipped when Chromium is absent)."""

from __future__ import annotations

import base64
import json
import re
import shutil
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.frontend.http.conftest import HttpStack
from tests.frontend.http.test_openai_api import get, random_prompt
from tests.frontend.test_frontend_server import wait_for

CHROMIUM = next((path for name in ("chromium", "chromium-browser", "google-chrome")
                 if (path := shutil.which(name))), None)
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars")
# Virtual time runs the page's timers fast while it waits for real network answers.
VIRTUAL_TIME_BUDGET_MS = 5000
SCREEN = (1280, 900)


def stats_json(stack: HttpStack) -> dict:
    status, body = get(stack.url, "/stats")
    assert status == 200
    return json.loads(body)


def test_stats_json_has_each_workers_block_map(http_stack: HttpStack):
    http_stack.wait_idle()
    client = http_stack.openai()
    client.completions.create(model=http_stack.model, prompt=random_prompt(5, 40), max_tokens=2)
    stats = stats_json(http_stack)
    assert stats["model"] == http_stack.model
    (worker,) = stats["workers"]
    cells = base64.b64decode(worker["block_map"])
    assert worker["worker_id"] == "w0" and worker["blocks_per_cell"] == 1
    assert len(cells) == worker["num_total_blocks"] == 63
    # Idle: nothing in use; the finished request's full blocks stay cached.
    assert cells.count(2) == 0
    assert cells.count(1) == worker["num_cached_free_blocks"] >= 2
    assert cells.count(0) == worker["num_free_blocks"] - worker["num_cached_free_blocks"]
    assert worker["num_generation_tokens"] >= 2
    assert isinstance(worker["prefix_cache_queries"], int)  # int64 as a JSON number
    assert worker["history_interval_s"] > 0
    # The one cell this frontend routes to: its scheduler, up, with its worker.
    (cell,) = stats["cells"]
    assert cell["connected"] and cell["num_workers"] == 1
    assert cell["routed_requests"]["load"] >= 1 and worker["cell_id"] == cell["cell_id"]


def test_dashboard_page_and_its_assets_are_served(http_stack: HttpStack):
    status, page = get(http_stack.url, "/dashboard")
    assert status == 200 and b"/dashboard/static/dashboard.js" in page
    for asset in ("dashboard.js", "dashboard.css"):
        status, body = get(http_stack.url, f"/dashboard/static/{asset}")
        assert status == 200 and body
    assert b"http://" not in page and b"https://" not in page  # nothing from elsewhere


def run_chromium(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    command = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
               f"--window-size={SCREEN[0]},{SCREEN[1]}",
               f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}", *args, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def dashboard_dom(url: str, profile: Path) -> str:
    result = run_chromium(url, profile, "--dump-dom")
    assert "<main" in result.stdout, result.stderr[-2000:]
    return result.stdout


def field(dom: str, name: str) -> str:
    match = re.search(rf'class="[^"]*\b{name}\b[^"]*">([^<]*)<', dom)
    assert match, f"no {name} in the page"
    return match.group(1)


@pytest.fixture
def load(http_stack: HttpStack) -> Iterator[None]:
    """Streams requests that share a prefix, in two threads, until the test ends."""
    done = threading.Event()
    shared = random_prompt(21, 48)

    def run(seed: int) -> None:
        client = http_stack.openai()
        while not done.is_set():
            prompt = shared + random_prompt(seed, 8)
            seed += 2
            for _ in client.completions.create(model=http_stack.model, prompt=prompt,
                                               max_tokens=48, stream=True,
                                               extra_body={"ignore_eos": True}):
                if done.is_set():
                    break

    threads = [threading.Thread(target=run, args=(seed,), daemon=True) for seed in (1, 2)]
    start_tokens = http_stack.stats().workers[0].num_generation_tokens
    for thread in threads:
        thread.start()
    # Steady load before the page looks: the first batches of two requests may
    # compile a new attention shape, which on a busy machine stalls the engine for
    # longer than two page loads take, and the numbers would not move between them.
    wait_for(lambda: http_stack.stats().workers[0].num_generation_tokens
             >= start_tokens + 4 * 48, timeout_s=120)
    wait_for(lambda: http_stack.stats().workers[0].num_running_reqs > 0, timeout_s=20)
    yield
    done.set()
    for thread in threads:
        thread.join(30)
    http_stack.wait_idle()


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian: apt-get install chromium)")
def test_dashboard_in_a_real_browser_shows_workers_and_moving_numbers(
        http_stack: HttpStack, load, tmp_path):
    url = f"{http_stack.url}/dashboard"
    first = dashboard_dom(url, tmp_path / "profile-1")
    assert 'data-worker-id="w0"' in first
    assert int(field(first, "num-used")) > 0  # requests are running: blocks in use
    assert int(re.search(r'id="updates">(\d+)<', first).group(1)) >= 2  # it polled, live
    assert field(first, "tokens-per-s") != ""
    cells = re.search(r'<table id="cells" class="cells">.*?</table>', first, re.S)
    assert cells and "<td>up</td>" in cells.group(0)  # shown, one cell, its stream up
    second = dashboard_dom(url, tmp_path / "profile-2")
    assert int(field(second, "generation-tokens")) > int(field(first, "generation-tokens"))
    screenshot = tmp_path / "dashboard.png"
    result = run_chromium(url, tmp_path / "profile-3", f"--screenshot={screenshot}")
    assert screenshot.exists(), result.stderr[-2000:]
    png = screenshot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == SCREEN
    # A blank page compresses to a few kilobytes; panels, maps and text do not.
    assert len(png) > 20_000
