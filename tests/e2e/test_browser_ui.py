"""What a ComfyUI user sees of the pack, in headless Chromium at 1600x1000 against a real ComfyUI: the
template browser (titles, order, search), the node search, a validation error, every shipped UI
workflow laid out in classic mode and with "Nodes 2.0" on, the MGPU panel and the previews hint.

The page is driven over the Chrome DevTools protocol (through the queue tool's websocket client):
``Runtime.evaluate`` reads ComfyUI's own state (``app.graph``, its stores, the DOM) after the frontend
has laid things out. With MGPU_SCREENSHOTS=<folder> set, each test also writes the screenshot
README.md and docs/ show (docs/images is the folder they use).

Runs only with COMFYUI_DIR pointing at a ComfyUI checkout (its Python: COMFYUI_PYTHON) and Chromium
installed (``chromium``, or the CHROMIUM variable naming it). No model files and no fleet: nothing
here queues work that passes validation.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from mgpu_backend.tools.comfy_queue import WebSocket
from mgpu_backend.tools.comfy_server import ComfyUIServer

PACK_DIR = Path(__file__).resolve().parents[2]
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOTS = os.environ.get("MGPU_SCREENSHOTS")
WINDOW = (1600, 1000)
PACK_NODES = {
    "MGPULoadCheckpoint": "Load Checkpoint MGPU", "MGPUTextEncode": "MGPU Text Encode", "MGPUSPSampler": "SP Sampler",
    "MGPUTDPUpscale": "TDP Upscale", "MGPUDistributedVAEDecode": "Distributed VAE Decode", "MGPUFleetControl": "MGPU Fleet Control",
}  # fmt: skip

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not COMFYUI_DIR or not (Path(COMFYUI_DIR) / "main.py").is_file(), reason="set COMFYUI_DIR to a ComfyUI checkout"),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium, or CHROMIUM=path)"),
]


# --- a Chrome DevTools protocol client over a plain websocket --------------------------------------------


class DevTools:
    """One page's DevTools websocket (the queue tool's websocket client): ``call`` sends a command and
    waits for its reply; events in between are dropped."""

    def __init__(self, ws_url: str) -> None:
        self.socket = WebSocket.connect(ws_url, timeout=120)
        self.incoming = self.socket.messages()
        self.last_id = 0

    def call(self, method: str, **params):
        self.last_id += 1
        self.socket.send(0x1, json.dumps({"id": self.last_id, "method": method, "params": params}).encode())
        for message in self.incoming:
            reply = json.loads(message)
            if reply.get("id") == self.last_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
        raise ConnectionError("Chromium closed the DevTools connection")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:200]}: {json.dumps(result['exceptionDetails'])[:1500]}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never made {expression!r} true within {timeout:.0f} s")
            time.sleep(0.25)

    def screenshot(self, name: str) -> None:
        """docs-size PNG (three quarters of the window) into MGPU_SCREENSHOTS, when set."""
        if not SCREENSHOTS:
            return
        self.evaluate("new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => done(true))))")  # the canvas's last frame drawn
        clip = {"x": 0, "y": 0, "width": WINDOW[0], "height": WINDOW[1], "scale": 0.75}
        data = self.call("Page.captureScreenshot", format="png", clip=clip)["data"]
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        (Path(SCREENSHOTS) / name).write_bytes(base64.b64decode(data))


class Chromium:
    """Headless Chromium with a throwaway profile, one page of ``url`` at WINDOW size."""

    def __init__(self, url: str) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="mgpu-chromium-"))
        self.process = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--window-size={WINDOW[0]},{WINDOW[1]}", "--remote-debugging-port=0", f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            assert self.process.poll() is None and time.monotonic() < deadline, "Chromium did not open its DevTools port"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=30) as response:
            (page,) = [target for target in json.loads(response.read()) if target["type"] == "page"]
        self.page = DevTools(page["webSocketDebuggerUrl"])
        self.page.call("Page.enable")
        self.page.call("Emulation.setDeviceMetricsOverride", width=WINDOW[0], height=WINDOW[1], deviceScaleFactor=1, mobile=False)
        self.page.call("Page.navigate", url=url)
        self.page.wait_for("!!(window.app && window.app.graph && window.app.extensionManager && document.querySelector('canvas'))", timeout=120)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


# --- ComfyUI and the page ---------------------------------------------------------------------------------


def put_setting(url: str, name: str, value) -> None:
    request = urllib.request.Request(f"{url}/settings/{name}", data=json.dumps(value).encode(), method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30):
        pass


@pytest.fixture(scope="module")
def comfyui(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfyui-browser")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / "comfyui-mgpu").symlink_to(PACK_DIR, target_is_directory=True)
    runtime = base / "run"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "MGPU_CPU_RANKS": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MGPU_SOCKET", None)  # the panel must speak of a fleet ComfyUI starts itself
    server = ComfyUIServer(Path(COMFYUI_DIR), base, ["--cpu"], python=os.environ.get("COMFYUI_PYTHON", sys.executable), env=env)
    try:
        server.wait_ready("/object_info/MGPUSPSampler")
        put_setting(server.url, "Comfy.TutorialCompleted", True)  # no template browser over the first page
        put_setting(server.url, "Comfy.RightSidePanel.IsOpen", False)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def page(comfyui):
    browser = Chromium(comfyui.url + "/")
    try:
        yield browser.page
    finally:
        browser.stop()


def set_setting(page: DevTools, name: str, value) -> None:
    page.evaluate(f"app.extensionManager.setting.set({json.dumps(name)}, {json.dumps(value)}).then(() => true)")


OPEN_DIALOGS = (
    "[...document.querySelectorAll('[role=dialog], .p-dialog')].filter((dialog) => dialog.offsetParent !== null || getComputedStyle(dialog).position === 'fixed').length"
)


def close_dialogs(page: DevTools) -> None:
    """Press Escape (a real key press) until no dialog is open: the template browser, the node search."""
    for _ in range(4):
        if not page.evaluate(OPEN_DIALOGS):
            return
        for kind in ("keyDown", "keyUp"):
            page.call("Input.dispatchKeyEvent", type=kind, key="Escape", code="Escape", windowsVirtualKeyCode=27)
        settled(page, OPEN_DIALOGS, "value === 0", timeout=2.0)
    assert not page.evaluate(OPEN_DIALOGS), "a dialog stays open after Escape"


def dismiss_notices(page: DevTools) -> None:
    """Close the frontend's notices (e.g. "4 required models are missing") that would cover the graph."""
    page.evaluate("[...document.querySelectorAll('button')].filter((button) => button.offsetParent !== null && button.textContent.trim() === 'Dismiss').forEach((button) => button.click()); true")


