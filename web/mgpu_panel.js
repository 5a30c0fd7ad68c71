// comfyui-mgpu web panel: the fleet at a glance (devices, per-rank memory, current stage and step,
// queue) with Restart and Unload buttons.
//
// It reads GET /mgpu/status (polled while the panel is open) and the "mgpu.status" websocket events
// the MGPU nodes send on every fleet progress step; the buttons call POST /mgpu/restart and
// POST /mgpu/unload. It only displays and asks: it never starts the fleet or queues work. What it
// says about a fleet that is not running is the server's one sentence (nodes/fleet_admin.py), the
// same the MGPU Fleet Control node prints. Its look follows ComfyUI's theme (its CSS variables).

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const POLL_MS = 3000;

function gib(bytes) {
  return typeof bytes === "number" ? `${(bytes / 2 ** 30).toFixed(2)} GiB` : "-";
}

function rankMemory(memory) {
  if (!memory) return "-";
  if (memory.allocated !== undefined) {
    const total = memory.total !== undefined ? ` of ${gib(memory.total)}` : "";
    return `${gib(memory.allocated)} alloc, ${gib(memory.reserved)} reserved, peak ${gib(memory.peak)}${total}`;
  }
  return memory.rss !== undefined ? `${gib(memory.rss)} RSS` : "-";
}

function element(tag, style = {}, text = "") {
  const node = document.createElement(tag);
  Object.assign(node.style, style);
  if (text) node.textContent = text;
  return node;
}

// ComfyUI's theme variables (frontend 1.43), with the older names as fallbacks.
const PANEL_CSS = `
.mgpu-panel { padding: 10px; font-size: 12px; line-height: 1.5; color: var(--base-foreground, var(--fg-color)); }
.mgpu-panel .mgpu-title { font-weight: 600; font-size: 13px; }
.mgpu-panel .mgpu-buttons { display: flex; flex-wrap: wrap; gap: 6px; margin: 8px 0; }
.mgpu-panel button {
  font: inherit; cursor: pointer; padding: 4px 10px; border-radius: 6px;
  color: var(--base-foreground, var(--input-text));
  background: var(--secondary-background, var(--comfy-input-bg));
  border: 1px solid var(--border-color, transparent);
}
.mgpu-panel button:hover:not(:disabled) { background: var(--secondary-background-hover, var(--comfy-menu-bg)); }
.mgpu-panel button:disabled { opacity: 0.5; cursor: default; }
.mgpu-panel .mgpu-body { font-family: monospace; }
.mgpu-panel .mgpu-state { color: var(--descrip-text, inherit); }
`;

function addPanelStyle() {
  if (document.getElementById("mgpu-panel-style")) return;
  const style = element("style");
  style.id = "mgpu-panel-style";
  style.textContent = PANEL_CSS;
  document.head.append(style);
}

class FleetPanel {
  constructor() {
    this.status = null;
    this.lastProgress = null;
    this.message = "";
    addPanelStyle();
    this.root = element("div");
    this.root.className = "mgpu-panel";
    this.body = element("div");
    this.body.className = "mgpu-body";
    const buttons = element("div");
    buttons.className = "mgpu-buttons";
    this.buttons = [

      this.button("Refresh", () => this.refresh()),
      this.button("Unload models", () => this.action("/mgpu/unload", "Unloading models...")),
      this.button("Restart fleet", () => this.action("/mgpu/restart", "Stopping the fleet...")),
    ];
    buttons.append(...this.buttons);
    const title = element("div", {}, "MGPU fleet (LTX-2)");
    title.className = "mgpu-title";
    this.root.append(title, buttons, this.body);
  }

  button(label, onClick) {
    const node = element("button", {}, label);
    node.type = "button";
    node.addEventListener("click", onClick);
    return node;
  }

  async refresh() {
    try {
      const response = await api.fetchApi("/mgpu/status");
      this.status = await response.json();
    } catch (error) {
      this.status = { running: false, message: `status request failed: ${error}` };
    }
    this.render();
  }

  async action(route, pending) {
    this.message = pending;
    this.buttons.forEach((button) => (button.disabled = true));
    this.render();
    try {
      const response = await api.fetchApi(route, { method: "POST" });
      this.message = (await response.json()).message;
    } catch (error) {
      this.message = `${route} failed: ${error}`;
    } finally {
      this.buttons.forEach((button) => (button.disabled = false));
    }
    await this.refresh();
  }

  onProgress(event) {
    this.lastProgress = event;
    this.render();
  }

  render() {
    const lines = [];
    const status = this.status;
    if (!status) {
      lines.push("loading...");
    } else if (!status.running) {
      lines.push(status.message);
    } else {
      lines.push(`${status.devices}, server pid ${status.server_pid}, up ${status.uptime_seconds} s`);
      for (const rank of status.ranks ?? []) {
        lines.push(`rank ${rank.rank} ${rank.device} ${rank.alive ? "alive" : "DEAD"}: ${rankMemory(rank.memory)}`);
      }
      const job = status.current_job;
      lines.push(job ? `job: ${job.op} ${job.stage ?? ""} ${job.step ?? 0}/${job.total ?? 0}` : "job: none");
      lines.push(`queue: ${status.queue_length} waiting, ${status.jobs_completed} done, ${status.fleet_restarts} restart(s)`);
    }
    const progress = this.lastProgress;
    if (progress) {
      const times = (progress.rank_seconds ?? [])
        .map((seconds, rank) => `r${rank} ${seconds == null ? "-" : `${Number(seconds).toFixed(2)} s`}`)
        .join("  ");
      lines.push(`last step: ${progress.title ?? ""} ${progress.stage} ${progress.step}/${progress.total} ${times}`);
    }
    if (this.message) lines.push(this.message);
    this.body.replaceChildren(...lines.map((line) => element("div", {}, line)));
  }

  startPolling() {
    this.refresh();
    this.timer ??= setInterval(() => this.refresh(), POLL_MS);
  }

  stopPolling() {
    clearInterval(this.timer);
    this.timer = undefined;
  }
}

app.registerExtension({
  name: "comfyui-mgpu.FleetPanel",
  async setup() {
    const panel = new FleetPanel();
    api.addEventListener("mgpu.status", (event) => panel.onProgress(event.detail));

    const sidebar = app.extensionManager?.registerSidebarTab;
    if (sidebar) {
      app.extensionManager.registerSidebarTab({
        id: "comfyui-mgpu-fleet",
        icon: "pi pi-server",
        title: "MGPU",
        tooltip: "MGPU fleet: devices, memory, progress, restart",
        type: "custom",
        render: (container) => {
          container.replaceChildren(panel.root);
          panel.startPolling();
        },
        destroy: () => panel.stopPolling(),
      });
      return;
    }
    // Older frontends without sidebar tabs: a small floating box in the corner.
    Object.assign(panel.root.style, {
      position: "fixed", right: "8px", bottom: "8px", zIndex: 1000, maxWidth: "420px",
      background: "var(--comfy-menu-bg, #222)", color: "var(--fg-color, #ddd)", border: "1px solid #555", borderRadius: "6px",
    });
    document.body.append(panel.root);
    panel.startPolling();
  },
});
