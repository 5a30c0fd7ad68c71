"""HTTP routes of the MGPU web panel on ComfyUI's server: GET /mgpu/status, POST /mgpu/restart,
POST /mgpu/unload (ComfyUI also serves each under /api/...).

Imported by the pack's root ``__init__`` only when ComfyUI's server is importable. Each handler runs
its blocking fleet call in a worker thread so ComfyUI's event loop never waits on the fleet.
Progress reaches the panel separately, as ``mgpu.status`` websocket events (see ``fleet_job``).
"""

from __future__ import annotations

import asyncio
import logging

from . import fleet_admin

log = logging.getLogger("comfyui-mgpu")


async def _off_loop(function):
    return await asyncio.get_running_loop().run_in_executor(None, function)


def register_routes(prompt_server) -> None:
    """Add the panel's routes to ``PromptServer.instance`` (before ComfyUI mounts its route table)."""
    from aiohttp import web

    routes = prompt_server.routes

    @routes.get("/mgpu/status")
    async def mgpu_status(request):
        return web.json_response(await _off_loop(fleet_admin.status_snapshot))

    @routes.post("/mgpu/restart")
    async def mgpu_restart(request):
        result = await _off_loop(fleet_admin.stop_fleet)
        log.info("MGPU panel: %s", result["message"])
        return web.json_response(result)

    @routes.post("/mgpu/unload")
    async def mgpu_unload(request):
        result = await _off_loop(fleet_admin.unload_models)
        log.info("MGPU panel: %s", result["message"])
        return web.json_response(result)
