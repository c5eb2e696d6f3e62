"""The nodes in ComfyUI's real graph editor, driven in headless Chromium as a person uses them.

One real ComfyUI 0.3.75 server with its real front end (``comfyui-frontend-package`` as ComfyUI pins it) runs for
the module (``comfy_server.ComfyServer``); the page is opened once and each test starts from a graph of its own.
Positions on the canvas are read from the page (node and widget positions), then the mouse and keyboard do the
work: the node search, dragging links, the value prompt of a number widget, the menu of a combo widget, the Run
button, the template browser.
"""

from __future__ import annotations

import json
import time

import pytest
from hosts import browser as web
from hosts import comfy_host as host  # noqa: I001  (puts ComfyUI on sys.path for the model files written below)
from hosts.comfy_server import UNET_FILE, ComfyServer

from tome_core.settings import RETIRED_CHOICES, SPECS

pytestmark = pytest.mark.browser

RUN_TIMEOUT_MS = 120_000  # one queued prompt: loading the tiny models, two steps at 32x32 px on a busy CPU
# Returning user: the front end's banner for its new node renderer stays closed.
INIT_SCRIPT = "localStorage.setItem('vueNodesBannerDismissed', 'true')"
# Canvas helpers run in the page: screen positions of nodes, widgets and slots (canvas coordinates go through
# the canvas's own transform, so zoom and panning do not matter).
HELPERS = """
window.__tome = {
  toScreen(pos) {
    const canvas = window.app.canvas;
    const rect = canvas.canvas.getBoundingClientRect();
    const p = canvas.ds.convertOffsetToCanvas(pos);
    return [rect.x + p[0], rect.y + p[1]];
  },
  node(type) { return window.app.graph.nodes.find(n => n.type === type); },
  widgetAt(type, name, fraction) {
    const node = this.node(type);
    const widget = node.widgets.find(w => w.name === name);
    const height = widget.computedHeight || 20;
    return this.toScreen([node.pos[0] + node.size[0] * fraction, node.pos[1] + widget.y + height / 2]);
  },
  slot(type, isInput, index) { return this.toScreen(this.node(type).getConnectionPos(isInput, index)); },
  widgets(type) {
    return this.node(type).widgets.map(w => ({name: w.name, type: w.type, value: w.value, options: w.options}));
  },
  links() {
    const byId = Object.fromEntries(window.app.graph.nodes.map(n => [n.id, n.type]));
    return Array.from(window.app.graph.links.values(), l => [byId[l.origin_id], byId[l.target_id], l.type]);
  },
  images(type) {
    return (this.node(type).imgs || []).filter(i => i.complete && i.naturalWidth > 0).length;
  },
};
"""

# The graph around the node: a tiny SD1.5 UNet, conditioning from the test helper nodes (no text encoder),
# TAESD as the VAE, a 32x32 image. Positions leave room for the node between the loader and the KSampler.
BASE_GRAPH = {
    "1": {"class_type": "UNETLoader", "inputs": {"unet_name": UNET_FILE, "weight_dtype": "default"}},
    "3": {"class_type": "TestRandomConditioning", "inputs": {"seed": 1}},
    "4": {"class_type": "TestRandomConditioning", "inputs": {"seed": 2}},
    "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 32, "height": 32, "batch_size": 1}},
    "6": {
        "class_type": "KSampler",
        "inputs": {
            "model": ["1", 0],
            "seed": 3,
            "steps": 2,
            "cfg": 5.0,
            "sampler_name": "euler",
            "scheduler": "normal",
            "positive": ["3", 0],
            "negative": ["4", 0],
            "latent_image": ["5", 0],
            "denoise": 1.0,
        },
    },
    "7": {"class_type": "VAELoader", "inputs": {"vae_name": "taesd"}},
    "8": {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["7", 0]}},
    "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "tome_patch_browser"}},
}
POSITIONS = {1: [40, 60], 3: [40, 420], 4: [40, 540], 5: [40, 660], 6: [680, 60], 7: [680, 420], 8: [1000, 60]}
POSITIONS[9] = [1000, 160]
NODE_SPOT = (440, 190)  # screen point where the node is added: between the loader and the KSampler


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ComfyServer(tmp_path_factory.mktemp("comfyui")) as running:
        yield running