def load_workflow(page: DevTools, path: Path) -> None:
    """Open a UI workflow as dropping its file does, and wait until the frontend has laid it out."""
    close_dialogs(page)
    page.evaluate(f"app.loadGraphData({path.read_text()}, true, true, {json.dumps(path.stem)}).then(() => true)")
    page.wait_for(f"app.graph.nodes.length === {len(json.loads(path.read_text())['nodes'])}")
    page.evaluate("new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(() => setTimeout(() => done(true), 1500))))")
    dismiss_notices(page)


def type_into(page: DevTools, placeholder_pattern: str, text: str) -> None:
    page.evaluate(
        f"""(() => {{
          const box = [...document.querySelectorAll('input')].find((input) => input.offsetParent !== null && new RegExp({json.dumps(placeholder_pattern)}, 'i').test(input.placeholder));
          box.focus(); box.value = {json.dumps(text)}; box.dispatchEvent(new Event('input', {{bubbles: true}})); return true;
        }})()"""
    )


def settled(page: DevTools, expression: str, condition: str, timeout: float = 30.0):
    """``expression``'s value once ``condition`` (JavaScript over ``value``) holds for it (the dialogs
    debounce their search, so the list changes a moment after the typing), or its last value when the
    condition never held within ``timeout`` s, for the test's assertion to show."""
    try:
        page.wait_for(f"((value) => {condition})({expression})", timeout=timeout)
    except TimeoutError:
        pass
    return page.evaluate(expression)


def click_text(page: DevTools, selector: str, text: str) -> None:
    page.evaluate(f"[...document.querySelectorAll({json.dumps(selector)})].find((node) => node.textContent.trim() === {json.dumps(text)}).click() ?? true")


def builder():
    from ..test_workflows import builder as workflows_builder

    return workflows_builder


# --- the template browser ---------------------------------------------------------------------------------

CARD_TITLES = "[...document.querySelectorAll('[role=dialog] h3.line-clamp-1')].map((title) => title.textContent.trim())"


def open_pack_templates(page: DevTools) -> None:
    close_dialogs(page)
    page.evaluate("app.extensionManager.command.execute('Comfy.BrowseTemplates').then(() => true)")
    page.wait_for("[...document.querySelectorAll('[role=dialog] span')].some((label) => label.textContent.trim() === 'comfyui-mgpu')")
    click_text(page, "[role=dialog] span", "comfyui-mgpu")
    page.wait_for(f"{CARD_TITLES}.length > 0")


