"""The WebUI script's accordion in the WebUI's own gradio (3.41.2), driven in headless Chromium.

The page (``tests/hosts/webui_page.py``) runs in the second environment ``.venv-webui`` and builds the script's real
``ui()``; its Generate button hands the controls' values to the script's hooks as the WebUI does. Controls are found
by their element ids (``script.elem_id(name)``) and labels only, so the tests do not depend on their layout, and
before touching a control that belongs to one method or to the highres pass, the method or the highres checkbox
is set so that the control applies.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from hosts import browser as web

from tome_core.hosts.webui import args as webui_args

pytestmark = pytest.mark.browser

WEBUI_PYTHON = web.REPO_ROOT / ".venv-webui" / "bin" / "python"
START_TIMEOUT_S = 120  # gradio and torch imports on a busy 2-core machine


def eid(name):
    """The element id the WebUI gives a control of this script on the txt2img tab (Script.elem_id)."""
    return f"script_txt2img_tome_patch_{name}"


@pytest.fixture(scope="module")
def page_url(tmp_path_factory):
    if not WEBUI_PYTHON.exists():
        pytest.fail(
            f"The WebUI page needs the environment .venv-webui (gradio 3.41.2): {web.SETUP_HINT}.", pytrace=False
        )
    port = web.free_port()
    log_path = tmp_path_factory.mktemp("webui") / "page.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [str(WEBUI_PYTHON), str(web.REPO_ROOT / "tests" / "hosts" / "webui_page.py"), "--port", str(port)],
            cwd=web.REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}/"
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"The WebUI page did not start:\n{log_path.read_text()[-4000:]}", pytrace=False)
                try:
                    with urllib.request.urlopen(url, timeout=5):
                        break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=20)


@pytest.fixture(scope="module")
def browser():
    with web.chromium() as running:
        yield running


@pytest.fixture
def page(browser, page_url):
    page = web.new_page(browser, width=1280, height=1000)
    page.goto(page_url)
    page.locator(f"#{eid('enabled')}-checkbox input").wait_for()
    yield page
    page.context.close()


def visible_controls(page):
    """The script's controls drawn on the page, in page order: [element id name, its label] (the enable checkbox
    as "enabled"; the accordion around the controls is not a control)."""
    prefix = eid("")
    return page.evaluate(
        """prefix => Array.from(document.querySelectorAll(`[id^="${prefix}"]`))
            .filter(e => e.checkVisibility() && !e.classList.contains('input-accordion'))
            .map(e => [
                e.id.slice(prefix.length).replace(/-checkbox$/, ''),
                e.querySelector('[data-testid=block-info], label span').textContent.trim(),
            ])""",
        prefix,
    )


def slider_value(page, name):
    return float(page.locator(f"#{eid(name)} input[type=number]").input_value())


def set_number(page, name, text):
    page.locator(f"#{eid(name)} input[type=number]").fill(text)
    page.keyboard.press("Tab")


def generate(page):
    """Click Generate; returns what the script's hook received and wrote (see webui_page.py)."""
    report = page.locator("#tome_patch_received textarea")
    page.evaluate("() => { document.querySelector('#tome_patch_received textarea').value = ''; }")
    page.locator("#txt2img_generate").click()
    page.wait_for_function("() => document.querySelector('#tome_patch_received textarea').value.length > 0")
    return json.loads(report.input_value())


def expected_args(**changes):
    values = dict(zip(webui_args.ARG_NAMES, webui_args.as_list(webui_args.defaults()), strict=True))
    values.update(changes)
    return [values[name] for name in webui_args.ARG_NAMES]


def assert_same_args(received, expected):
    assert len(received) == len(expected)
    for name, got, want in zip(webui_args.ARG_NAMES, received, expected, strict=True):
        if isinstance(want, (bool, str)):
            assert got == want and type(got) is type(want), (name, got, want)
        else:  # numbers as gradio sends them: 3 or 3.0
            assert type(got) in (int, float) and math.isclose(got, want, abs_tol=1e-9), (name, got, want)