@pytest.fixture(scope="module")
def node_inputs():
    """Input names of both nodes, from the package as ComfyUI's own loader registers it."""
    classes = host.load_our_package()
    return {name: [i.id for i in classes[name].GET_SCHEMA().inputs[1:]] for name in ("ToMePatch", "ToMePatchAdvanced")}


@pytest.fixture(scope="module")
def page(server, node_inputs):  # node_inputs first: ComfyUI's loader needs asyncio, which Playwright's loop blocks
    with web.chromium() as browser:
        page = web.new_page(browser, init_script=INIT_SCRIPT)
        page.goto(server.url)
        page.wait_for_function("() => window.app && window.app.graph && window.app.canvas && window.LiteGraph")
        page.wait_for_selector("button.templates-tab-button")
        page.evaluate(HELPERS)
        yield page


def load_base_graph(page):
    page.evaluate(
        """([graph, positions]) => {
            window.app.loadApiJson(graph, 'tome-patch-test.json');
            for (const node of window.app.graph.nodes) if (positions[node.id]) node.pos = positions[node.id];
            window.app.canvas.ds.scale = 1;
            window.app.canvas.ds.offset = [80, 110];
            window.app.graph.setDirtyCanvas(true, true);
        }""",
        [BASE_GRAPH, POSITIONS],
    )


def add_node_by_search(page, query, choose):
    """Double-click the empty canvas, type in the node search and pick the result whose title is ``choose``;
    returns the titles of the results in the node category."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    # A double-click can land before the canvas takes it, and no search box opens; typed keys would then reach the
    # page's shortcuts ("m" opens the model library). So the query is typed only once the search box has the
    # focus, and the double-click is tried again where it did not open.
    for attempt in range(3):
        page.mouse.dblclick(*NODE_SPOT)
        try:
            page.wait_for_function("() => document.activeElement?.tagName === 'INPUT'", timeout=5_000)
        except PlaywrightTimeout:
            if attempt == 2:
                raise
            continue
        page.keyboard.type(query, delay=20)
        try:
            titles = page.wait_for_function(
                """title => {
                    const titles = Array.from(document.querySelectorAll('[role=option]'))
                        .filter(e => e.innerText.includes('model_patches'))
                        .map(e => e.innerText.split('\\n')[0].replace(/\\u00a0/g, ' ').trim());
                    return titles.includes(title) && titles;
                }""",
                arg=choose,
                timeout=20_000,
            ).json_value()
            break
        except PlaywrightTimeout:
            if attempt == 2:
                raise
            page.keyboard.press("Escape")
    page.locator("[role=option]", has_text="model_patches").nth(titles.index(choose)).click()
    page.locator("[role=option]").first.wait_for(state="detached")
    node_type = "ToMePatchAdvanced" if "Advanced" in choose else "ToMePatch"
    page.wait_for_function("t => window.__tome.node(t) !== undefined", arg=node_type)
    return titles


def drag(page, start, end):
    page.mouse.move(*start)
    page.mouse.down()
    page.mouse.move((start[0] + end[0]) / 2, (start[1] + end[1]) / 2, steps=5)
    page.mouse.move(*end, steps=5)
    page.mouse.up()


def connect(page, source, target):
    """Drag from the first output of ``source`` to the first input of ``target``; wait for the link."""
    start = page.evaluate("t => window.__tome.slot(t, false, 0)", source)
    drag(page, start, page.evaluate("t => window.__tome.slot(t, true, 0)", target))
    page.wait_for_function(
        "([s, t]) => window.__tome.links().some(l => l[0] === s && l[1] === t)", arg=[source, target], timeout=5000
    )


def type_value(page, node, widget, text):
    """Click a number widget's value, type into the prompt that opens, press Enter."""
    page.mouse.click(*page.evaluate("([n, w]) => window.__tome.widgetAt(n, w, 0.5)", [node, widget]))
    page.locator(".graphdialog input.value").fill(text)
    page.keyboard.press("Enter")
    page.locator(".graphdialog").wait_for(state="detached")


