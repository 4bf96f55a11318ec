"""blocklab explore in a real browser: headless Chromium (Debian's chromium and chromium-driver, driven by
Selenium) clicks, drags and toggles, and every number read off the page is checked against the JSON of
the command the page names, run here as the CLI.

    python -m pytest tests/test_explore_browser.py            # a tiny random model, made here
    BLOCKLAB_EXPLORE_MODEL=builtin python -m pytest tests/test_explore_browser.py   # docs/img's pictures

Each view is photographed: on a model named by BLOCKLAB_EXPLORE_MODEL into docs/img/explore_*.png (the
README's and docs' pictures), on the tiny model into the test's temporary folder, so that a plain test
run leaves the pictures in the repository alone. Without Chromium or Selenium the tests skip and say
which is missing (.ci/run installs both where it can).
"""

import contextlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import pytest
from test_explore import Commands, save_tiny_model, write_text

from lab.analysis.common import fmt
from lab.plan import Point, cheapest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = os.environ.get("BLOCKLAB_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("BLOCKLAB_CHROMEDRIVER", "/usr/bin/chromedriver")
DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
KEY = "k3y-for-the-test"


def pct(share: float) -> str:  # the CLI's f"{100 * share:.1f}%"
    return f"{100 * share:.1f}%"


def signed_pct(share: float) -> str:
    return f"{100 * share:+.1f}%"


def without_plots(command: str) -> str:
    """The page's command with ``--no-plot`` (the same JSON but ``png``; no matplotlib in the process)."""
    return command.replace(" --json", " --no-plot --json")


@pytest.fixture(scope="module")
def webdriver():
    selenium = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (the dev extra has it)"
    )
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if missing:
        pytest.skip(
            f"no headless Chromium: {', '.join(missing)} not found (apt-get install chromium chromium-driver)"
        )
    from selenium.webdriver.chrome.service import Service

    options = selenium.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--window-size=1280,1000",
        "--disable-extensions",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SE_OFFLINE", "true")  # Selenium Manager must not look for a driver online
        driver = selenium.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


@contextlib.contextmanager
def explore_server(*args: str, env: dict[str, str]):
    """``blocklab explore ARGS --port 0`` started as a user starts it, with ``env`` added to the
    environment; the address it prints."""
    command = [sys.executable, "-m", "lab.cli", "explore", *args, "--port", "0"]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env}
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()
    try:
        url = None
        while url is None:
            line = lines.get(timeout=120)
            assert server.poll() is None, line
            url = (re.search(r"http://127\.0\.0\.1:\d+/", line) or [None])[0]
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory):
    root = tmp_path_factory.mktemp("explore_browser")
    model = os.environ.get("BLOCKLAB_EXPLORE_MODEL") or str(save_tiny_model(root / "tiny"))
    return model, write_text(root / "text.txt"), root


@pytest.fixture(scope="module")
def cli(model_and_text):
    """The commands the page names, run as the CLI (started first: its imports overlap the server's)."""
    runner = Commands(model_and_text[2])
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def page(webdriver, model_and_text, cli):
    """The page of ``blocklab explore --model M --text F``, with an API key in blocklab serve's variable,
    open in the browser: it asks for the key, gets it typed in, and draws its first view."""
    model, text, root = model_and_text
    with explore_server("--model", model, "--text", str(text), env={"LIT_SERVER_API_KEY": KEY}) as url:
        webdriver.get(url)
        wait_for(webdriver, lambda d: find(d, "#key-form").is_displayed())
        find(webdriver, "#api-key").send_keys(KEY)
        find(webdriver, "#key-form button").click()
        wait_for(webdriver, lambda d: find(d, "body").get_attribute("data-ready") == "true")
        pictures = DOCS_IMG if os.environ.get("BLOCKLAB_EXPLORE_MODEL") else root / "img"
        yield {"driver": webdriver, "url": url, "cwd": root, "pictures": pictures}


def wait_for(driver, condition, timeout: float = 300):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(condition)


def find(driver, css: str):
    return driver.find_element("css selector", css)


def texts(driver, css: str) -> list[str]:
    return [e.text for e in driver.find_elements("css selector", css)]


def open_view(driver, name: str, ready_css: str):
    find(driver, f'nav button[data-view="{name}"]').click()
    wait_for(driver, lambda d: d.find_elements("css selector", ready_css))


