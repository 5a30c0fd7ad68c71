"""ComfyUI's saved workflows (the UI format, with subgraphs) as the API graphs its server queues, and
the one edit that puts such a graph on the MGPU fleet: its model loader swapped.

What it is for: ComfyUI's own LTX-2.3 templates (``comfyui-workflow-templates``) and blueprints are
saved by ComfyUI's frontend in its UI format: nodes with positional ``widgets_values``, links as
lists, subgraph definitions whose inputs and outputs are wired through ``-10``/``-20`` pseudo nodes,
Reroutes, bypassed (mode 4) and muted (mode 2) nodes. The server's ``POST /prompt`` takes the API
format instead. ``ui_to_api`` converts one to the other as the frontend's ``graphToPrompt`` does:

- widget values are named from the node definitions of ``GET /object_info`` (``load_object_info``):
  the widget inputs in ``input_order``, the frontend-only widgets skipped (a seed's
  ``control_after_generate``, an upload button), a dynamic combo followed by its chosen option's
  widgets (``resize_type`` then ``resize_type.width``, ...);
- a subgraph's inner nodes get the ids the frontend gives them (``"<subgraph node id>:<inner id>"``,
  nested as deep as the subgraphs are), a link from a subgraph input is followed to what feeds the
  subgraph node outside (a promoted widget left unconnected keeps the inner node's own value), a link
  from a subgraph node's output to the inner node that feeds it;
- Reroutes are followed, a legacy ``PrimitiveNode`` becomes the value it holds, notes are dropped;
- a bypassed node is passed through by type (the input at the output's slot if its type fits, else
  its first input of the link's type), a muted node is left out with every input it fed.

``swap_model_loader`` is the edit: ``CheckpointLoaderSimple`` becomes ``MGPUCheckpointLoader`` and
``UNETLoader`` becomes ``MGPUDiffusionModelLoader``, with the same inputs; ``swap_ui_model_loader``
does it to a UI workflow. Nothing else of a graph changes.

Pure data: nothing here imports ComfyUI or talks to a server except ``fetch_object_info``.
"""

from __future__ import annotations

import copy
import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

MODEL_LOADER_SWAPS = {"CheckpointLoaderSimple": "MGPUCheckpointLoader", "UNETLoader": "MGPUDiffusionModelLoader"}
"""ComfyUI's loader -> the pack's drop-in with the same inputs and outputs."""
LOADER_TITLES = {
    "CheckpointLoaderSimple": "Load Checkpoint", "UNETLoader": "Load Diffusion Model",
    "MGPUCheckpointLoader": "Load Checkpoint (MGPU fleet)", "MGPUDiffusionModelLoader": "Load Diffusion Model (MGPU fleet)",
}
"""Their display names: a swapped node that kept its default title takes the drop-in's."""

SUBGRAPH_INPUT_NODE, SUBGRAPH_OUTPUT_NODE = -10, -20
MODE_MUTED, MODE_BYPASSED = 2, 4
VIRTUAL_NODES = frozenset({"Reroute", "PrimitiveNode", "Note", "MarkdownNote"})
"""Nodes that live only in the frontend: never sent to the server."""
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"
UPLOAD_WIDGETS = {"image_upload": 1, "video_upload": 1, "audio_upload": 2}
"""Frontend-only widgets an upload option adds after its combo (an upload button; for audio also a
player), each holding a place in ``widgets_values``."""
MISSING = object()  # no saved value for a widget, or no default for it


class WorkflowError(ValueError):
    """A UI workflow that cannot be converted: the message names the node and what to do."""


# -- node definitions ---------------------------------------------------------------------------------

def fetch_object_info(url: str, timeout: float = 60.0) -> dict:
    """``GET <url>/object_info`` of a running ComfyUI: every node definition it has."""
    with urllib.request.urlopen(url.rstrip("/") + "/object_info", timeout=timeout) as response:
        return json.loads(response.read())


def load_object_info(source: str | Path) -> dict:
    """Node definitions from a running ComfyUI (``http://host:port``) or a saved object_info JSON file."""
    text = str(source)
    if text.startswith(("http://", "https://")):
        return fetch_object_info(text)
    return json.loads(Path(text).read_text())


def _input_kind(spec) -> str:
    kind = spec[0]
    return "COMBO" if isinstance(kind, list) else kind


def _input_options(spec) -> dict:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def _default_value(spec):
    """The value the frontend gives a widget that a workflow has no value for."""
    options = _input_options(spec)
    if "default" in options:
        return options["default"]
    choices = spec[0] if isinstance(spec[0], list) else options.get("options")
    if _input_kind(spec) == "COMBO" and choices:
        return choices[0]
    return MISSING