def choose(page, node, widget, option):
    """Click a combo widget and pick ``option`` from its menu."""
    page.mouse.click(*page.evaluate("([n, w]) => window.__tome.widgetAt(n, w, 0.5)", [node, widget]))
    page.locator(".litecontextmenu .litemenu-entry").get_by_text(option, exact=True).click()


def widget_values(page, node):
    return {w["name"]: w["value"] for w in page.evaluate("n => window.__tome.widgets(n)", node)}


def run_and_wait_for_image(page, server):
    before = len(server.get_json("/api/history"))
    page.get_by_role("button", name="Run", exact=True).click()
    page.wait_for_function(
        "n => window.__tome.images('SaveImage') > 0 && window.__tome.node('SaveImage').imgs[0].src.includes(n)",
        arg="tome_patch_browser",
        timeout=RUN_TIMEOUT_MS,
    )
    return next_history_entry(server, before)


def next_history_entry(server, before):
    """The history entry of the prompt after the ``before`` first ones (ComfyUI writes it as the prompt ends)."""
    deadline = time.monotonic() + RUN_TIMEOUT_MS / 1000
    while len(server.get_json("/api/history")) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    history = server.get_json("/api/history")
    assert len(history) == before + 1, "the prompt did not reach ComfyUI's history"
    return list(history.values())[-1]


def expected_widget(name):
    """What the page must show for one input: widget type, default and options, from the engine's table."""
    spec = SPECS[name]
    if spec.kind == "choice":
        # A retired choice stays among the options so that saved workflows validate (settings.RETIRED_CHOICES).
        values = (
            ["auto", "1", "2", "4", "8"]
            if name == "max_downsample"
            else [*spec.choices, *RETIRED_CHOICES.get(name, ())]
        )
        return "combo", ("auto" if name == "max_downsample" else spec.default), {"values": values}
    if spec.kind == "bool":
        return "toggle", spec.default, {}
    return "number", spec.default, {"min": spec.minimum, "max": spec.maximum, "step2": spec.step}


def check_widgets(widgets, names):
    assert [w["name"] for w in widgets] == names  # nothing added by the front end (a seed's control widget)
    for widget in widgets:
        kind, default, options = expected_widget(widget["name"])
        assert (widget["type"], widget["value"]) == (kind, default), widget
        for key, value in options.items():
            # float(): the page holds numbers as doubles (2**63 - 1 is 2**63 there)
            shown = widget["options"][key]
            assert (shown == value) if key == "values" else float(shown) == float(value), (widget["name"], key)
        if SPECS[widget["name"]].kind == "int":
            assert widget["options"]["precision"] == 0, widget


def test_node_search_finds_both_nodes_with_the_engine_defaults_ranges_and_tooltips(page, node_inputs):
    load_base_graph(page)
    titles = add_node_by_search(page, "ToMe Patch", "ToMe Patch (Advanced)")
    assert {"ToMe Patch", "ToMe Patch (Advanced)"} <= set(titles)
    check_widgets(page.evaluate("() => window.__tome.widgets('ToMePatchAdvanced')"), node_inputs["ToMePatchAdvanced"])

    load_base_graph(page)
    add_node_by_search(page, "ToMe Patch", "ToMe Patch")
    check_widgets(page.evaluate("() => window.__tome.widgets('ToMePatch')"), node_inputs["ToMePatch"])
    tooltip = page.locator(".node-tooltip")
    for name in node_inputs["ToMePatch"]:
        page.mouse.move(0, 0)  # away first, so each hover shows its own tooltip
        tooltip.wait_for(state="hidden")
        page.mouse.move(*page.evaluate("([n, w]) => window.__tome.widgetAt(n, w, 0.3)", ["ToMePatch", name]))
        tooltip.wait_for(state="visible")
        assert tooltip.inner_text().strip() == SPECS[name].tooltip, name