def screenshot(page, name: str) -> None:
    """The whole page, as tall as it is, to ``page["pictures"]``/explore_NAME.png."""
    driver = page["driver"]
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, max(800, height + 20))
    page["pictures"].mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(page["pictures"] / f"explore_{name}.png"))
    driver.set_window_size(1280, 1000)


def page_commands(driver, view: str) -> list[str]:
    return texts(driver, f"#view-{view} p.command code")


def test_block_view_click_a_tensor_and_drag_T(page, cli):
    from selenium.webdriver.common.keys import Keys

    d = page["driver"]
    T0 = int(find(d, "#t-input").get_attribute("value"))
    find(d, 'button.tensor[data-hook="mlp.hidden"]').click()
    hidden = {
        k: find(d, f'#tensor-detail [data-key="{k}"]').text for k in ("shape", "params", "flops_per_token")
    }
    shapes_at_T0 = page_commands(d, "block")[0]
    slider = find(d, "#t-slider")
    slider.send_keys(Keys.ARROW_RIGHT, Keys.ARROW_RIGHT)  # the keyboard moves it: two values up
    T1 = int(find(d, "#t-input").get_attribute("value"))
    assert T1 > T0
    wait_for(d, lambda d: find(d, "#view-block").get_attribute("data-t") == str(T1))
    find(d, 'button.tensor[data-hook="attn.scores"]').click()
    scores = {
        k: find(d, f'#tensor-detail [data-key="{k}"]').text
        for k in ("shape", "flops_per_token", "mixes_positions")
    }
    model_flops = {
        k: find(d, f'#flops-panel [data-key="{k}"]').text
        for k in ("linear", "attention", "total", "attention_share", "crossover_T_blocks")
    }
    screenshot(page, "block")
    shapes_at_T1, flops_at_T1 = page_commands(d, "block")
    assert f"--T {T1}" in shapes_at_T1 and f"--T {T1}" in flops_at_T1

    cli0, cli1, cli_flops = cli.run(shapes_at_T0, shapes_at_T1, without_plots(flops_at_T1))
    row = next(r for r in cli0["rows"] if r["hook"] == "mlp.hidden")
    assert hidden == {
        "shape": str(row["shape"]),
        "params": fmt(row["params"]),
        "flops_per_token": fmt(row["flops_per_token"]),
    }
    row = next(r for r in cli1["rows"] if r["hook"] == "attn.scores")
    assert scores == {
        "shape": str(row["shape"]),
        "flops_per_token": fmt(row["flops_per_token"]),
        "mixes_positions": "yes",
    }
    flops = cli_flops["rows"][0]
    assert model_flops == {
        "linear": fmt(flops["linear"]),
        "attention": fmt(flops["attention"]),
        "total": fmt(flops["total"]),
        "attention_share": pct(flops["attention_share"]),
        "crossover_T_blocks": f"{cli_flops['crossover_T_blocks']:,.0f}",
    }


def test_parameters_view(page, cli):
    d = page["driver"]
    open_view(d, "params", "#design-detail table")
    yours = {
        k: find(d, f'#design-detail [data-key="{k}"]').text for k in ("total", "feed_forward_share_of_block")
    }
    find(d, 'button.design-name[data-design="llama3.1-8b"]').click()
    llama = {
        k: find(d, f'#design-detail [data-key="{k}"]').text
        for k in ("total", "attention_share_of_block", "token_table_share")
    }
    screenshot(page, "params")
    cli_model, cli_all = cli.run(*page_commands(d, "params"))
    assert yours == {
        "total": fmt(cli_model["total"]),
        "feed_forward_share_of_block": pct(cli_model["feed_forward_share_of_block"]),
    }
    want = next(r for r in cli_all["designs"] if r["design"] == "llama3.1-8b")
    assert llama == {
        "total": fmt(want["total"]),
        "attention_share_of_block": pct(want["attention_share_of_block"]),
        "token_table_share": pct(want["token_table_share"]),
    }