def _declared_inputs(inputs: dict, order: dict | None) -> list[tuple[str, list]]:
    """(name, spec) of a definition's required then optional inputs, in the order the frontend shows them."""
    named = []
    for section in ("required", "optional"):
        specs = inputs.get(section) or {}
        names = (order or {}).get(section) or list(specs)
        named += [(name, specs[name]) for name in names if name in specs]
    return named


def _assign_widgets(node_label: str, declared: list[tuple[str, list]], values: list, linked_widgets: set[str],
                    prefix: str = "") -> tuple[dict, int]:
    """Name ``values`` (a node's ``widgets_values`` from its start) after the widget inputs of
    ``declared``; returns (name -> value, how many values were consumed)."""
    named, position = {}, 0

    def take():
        nonlocal position
        position += 1
        return values[position - 1] if position <= len(values) else MISSING

    for name, spec in declared:
        full_name, kind, options = prefix + name, _input_kind(spec), _input_options(spec)
        if kind not in WIDGET_TYPES and kind != DYNAMIC_COMBO and full_name not in linked_widgets:
            continue  # a socket (MODEL, LATENT, an autogrow or match-type input, ...)
        value = take()
        if value is MISSING:
            # Saved before the node had this widget: the frontend shows, and queues, its default.
            value = _default_value(spec)
            if value is MISSING:
                raise WorkflowError(
                    f"{node_label} has {len(values)} widget values, none for '{full_name}', which has no default; the node "
                    "definitions (object_info) do not match the ComfyUI that saved this workflow: use that ComfyUI's"
                )
        named[full_name] = value
        if kind == DYNAMIC_COMBO:
            chosen = [option for option in options.get("options", []) if option.get("key") == value]
            if not chosen:
                raise WorkflowError(f"{node_label}: '{full_name}' is {value!r}, which its definition does not offer")
            inner, used = _assign_widgets(node_label, _declared_inputs(chosen[0].get("inputs", {}), None), values[position:],
                                          linked_widgets, prefix=full_name + ".")
            named.update(inner)
            position += used
        if options.get("control_after_generate"):
            take()  # frontend-only: what to do to the value after queueing
        for option, count in UPLOAD_WIDGETS.items():
            if options.get(option):
                for _ in range(count):
                    take()
    position = min(position, len(values))
    return named, position


def widget_inputs(node: dict, definition: dict, node_label: str) -> dict:
    """A UI node's widget values by input name, as the frontend serialises them (frontend-only widgets
    dropped); checks that the definition accounts for every saved value."""
    values = node.get("widgets_values")
    if values is None:
        values = []
    if isinstance(values, dict):  # some custom nodes save their widgets by name
        return dict(values)
    linked_widgets = {entry["name"] for entry in node.get("inputs") or [] if entry.get("widget")}
    named, used = _assign_widgets(node_label, _declared_inputs(definition["input"], definition.get("input_order")), values,
                                  linked_widgets)
    if used != len(values):
        raise WorkflowError(
            f"{node_label} has {len(values)} widget values but its definition names {used}; the node definitions "
            "(object_info) do not match the ComfyUI that saved this workflow: use that ComfyUI's"
        )
    return named


# -- the graph ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Link:
    origin_id: int
    origin_slot: int
    target_id: int
    target_slot: int
    type: str


def _links(raw: list) -> dict[int, Link]:
    """A graph's links by id: the top level saves them as lists, subgraph definitions as dicts."""
    links = {}
    for entry in raw or []:
        if isinstance(entry, dict):
            links[entry["id"]] = Link(entry["origin_id"], entry["origin_slot"], entry["target_id"], entry["target_slot"], entry.get("type", "*"))
        else:
            link_id, origin_id, origin_slot, target_id, target_slot, kind = entry[:6]
            links[link_id] = Link(origin_id, origin_slot, target_id, target_slot, kind)
    return links


@dataclass
class Scope:
    """One graph level: the top level, or one instance of a subgraph inside its parent."""

    nodes: dict[int, dict]
    links: dict[int, Link]
    path: str = ""  # the execution-id prefix of its nodes ("" or "320:")
    definition: dict | None = None  # the subgraph definition, for an instance
    instance: dict | None = None  # the subgraph node in the parent scope
    parent: Scope | None = None
    children: dict[int, Scope] = field(default_factory=dict)

    def node_id(self, node: dict) -> str:
        return f"{self.path}{node['id']}"