def test_template_browser_lists_the_packs_workflows_by_title_with_the_no_download_ones_first(page):
    titles = [template.title for template in builder().TEMPLATES]
    open_pack_templates(page)
    shown = page.evaluate(CARD_TITLES)
    page.screenshot("templates.png")
    assert shown == titles, shown
    assert [title for title in shown[:2]] == ["LTX-2.3 Tiny Test — no download", "LTX-2.0 Tiny Test — no download"]
    # Each title fits the card's one line (the frontend clamps it there).
    clamped = page.evaluate("[...document.querySelectorAll('[role=dialog] h3.line-clamp-1')].filter((title) => title.scrollWidth > title.clientWidth).map((title) => title.textContent)")
    assert clamped == [], clamped


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("LTX", lambda template: True),
        ("LTX-2.3", lambda template: template.example.version == "2.3"),
        ("image to video", lambda template: template.example.image and not template.example.last_image and not template.example.tiny),
        ("first last frame", lambda template: template.example.last_image and not template.example.tiny),
    ],
    ids=["LTX", "LTX-2.3", "image-to-video", "first-last-frame"],
)
def test_template_search_finds_the_packs_workflows_by_the_words_users_type(page, query, expected):
    open_pack_templates(page)
    type_into(page, "Search", query)
    wanted = {template.title for template in builder().TEMPLATES if expected(template)}
    found = set(settled(page, CARD_TITLES, f"JSON.stringify([...new Set(value)].sort()) === {json.dumps(json.dumps(sorted(wanted), separators=(',', ':')))}"))
    assert wanted <= found, f"{query!r} misses {sorted(wanted - found)}"
    if query == "image to video":
        assert found == wanted, f"{query!r} also finds {sorted(found - wanted)}"
        page.screenshot("template-search.png")


# --- the node search --------------------------------------------------------------------------------------

SEARCH_RESULTS = "[...document.querySelectorAll('div.h-14.cursor-pointer')].map((row) => row.textContent.trim())"


def node_search(page: DevTools, query: str, expected: set[str]) -> list[str]:
    """The search box's result rows for ``query``, read once rows starting with each ``expected`` name
    are shown (or after 30 s)."""
    dismiss_notices(page)
    if not page.evaluate("[...document.querySelectorAll('input')].some((input) => input.offsetParent !== null && /Add a node/i.test(input.placeholder))"):
        close_dialogs(page)
        page.evaluate("app.extensionManager.command.execute('Workspace.SearchBox.Toggle').then(() => true)")
        page.wait_for("[...document.querySelectorAll('input')].some((input) => input.offsetParent !== null && /Add a node/i.test(input.placeholder))")
    type_into(page, "Add a node", query)
    return settled(page, SEARCH_RESULTS, f"{json.dumps(sorted(expected))}.every((name) => value.some((row) => row.startsWith(name)))")


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("ltx", set(PACK_NODES.values())),
        ("ltx-2", set(PACK_NODES.values())),
        ("ltx-2.3", set(PACK_NODES.values())),
        ("ltx sampler", {"SP Sampler"}),
        ("ltx upscale", {"TDP Upscale"}),
        ("ltx vae decode", {"Distributed VAE Decode"}),
        ("ltx text encode", {"MGPU Text Encode"}),
        ("ltx checkpoint", {"Load Checkpoint MGPU"}),
    ],
)
def test_node_search_finds_the_pack_nodes_by_model_name_and_function(page, query, expected):
    rows = node_search(page, query, expected)
    found = {name for name in PACK_NODES.values() if any(row.startswith(name) for row in rows)}
    assert expected <= found, f"{query!r} finds {sorted(found)} of the pack's nodes; rows: {rows}"
    if query == "ltx-2.3":
        page.screenshot("node-search.png")
    close_dialogs(page)


# --- a validation error -----------------------------------------------------------------------------------


def queue_with(page: DevTools, node_type: str, widgets: dict) -> dict:
    """Set widgets of the one ``node_type`` node, queue the graph, and return the node errors shown."""
    for name, value in widgets.items():
        page.evaluate(f"app.graph.nodes.find((node) => node.type === {json.dumps(node_type)}).widgets.find((widget) => widget.name === {json.dumps(name)}).value = {json.dumps(value)}; true")
    page.evaluate("app.queuePrompt(0, 1).then(() => true)")
    return page.wait_for("app.extensionManager.lastNodeErrors && JSON.parse(JSON.stringify(app.extensionManager.lastNodeErrors))", timeout=60)