def test_node_wired_between_loader_and_sampler_runs_the_prompt_to_an_image(page, server, tmp_path):
    load_base_graph(page)
    add_node_by_search(page, "ToMe Patch", "ToMe Patch")
    connect(page, "UNETLoader", "ToMePatch")
    connect(page, "ToMePatch", "KSampler")
    links = page.evaluate("() => window.__tome.links()")
    assert ["UNETLoader", "ToMePatch", "MODEL"] in links and ["ToMePatch", "KSampler", "MODEL"] in links
    assert ["UNETLoader", "KSampler", "MODEL"] not in links  # the new link replaced the direct one

    type_value(page, "ToMePatch", "ratio", "0.3")
    choose(page, "ToMePatch", "method", "todo")
    type_value(page, "ToMePatch", "downsample_factor", "3")
    values = widget_values(page, "ToMePatch")
    changed = {"ratio": 0.3, "method": "todo", "downsample_factor": 3}
    assert values == {name: changed.get(name, expected_widget(name)[1]) for name in values}

    entry = run_and_wait_for_image(page, server)
    assert entry["status"]["status_str"] == "success", entry["status"]
    prompt = entry["prompt"][2]
    (ours,) = [node for node in prompt.values() if node["class_type"] == "ToMePatch"]
    (sampler,) = [node for node in prompt.values() if node["class_type"] == "KSampler"]
    assert prompt[ours["inputs"]["model"][0]]["class_type"] == "UNETLoader"
    assert prompt[sampler["inputs"]["model"][0]] is ours
    assert {k: ours["inputs"][k] for k in ("method", "ratio", "downsample_factor")} == {
        "method": "todo",
        "ratio": 0.3,
        "downsample_factor": 3,
    }
    (image,) = [out["images"][0] for out in entry["outputs"].values() if "images" in out]
    assert (server.base / "output" / image["filename"]).is_file()
    web.screenshot(page, tmp_path, "comfyui-graph-run")


def test_values_out_of_range_are_clamped_by_the_page_or_stopped_with_the_node_error(page, server):
    load_base_graph(page)
    add_node_by_search(page, "ToMe Patch", "ToMe Patch")
    connect(page, "UNETLoader", "ToMePatch")
    connect(page, "ToMePatch", "KSampler")
    type_value(page, "ToMePatch", "ratio", "0.9")
    type_value(page, "ToMePatch", "downsample_factor", "0.5")
    values = widget_values(page, "ToMePatch")
    assert (values["ratio"], values["downsample_factor"]) == (
        SPECS["ratio"].maximum,
        SPECS["downsample_factor"].minimum,
    )

    # Each value is in range but the pair is not: the node refuses it before sampling, and the page shows why.
    type_value(page, "ToMePatch", "start_percent", "0.8")
    type_value(page, "ToMePatch", "end_percent", "0.5")
    before = len(server.get_json("/api/history"))
    page.get_by_role("button", name="Run", exact=True).click()
    dialog = page.locator(".p-dialog", has_text="start_percent must not be above end_percent")
    dialog.wait_for(timeout=RUN_TIMEOUT_MS)
    assert "got start_percent=0.8 and end_percent=0.5" in dialog.inner_text()
    page.keyboard.press("Escape")
    dialog.wait_for(state="detached")

    # ComfyUI recorded an error of our node (no crash: the server answers), and nothing was sampled.
    entry = next_history_entry(server, before)
    assert entry["status"]["status_str"] == "error"
    (error,) = [data for kind, data in entry["status"]["messages"] if kind == "execution_error"]
    assert error["node_type"] == "ToMePatch" and "start_percent" in error["exception_message"]
    assert not entry["outputs"]