@dataclass(frozen=True)
class Value:
    """An input fed by a value rather than a node output (a legacy PrimitiveNode, a promoted widget)."""

    value: object


def _valid_connection(a: str, b: str) -> bool:
    if a in ("*", "") or b in ("*", ""):
        return True
    return bool(set(str(a).split(",")) & set(str(b).split(",")))


class Converter:
    """One UI workflow's API graph: ``convert()`` -> {node id: {"class_type", "inputs", "_meta"}}."""

    def __init__(self, workflow: dict, object_info: dict) -> None:
        self.object_info = object_info
        self.definitions = {sub["id"]: sub for sub in (workflow.get("definitions") or {}).get("subgraphs", [])}
        self.root = Scope({node["id"]: node for node in workflow["nodes"]}, _links(workflow.get("links")))

    def child(self, scope: Scope, node: dict) -> Scope:
        if node["id"] not in scope.children:
            definition = self.definitions[node["type"]]
            scope.children[node["id"]] = Scope(
                {inner["id"]: inner for inner in definition["nodes"]}, _links(definition.get("links")),
                path=f"{scope.node_id(node)}:", definition=definition, instance=node, parent=scope,
            )
        return scope.children[node["id"]]

    def label(self, scope: Scope, node: dict) -> str:
        title = node.get("title") or node["type"]
        return f"node {scope.node_id(node)} ({title})"

    # -- following links to their source

    def resolve_link(self, scope: Scope, link_id: int | None, seen: frozenset = frozenset()):
        """What feeds a link: (execution id, output slot), a Value, or None (nothing: the input is dropped)."""
        if link_id is None:
            return None
        if (scope.path, link_id) in seen:
            raise WorkflowError(f"link {link_id} in '{scope.path or 'the top level'}' is part of a loop of reroutes or bypassed nodes")
        seen = seen | {(scope.path, link_id)}
        link = scope.links.get(link_id)
        if link is None:
            raise WorkflowError(f"link {link_id} is used in '{scope.path or 'the top level'}' but not saved there; the workflow is damaged")
        if link.origin_id == SUBGRAPH_INPUT_NODE:
            return self.resolve_subgraph_input(scope, link.origin_slot, seen)
        origin = scope.nodes.get(link.origin_id)
        if origin is None:
            raise WorkflowError(f"link {link_id} starts at node {link.origin_id}, which is not in the workflow; the workflow is damaged")
        return self.resolve_output(scope, origin, link.origin_slot, link.type, seen)

    def resolve_output(self, scope: Scope, node: dict, slot: int, link_type: str, seen: frozenset):
        mode = node.get("mode", 0)
        if mode == MODE_MUTED:
            return scope.node_id(node), slot  # never sent: ``convert`` then removes the input, widget value and all
        if mode == MODE_BYPASSED:
            inputs = node.get("inputs") or []
            outputs = node.get("outputs") or []
            output_type = outputs[slot]["type"] if slot < len(outputs) else link_type
            if link_type in ("*", ""):
                index = slot if slot < len(inputs) else 0
            elif slot < len(inputs) and _valid_connection(inputs[slot]["type"], output_type):
                index = slot
            else:
                index = next((i for i, entry in enumerate(inputs) if entry["type"] == link_type), -1)
            if index < 0 or index >= len(inputs):
                return None
            return self.resolve_link(scope, inputs[index].get("link"), seen)
        if node["type"] in self.definitions:
            inner = self.child(scope, node)
            outputs = inner.definition.get("outputs") or []
            link_ids = outputs[slot].get("linkIds") or [] if slot < len(outputs) else []
            return self.resolve_link(inner, link_ids[0], seen) if link_ids else None
        if node["type"] == "Reroute":
            (entry,) = node.get("inputs") or [{"link": None}]
            return self.resolve_link(scope, entry.get("link"), seen)
        if node["type"] == "PrimitiveNode":
            values = node.get("widgets_values") or [None]
            return Value(values[0])
        if node["type"] in VIRTUAL_NODES:
            return None
        return scope.node_id(node), slot

    def resolve_subgraph_input(self, scope: Scope, slot: int, seen: frozenset):
        """A link from a subgraph's input: what feeds the subgraph node's input of that name outside,
        its promoted widget's value, or None (the inner node then keeps its own widget value)."""
        declared = scope.definition["inputs"][slot]
        outer_inputs = scope.instance.get("inputs") or []
        entry = next((item for item in outer_inputs if item["name"] == declared["name"]), None)
        if entry is not None and entry.get("link") is not None:
            return self.resolve_link(scope.parent, entry["link"], seen)
        values = scope.instance.get("widgets_values") or []
        widget_names = [item["name"] for item in outer_inputs if item.get("widget")]
        if isinstance(values, list) and values and len(values) == len(widget_names) and declared["name"] in widget_names:
            return Value(values[widget_names.index(declared["name"])])
        return None

    # -- the nodes

    def convert(self) -> dict:
        graph: dict = {}
        self.add_scope(self.root, graph)
        # As the frontend does: an input fed by a node that is not sent (muted) is removed.
        for entry in graph.values():
            for name, value in list(entry["inputs"].items()):
                if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and value[0] not in graph:
                    del entry["inputs"][name]
        return graph

    def add_scope(self, scope: Scope, graph: dict) -> None:
        for node in scope.nodes.values():
            mode = node.get("mode", 0)
            if mode in (MODE_MUTED, MODE_BYPASSED) or node["type"] in VIRTUAL_NODES:
                continue
            if node["type"] in self.definitions:
                self.add_scope(self.child(scope, node), graph)
                continue
            definition = self.object_info.get(node["type"])
            if definition is None:
                raise WorkflowError(
                    f"{self.label(scope, node)}: ComfyUI has no node type '{node['type']}'; install the custom node pack "
                    "that provides it (or use object_info from a ComfyUI that has it)"
                )
            inputs = widget_inputs(node, definition, self.label(scope, node))
            for entry in node.get("inputs") or []:
                source = self.resolve_link(scope, entry.get("link"))
                if source is None:
                    continue  # unconnected: a widget keeps its own value, a socket stays empty
                inputs[entry["name"]] = source.value if isinstance(source, Value) else [source[0], source[1]]
            for name, value in inputs.items():
                if isinstance(value, list) and not (len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)):
                    inputs[name] = {"__value__": value}  # the frontend's wrapping of a list value
            graph[scope.node_id(node)] = {
                "inputs": inputs, "class_type": node["type"],
                "_meta": {"title": node.get("title") or definition.get("display_name") or node["type"]},
            }


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    """The API graph (``POST /prompt``'s ``prompt``) of a UI-format workflow, as ComfyUI's frontend makes it."""
    return Converter(workflow, object_info).convert()