def tiny_workflow() -> Path:
    return builder().ui_path("ltx2_t2v_tiny")


def test_a_bad_frame_count_is_one_error_under_length_only(page):
    set_setting(page, "Comfy.VueNodes.Enabled", True)
    load_workflow(page, tiny_workflow())
    errors = queue_with(page, "MGPUSPSampler", {"length": 126})
    (sampler_id,) = [node_id for node_id, entry in errors.items() if entry["class_type"] == "MGPUSPSampler"]
    assert len(errors) == 1, errors
    (error,) = errors[sampler_id]["errors"]
    assert error["extra_info"]["input_name"] == "length"
    assert error["details"] == "length: frames must be 8k+1 (the video VAE packs 8 frames per latent frame after the first), got 126; use 129"
    click_text(page, "button", "See Errors")
    page.screenshot("validation-error.png")
    set_setting(page, "Comfy.RightSidePanel.IsOpen", False)


def test_float32_with_the_distilled_lora_is_one_error_under_distilled_lora(page):
    load_workflow(page, tiny_workflow())
    errors = queue_with(page, "MGPULoadCheckpoint", {"dtype": "float32"})
    (entry,) = errors.values()
    assert entry["class_type"] == "MGPULoadCheckpoint"
    assert [error["extra_info"]["input_name"] for error in entry["errors"]] == ["distilled_lora"]
    assert entry["errors"][0]["details"].startswith("distilled_lora: dtype float32 cannot be used with the distilled LoRA")


# --- layouts ----------------------------------------------------------------------------------------------

NODE_BOXES = "app.graph.nodes.map((node) => [node.id, node.title, Array.from(node.boundingRect).map(Math.round)])"


def overlaps(boxes: list) -> list[tuple]:
    """Pairs of nodes whose rectangles (title bars included) share area."""
    return [
        (first[1], second[1], first[2], second[2])
        for index, first in enumerate(boxes) for second in boxes[index + 1:]
        if first[2][0] < second[2][0] + second[2][2] and second[2][0] < first[2][0] + first[2][2]
        and first[2][1] < second[2][1] + second[2][3] and second[2][1] < first[2][1] + first[2][3]
    ]  # fmt: skip


@pytest.mark.parametrize("nodes_2", [False, True], ids=["classic", "nodes-2.0"])
def test_every_shipped_workflow_lays_out_without_overlapping_nodes(page, nodes_2):
    set_setting(page, "Comfy.VueNodes.Enabled", nodes_2)
    problems = {}
    workflows = builder()
    for template in workflows.TEMPLATES:
        path = workflows.ui_path(template.slug)
        load_workflow(page, path)
        boxes = page.evaluate(NODE_BOXES)
        if overlapping := overlaps(boxes):
            problems[path.name] = overlapping
        if nodes_2:
            # Vue draws each node as a DOM element; a widget label cut short ends in an ellipsis there
            # (file names in the value boxes may be cut: the whole name shows when the box opens).
            cut = page.evaluate(
                "[...document.querySelectorAll('[data-node-id] .text-node-component-slot-text > .truncate')]"
                ".filter((label) => label.scrollWidth > label.clientWidth + 1).map((label) => label.textContent.trim())"
            )
            if cut:
                problems.setdefault(path.name, []).append(("labels cut", cut))
        if template.slug == "ltx23_i2v_two_stage":
            page.screenshot("layout-nodes-2.png" if nodes_2 else "layout-classic.png")
    assert problems == {}, json.dumps(problems, indent=1, ensure_ascii=False)


# --- the panel and the previews hint ----------------------------------------------------------------------

NOT_RUNNING = "fleet not running: the first MGPU node starts it (on every visible GPU, or MGPU_GPUS / MGPU_CPU_RANKS)"


def test_fleet_panel_says_once_that_the_first_node_starts_the_fleet_and_its_buttons_follow_the_theme(page):
    set_setting(page, "Comfy.VueNodes.Enabled", False)
    load_workflow(page, tiny_workflow())
    page.evaluate("app.extensionManager.sidebarTab.toggleSidebarTab('comfyui-mgpu-fleet'); true")
    text = page.wait_for("document.querySelector('.mgpu-panel .mgpu-body')?.textContent.includes('fleet not running') && document.querySelector('.mgpu-panel').innerText")
    assert text.count(NOT_RUNNING) == 1 and "mgpu_backend serve" not in text, text
    styles = page.evaluate(
        """(() => {
          const button = document.querySelector('.mgpu-panel button');
          const probe = document.createElement('div');
          probe.style.background = 'var(--secondary-background, var(--comfy-input-bg))';
          document.body.append(probe);
          const theme = getComputedStyle(probe).backgroundColor;
          probe.remove();
          const style = getComputedStyle(button);
          return {radius: style.borderRadius, background: style.backgroundColor, theme, labels: [...document.querySelectorAll('.mgpu-panel button')].map((b) => b.textContent)};
        })()"""
    )
    assert styles["labels"] == ["Refresh", "Unload models", "Restart fleet"]
    assert styles["radius"] == "6px" and styles["background"] == styles["theme"], styles
    page.screenshot("fleet-panel.png")
    page.evaluate("app.extensionManager.sidebarTab.toggleSidebarTab('comfyui-mgpu-fleet'); true")