def test_bus_and_ablation_views_toggle_overwrite_and_pick_a_block(page, cli):
    from selenium.webdriver.common.keys import Keys

    d = page["driver"]
    open_view(d, "bus", "#bus-table")
    embed = find(d, '#bus-body [data-key="embed"]').text
    table = [row.split() for row in texts(d, "#bus-table tbody tr")]
    screenshot(page, "bus")
    bus_command = page_commands(d, "bus")[0]

    open_view(d, "ablate", "#block-norms dl")
    find(d, "#mode-overwrite").send_keys(Keys.SPACE)  # the toggle, by keyboard
    wait_for(d, lambda d: find(d, "#view-ablate").get_attribute("data-mode") == "overwrite")
    blocks = d.find_elements("css selector", "#ablate-body .bar-mark")
    block = len(blocks) // 2
    blocks[block].click()
    wait_for(d, lambda d: find(d, "#block-norms h3").text == f"block {block}")
    overwrite = find(d, '#block-norms [data-key="overwrite"]').text
    norms = {
        k: find(d, f'#block-norms [data-key="{k}"]').text
        for k in ("embed", "attn_out", "mlp_out", "resid_post")
    }
    lines = {k: find(d, f'#ablate-body [data-key="{k}"]').text for k in ("intact", "uniform")}
    screenshot(page, "ablate")

    cli_bus, cli_ablate = cli.run(without_plots(bus_command), without_plots(page_commands(d, "ablate")[0]))
    assert embed == fmt(cli_bus["embed"])
    keys = ["block", "resid_pre", "attn_share", "mlp_share", "resid_post", "cosine_in_out", "bookkeeping"]
    assert table == [[fmt(r[k]) for k in keys] for r in cli_bus["rows"]]
    r = cli_ablate["rows"][block]
    assert overwrite == f"{fmt(r['overwrite'])} ({signed_pct(r['overwrite_change'])})"
    b = cli_bus["rows"][block]
    assert norms == {
        "embed": fmt(cli_bus["embed"]),
        "attn_out": fmt(b["attn_out"]),
        "mlp_out": fmt(b["mlp_out"]),
        "resid_post": fmt(b["resid_post"]),
    }
    assert lines == {"intact": fmt(cli_ablate["intact"]), "uniform": fmt(cli_ablate["uniform"])}


def test_depth_measured_here_and_loaded_from_its_json(page, cli, tmp_path):
    d = page["driver"]
    open_view(d, "frontier", "#depth-form")
    for field, value in (("stacks", "1x32 2x16"), ("baseline", "1x32"), ("new", "3"), ("repeats", "1")):
        box = find(d, f"#depth-{field}")
        box.clear()
        box.send_keys(value)
    find(d, "#depth-form button").click()
    wait_for(d, lambda d: d.find_elements("css selector", "#depth-table"))
    measured = [row.split() for row in texts(d, "#depth-table tbody tr")]
    depth_command = page_commands(d, "frontier")[0]
    (cli_depth,) = cli.run(without_plots(depth_command))
    # a timing differs from run to run: the parameters must agree, and a saved run must show as it is
    assert [(row[0], row[4]) for row in measured] == [
        (r["stack"], fmt(r["block_params"])) for r in cli_depth["rows"]
    ]
    saved = tmp_path / "depth.json"
    saved.write_text(json.dumps(cli_depth))
    find(d, "#json-file").send_keys(str(saved))
    wait_for(d, lambda d: "loaded from a file" in find(d, "#depth-body").text)
    loaded = [row.split() for row in texts(d, "#depth-table tbody tr")]
    assert [(row[0], row[5]) for row in loaded] == [
        (r["stack"], fmt(r["ms_per_token"])) for r in cli_depth["rows"]
    ]