def test_ticking_the_accordion_and_moving_the_controls_reaches_the_script_as_its_arguments(page, tmp_path):
    ratio = page.locator(f"#{eid('ratio')}")
    factor = page.locator(f"#{eid('downsample_factor')}")
    assert not factor.is_visible()  # the accordion starts closed, the patch off
    page.locator(f"#{eid('enabled')}-checkbox input").check()
    factor.wait_for(state="visible")  # ticking opened it, with the default method's slider
    assert not ratio.is_visible()  # ToDo is the default: ToMe's ratio is hidden

    page.locator(f"#{eid('method')}").get_by_label("ToMe", exact=True).check()
    ratio.wait_for(state="visible")
    page.locator(f"#{eid('ratio')} input[type=range]").focus()  # the slider, moved with the keyboard
    for _ in range(10):
        page.keyboard.press("ArrowRight")
    assert slider_value(page, "ratio") == pytest.approx(0.6)

    page.locator(f"#{eid('method')}").get_by_label("ToDo", exact=True).check()
    ratio.wait_for(state="hidden")  # hidden again, its value still sent (below)
    set_number(page, "downsample_factor", "3")
    page.locator(f"#{eid('hr_same')} input").uncheck()
    set_number(page, "hr_downsample_factor", "4")
    page.mouse.click(1275, 600)  # the page's right margin: no control keeps the focus ring in the picture
    page.wait_for_function("() => document.activeElement === document.body")
    page.evaluate("() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")  # repainted
    web.screenshot(
        page, tmp_path, "webui-accordion", clip=page.locator("#txt2img_settings").bounding_box(), for_docs=True
    )
    # ToDo with its own highres value: ToMe's sliders hidden, the advanced settings closed. The committed picture
    # must show exactly these controls (its record docs/webui-accordion.json).
    shown = visible_controls(page)
    assert [name for name, _ in shown] == [
        "enabled", "method", "downsample_factor", "hr_same", "hr_downsample_factor", "hr_only"
    ]  # fmt: skip
    web.check_picture_record("webui-accordion", shown)

    page.get_by_text("Advanced", exact=True).click()
    page.locator(f"#{eid('downsample_method')} input").click()
    page.locator("ul.options li", has_text="avg_pool").click()
    set_number(page, "end_percent", "0.8")

    report = generate(page)
    expected = expected_args(
        enabled=True,
        method="ToDo",
        ratio=0.6,
        downsample_factor=3.0,
        hr_same=False,
        hr_downsample_factor=4.0,
        downsample_method="avg_pool",
        end_percent=0.8,
    )
    assert_same_args(report["args"], expected)
    assert report["console"] == []
    assert report["ui_warnings"] == []  # every control argument is one this gradio version knows
    # The hook patched the UNet and wrote the generation parameters of these settings.
    assert report["params"] == webui_args.infotext_params(webui_args.parse_args(expected))


def test_infotext_paste_sets_every_control_and_a_picture_without_the_patch_turns_it_off(page):
    pasted = webui_args.parse_args(
        expected_args(
            enabled=True,
            method="ToMe",
            ratio=0.4,
            hr_same=False,
            hr_ratio=0.3,
            max_downsample="2",
            sx=2,
            sy=1,
            use_rand=True,
            merge_crossattn=True,
            end_percent=0.7,
            skip_when_slower=False,
            scope="block",
        )
    )
    params = {"Steps": 20, "Sampler": "Euler", **webui_args.infotext_params(pasted)}
    page.locator("#txt2img_prompt textarea").fill(", ".join(f"{key}: {value}" for key, value in params.items()))
    page.locator("#paste").click()
    page.locator(f"#{eid('ratio')}").wait_for(state="visible")  # ticked, so the accordion opened
    assert page.locator(f"#{eid('enabled')}-checkbox input").is_checked()
    assert page.locator(f"#{eid('method')} input[type=radio]:checked").get_attribute("value") == "ToMe"
    page.wait_for_function(
        "id => document.querySelector(`#${id} input[type=number]`).value === '0.4'", arg=eid("ratio")
    )
    report = generate(page)
    assert_same_args(report["args"], webui_args.as_list(pasted))

    page.locator("#txt2img_prompt textarea").fill("Steps: 20, Sampler: Euler, CFG scale: 7")
    page.locator("#paste").click()
    page.wait_for_function("id => !document.querySelector(`#${id}-checkbox input`).checked", arg=eid("enabled"))
    assert generate(page)["args"][0] is False