HINT_TEXTS = (
    "app.graph.nodes.filter((node) => ['MGPUSPSampler', 'MGPUTDPUpscale'].includes(node.type))"
    ".map((node) => [node.type, (node.badges ?? []).map((badge) => (typeof badge === 'function' ? badge() : badge)?.text).filter((text) => /previews off/.test(text ?? ''))])"
)


def test_samplers_say_previews_are_off_until_the_preview_setting_turns_them_on(page):
    set_setting(page, "Comfy.Execution.PreviewMethod", "default")  # the server's --preview-method: none
    load_workflow(page, tiny_workflow())
    assert sorted(page.evaluate(HINT_TEXTS)) == [["MGPUSPSampler", ["previews off · Settings › Live preview"]], ["MGPUTDPUpscale", ["previews off · Settings › Live preview"]]]
    set_setting(page, "Comfy.Execution.PreviewMethod", "latent2rgb")
    try:
        page.wait_for(f"{HINT_TEXTS}.every(([, hints]) => hints.length === 0)", timeout=10)
    finally:
        set_setting(page, "Comfy.Execution.PreviewMethod", "default")
    page.wait_for(f"{HINT_TEXTS}.every(([, hints]) => hints.length === 1)", timeout=10)


# --- a run: the notes the nodes print keep the layout clear --------------------------------------------------


@pytest.mark.parametrize("nodes_2", [False, True], ids=["classic", "nodes-2.0"])
def test_a_tiny_run_prints_the_stage_2_plan_on_tdp_upscale_without_overlapping_nodes(page, nodes_2):
    """The tiny workflow on the fleet this ComfyUI starts (one CPU rank): each node's progress note
    (TDP Upscale's is the stage-2 plan, three lines) fits in the node, no node grows into another."""
    set_setting(page, "Comfy.VueNodes.Enabled", nodes_2)
    load_workflow(page, tiny_workflow())
    page.evaluate(
        "(() => { window.mgpuRun = null; const events = window.comfyAPI.api.api;"
        "events.addEventListener('execution_success', () => (window.mgpuRun = 'success'));"
        "events.addEventListener('execution_error', (event) => (window.mgpuRun = 'error: ' + JSON.stringify(event.detail).slice(0, 2000))); return true; })()"
    )
    seed = 12 if nodes_2 else 11  # another prompt than the other mode's, so ComfyUI runs it again
    for node_type in ("MGPUSPSampler", "MGPUTDPUpscale"):
        page.evaluate(f"app.graph.nodes.find((node) => node.type === '{node_type}').widgets.find((widget) => widget.name === 'seed').value = {seed}; true")
    page.evaluate("app.queuePrompt(0, 1).then(() => true)")
    assert page.wait_for("window.mgpuRun", timeout=600) == "success"
    notes = dict(settled(
        page,
        "app.graph.nodes.map((node) => [node.type, node.widgets?.find((widget) => widget.name === '$$node-text-preview')?.value ?? null])",
        "value.some(([type, note]) => type === 'MGPUTDPUpscale' && note)",
    ))  # fmt: skip
    assert notes["MGPUTDPUpscale"].startswith("stage-2 plan (auto, two-stage): tiled data parallel on 1 rank"), notes
    assert overlaps(page.evaluate(NODE_BOXES)) == []
    if nodes_2:
        shown = page.evaluate(
            """(() => {
              const note = [...document.querySelectorAll('[data-node-id] *')].find((element) => element.children.length === 0 && element.textContent.trim().startsWith('stage-2 plan'));
              if (!note) return 'no element shows the plan';
              const [box, node] = [note.getBoundingClientRect(), note.closest('[data-node-id]').getBoundingClientRect()];
              return {whole: note.scrollHeight <= note.clientHeight + 1, inside: box.bottom <= node.bottom + 1};
            })()"""
        )
        assert shown == {"whole": True, "inside": True}, shown