def test_the_frontier_of_a_traffic_json_with_intervals_and_of_a_plan_json(page, tmp_path):
    d = page["driver"]
    open_view(d, "frontier", "#json-file")
    # a traffic.json as blocklab traffic writes it, with the interval fields a run with repeats adds
    sets = [
        ("all", 676.1, [650.2, 701.9], 6.2773, [6.2, 6.35]),
        ("skip=5", 644.8, [620.0, 690.5], 6.2945, [6.22, 6.37]),
        ("exit=6", 576.7, [540.3, 600.1], 6.3759, [6.3, 6.45]),
        ("skip=3,4,5", 711.7, None, 6.3394, None),
    ]
    rows = [
        {
            "block_set": name,
            "request_rate": None,
            "median_e2el_ms": ms,
            "median_e2el_ms_ci": ms_ci,
            "mean_loss": loss,
            "mean_loss_ci": loss_ci,
        }
        for name, ms, ms_ci, loss, loss_ci in sets
    ]
    traffic = tmp_path / "traffic.json"
    traffic.write_text(json.dumps({"model": "m", "block_sets": rows}))
    find(d, "#json-file").send_keys(str(traffic))
    wait_for(d, lambda d: d.find_elements("css selector", "#frontier-table"))
    shown = [cells.split() for cells in texts(d, "#frontier-table tbody tr")]
    assert [row[0] for row in shown] == ["exit=6", "skip=5", "all", "skip=3,4,5"]  # fastest first
    assert shown[0][1:] == ["576.7", "[540.3,", "600.1]", "6.376", "[6.3,", "6.45]", "yes"]
    assert [row[-1] for row in shown] == ["yes", "yes", "yes", "no"]  # skip=3,4,5: slower and worse than all
    assert len(d.find_elements("css selector", "#frontier-body .error-bar")) == 2 * 3  # x and y, for 3 sets
    screenshot(page, "frontier")

    # a plan.json: its points and the frontier blocklab plan chose (lab.plan.cheapest), no intervals
    points = [
        Point("all", 0, "all", 3.0, 0.0, 10.0),
        Point("single", 1, "skip=1", 3.1, 0.1, 8.0),
        Point("bi", 1, "skip=2", 3.2, 0.2, 8.5),
        Point("single", 2, "skip=1,2", 3.5, 0.5, 6.0),
    ]
    plan = {
        "all": asdict(points[0]),
        "methods": {"single": [asdict(points[1]), asdict(points[3])], "bi": [asdict(points[2])]},
        "frontier": [asdict(p) for p in cheapest(points)],
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    find(d, "#json-file").send_keys(str(tmp_path / "plan.json"))
    wait_for(d, lambda d: "from plan.json" in find(d, "#frontier-body").text)
    shown = [cells.split() for cells in texts(d, "#frontier-table tbody tr")]
    assert [(row[0], row[1], row[3], row[-1]) for row in shown] == [
        ("skip=1,2", "6", "3.5", "yes"), ("skip=1", "8", "3.1", "yes"), ("skip=2", "8.5", "3.2", "no"),
        ("all", "10", "3", "yes"),
    ]  # fmt: skip
    assert not d.find_elements("css selector", "#frontier-body .error-bar")


def test_every_control_is_labelled_and_reached_by_tab(page):
    from selenium.webdriver.common.keys import Keys

    d = page["driver"]
    unlabelled = d.execute_script("""
        const controls = document.querySelectorAll("button, input, select, [tabindex]");
        const named = (c) => c.labels?.length || c.getAttribute("aria-label") || c.textContent.trim();
        return [...controls].filter((c) => !named(c)).map((c) => c.outerHTML.slice(0, 80));""")
    assert unlabelled == []
    open_view(d, "block", "button.tensor")
    find(d, "body").click()
    reached = set()
    for _ in range(30):
        d.switch_to.active_element.send_keys(Keys.TAB)
        active = d.switch_to.active_element
        reached.add(
            active.get_attribute("id")
            or active.get_attribute("data-hook")
            or active.get_attribute("data-view")
        )
    assert {"block", "params", "bus", "ablate", "frontier", "t-slider", "t-input"} <= reached
    assert {"resid_pre", "attn.qkv", "attn.scores", "attn_out", "mlp.hidden", "mlp_out"} <= reached


def test_no_request_left_the_machine_and_no_script_failed(page):
    d = page["driver"]
    origin = page["url"].rstrip("/")
    fetched = d.execute_script("return performance.getEntriesByType('resource').map((e) => e.name)")
    assert fetched and all(name.startswith(origin + "/") for name in fetched), fetched
    asked_for_the_key = re.compile(r"/api/info - Failed to load resource: .* status of 401")
    log = d.get_log("browser")
    errors = [e for e in log if e["level"] == "SEVERE" and not asked_for_the_key.search(e["message"])]
    assert errors == []
    assert any(asked_for_the_key.search(e["message"]) for e in log)  # the one 401 the key form answered


def test_the_key_may_come_in_the_address(page):
    d = page["driver"]
    d.execute_script("sessionStorage.clear()")
    d.get("about:blank")  # a new document, not a jump within this one
    d.get(page["url"] + "#key=" + KEY)  # a fragment: no server or log sees it
    wait_for(d, lambda d: find(d, "body").get_attribute("data-ready") == "true")
    assert not find(d, "#key-form").is_displayed()
    assert "#key=" not in d.current_url  # taken out of the address bar at once