def test_a_workflow_saved_before_reuse_interval_was_the_default_opens_with_reuse_off(page, node_inputs):
    """The front end restores widget values by position and leaves the rest at today's defaults; a workflow saved
    before scope or reuse_interval existed meant reuse off, one saved before dit_settings existed ran a DiT as set,
    and one saved before reuse_plan existed reused one step in N: each opens so (web/saved_defaults.js), while
    one saved with a value keeps it and a node added anew gets the default (the search test)."""
    workflow = json.loads(next((host.REPO_ROOT / "example_workflows").glob("*SD1.5*.json")).read_text())
    (ours,) = [n for n in workflow["nodes"] if n["type"] == "ToMePatch"]
    complete = list(ours["widgets_values"])
    index = node_inputs["ToMePatch"].index("reuse_interval")
    cases = (
        (complete[:7], 1, "as set", "every N"),
        (complete[:8], 1, "as set", "every N"),
        (complete[:index] + [2], 2, "as set", "every N"),  # saved before dit_settings existed
        (complete[:index] + [3, "auto"], 3, "auto", "every N"),  # saved before reuse_plan existed
        (complete[:index] + [3, "as set", "every N"], 3, "as set", "every N"),
        (complete[:index] + [3, "auto", "auto"], 3, "auto", "auto"),
    )
    for saved, expected, dit_settings, reuse_plan in cases:
        ours["widgets_values"] = saved
        page.evaluate("w => window.app.loadGraphData(w)", workflow)
        page.wait_for_function("() => window.__tome.node('ToMePatch') !== undefined")
        values = widget_values(page, "ToMePatch")
        got = (values["reuse_interval"], values["dit_settings"], values["reuse_plan"])
        assert got == (expected, dit_settings, reuse_plan), saved
        assert list(values.values())[: len(saved)] == saved


def test_example_workflow_opens_from_the_template_browser(page, tmp_path):
    workflow_file = next((host.REPO_ROOT / "example_workflows").glob("*SD1.5*.json"))
    workflow = json.loads(workflow_file.read_text())
    (ours,) = [n for n in workflow["nodes"] if n["type"] == "ToMePatch"]

    thumbnail = workflow_file.with_suffix(".jpg")
    page.locator("button.templates-tab-button").click()
    card = page.locator("[role=dialog] >> text=" + workflow_file.stem).first
    card.wait_for()
    if thumbnail.is_file() or not web.UPDATE_SCREENSHOTS:  # (the update run makes the thumbnail)
        # The card shows the workflow's own picture, not the front end's stand-in for a missing one.
        page.wait_for_function(
            """() => Array.from(document.querySelectorAll('[role=dialog] img')).some(
                img => img.complete && img.naturalWidth > 0 && !img.src.includes('default-template'))"""
        )
    card.click()
    page.locator("[role=dialog]").first.wait_for(state="detached")
    page.wait_for_function("() => window.__tome.node('ToMePatch') !== undefined")

    links = page.evaluate("() => window.__tome.links()")
    assert ["CheckpointLoaderSimple", "ToMePatch", "MODEL"] in links and ["ToMePatch", "KSampler", "MODEL"] in links
    assert list(widget_values(page, "ToMePatch").values()) == ours["widgets_values"]

    # The picture for the README: the node with the loader before it and the sampler after it.
    box = page.evaluate(
        """() => {
            const ids = ['CheckpointLoaderSimple', 'ToMePatch', 'KSampler'].map(t => window.__tome.node(t));
            const left = Math.min(...ids.map(n => n.pos[0])), top = Math.min(...ids.map(n => n.pos[1]));
            const right = Math.max(...ids.map(n => n.pos[0] + n.size[0]));
            const bottom = Math.max(...ids.map(n => n.pos[1] + n.size[1]));
            return [window.__tome.toScreen([left - 20, top - 50]), window.__tome.toScreen([right + 20, bottom + 20])];
        }"""
    )
    (x0, y0), (x1, y1) = box
    clip = {"x": max(x0, 0), "y": max(y0, 0), "width": min(x1, 1600) - max(x0, 0), "height": min(y1, 1000) - max(y0, 0)}
    picture = web.screenshot(page, tmp_path, "comfyui-node", clip=clip, for_docs=True)
    # What the picture shows of the node: its inputs and values (its record docs/comfyui-node.json).
    web.check_picture_record("comfyui-node", [list(item) for item in widget_values(page, "ToMePatch").items()])
    if web.UPDATE_SCREENSHOTS:
        web.save_thumbnail(picture, thumbnail)