# -- the fleet's loader -------------------------------------------------------------------------------

def swap_model_loader(api_graph: dict) -> dict:
    """A copy of an API graph with ComfyUI's model loaders replaced by the MGPU fleet's drop-ins; raises
    if the graph has none (nothing would run on the fleet)."""
    swapped = copy.deepcopy(api_graph)
    count = 0
    for entry in swapped.values():
        stock = entry["class_type"]
        if stock in MODEL_LOADER_SWAPS:
            entry["class_type"] = MODEL_LOADER_SWAPS[stock]
            meta = entry.get("_meta") or {}
            if meta.get("title") == LOADER_TITLES[stock]:
                meta["title"] = LOADER_TITLES[entry["class_type"]]
            count += 1
    if not count:
        raise WorkflowError(f"the graph has no {' or '.join(MODEL_LOADER_SWAPS)} to swap for the MGPU fleet's loader")
    return swapped


def swap_ui_model_loader(workflow: dict) -> dict:
    """A copy of a UI workflow with ComfyUI's model loaders (at the top level and in every subgraph)
    replaced by the MGPU fleet's drop-ins; their widgets, links, properties and model links stay."""
    swapped = copy.deepcopy(workflow)
    count = 0
    for nodes in [swapped["nodes"], *(sub["nodes"] for sub in (swapped.get("definitions") or {}).get("subgraphs", []))]:
        for node in nodes:
            if node["type"] in MODEL_LOADER_SWAPS:
                node["type"] = MODEL_LOADER_SWAPS[node["type"]]
                properties = node.setdefault("properties", {})
                if "Node name for S&R" in properties:
                    properties["Node name for S&R"] = node["type"]
                count += 1
    if not count:
        raise WorkflowError(f"the workflow has no {' or '.join(MODEL_LOADER_SWAPS)} to swap for the MGPU fleet's loader")
    return swapped


def model_files(workflow: dict) -> list[dict]:
    """The model downloads a UI workflow names (its nodes' ``properties.models``: name, url, directory), each once."""
    found: dict[tuple, dict] = {}
    for nodes in [workflow["nodes"], *(sub["nodes"] for sub in (workflow.get("definitions") or {}).get("subgraphs", []))]:
        for node in nodes:
            for entry in (node.get("properties") or {}).get("models") or []:
                found.setdefault((entry["directory"], entry["name"]), dict(entry))
    return list(found.values())
