"""ComfyUI entry point of comfyui-mgpu: LTX-2 audio+video generation spread over several GPUs.

ComfyUI imports this folder as a package from ``custom_nodes/`` and reads NODE_CLASS_MAPPINGS,
NODE_DISPLAY_NAME_MAPPINGS and WEB_DIRECTORY. The nodes are imported relatively (ComfyUI owns the
top-level name ``nodes``); ``mgpu_backend`` is imported absolutely, from this folder unless an
installed copy is already importable. The panel's HTTP routes are added only inside ComfyUI.
This file must stay cheap and must never start the fleet: that happens on the first node run.
"""

import importlib.util
import os
import sys

_PACK_DIR = os.path.dirname(os.path.abspath(__file__))
if importlib.util.find_spec("mgpu_backend") is None:
    # Appended, not prepended: this folder also holds 'nodes' and 'tests', which must never shadow
    # ComfyUI's own modules of the same names.
    sys.path.append(_PACK_DIR)

WEB_DIRECTORY = "./web"

if not __package__:
    # Imported as a plain module, not as ComfyUI's package: pytest does this to a checkout whose
    # folder name is not a Python identifier (e.g. comfyui-mgpu). There is nothing to register.
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = {}, {}
else:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS


def _comfy_prompt_server():
    """ComfyUI's running PromptServer, read from the module ComfyUI's main has already loaded. Never
    imported here: anywhere else (a rank process, a test that put ComfyUI's folder on the path) importing
    ComfyUI's ``server`` would start importing the whole server, and fail without a GPU."""
    import sys

    server = sys.modules.get("server")
    return getattr(getattr(server, "PromptServer", None), "instance", None)


if __package__ and _comfy_prompt_server() is not None:
    from .nodes.routes import register_routes

    register_routes(_comfy_prompt_server())

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
