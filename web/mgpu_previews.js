// comfyui-mgpu previews hint: a badge on SP Sampler and TDP Upscale while live previews are off.
//
// The samplers stream a strip of preview frames of the video being denoised, but only when ComfyUI
// previews at all: its "Live preview method" setting (Comfy.Execution.PreviewMethod), whose
// "default" means the server's --preview-method, which is "none" unless ComfyUI was started with
// one. Nothing in ComfyUI says so, so the nodes do, until previews are on.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const SAMPLERS = new Set(["MGPUSPSampler", "MGPUTDPUpscale"]);
const HINT = "previews off · Settings › Live preview";
const CHECK_MS = 2000;

let serverMethod = "none";

function methodFromArgv(argv) {
  for (const [index, arg] of (argv ?? []).entries()) {
    if (arg === "--preview-method") return argv[index + 1] ?? "none";
    if (arg.startsWith("--preview-method=")) return arg.slice("--preview-method=".length);
  }
  return "none"; // ComfyUI's default (comfy/cli_args.py)
}

export function previewsOff() {
  const chosen = app.extensionManager?.setting?.get?.("Comfy.Execution.PreviewMethod") ?? "default";
  return (chosen === "default" ? serverMethod : chosen) === "none";
}

let Badge = null;

function badgeClass() {
  // The frontend's badge class, from the badge it gives every node of a pack (it exports no name
  // for it): taken from a node made for the purpose and never added to the graph.
  const probe = globalThis.LiteGraph?.createNode?.("MGPUFleetControl");
  const badge = (probe?.badges ?? []).map((entry) => (typeof entry === "function" ? entry() : entry)).find(Boolean);
  return badge && badge.constructor !== Object ? badge.constructor : null;
}

function hintBadge() {
  return Badge ? new Badge({ text: HINT, fgColor: "#1d1d1d", bgColor: "#e0b050" }) : null;
}

function showHint(node, show) {
  node.mgpuPreviewHint ??= hintBadge();
  const badge = node.mgpuPreviewHint;
  if (!badge || !Array.isArray(node.badges)) return false;
  const shown = node.badges.includes(badge);
  if (show === shown) return false;
  if (show) node.badges.push(badge);
  else node.badges.splice(node.badges.indexOf(badge), 1);
  return true;
}

function refreshHints() {
  const off = previewsOff();
  let changed = false;
  for (const node of app.graph?.nodes ?? []) {
    if (SAMPLERS.has(node.type)) changed = showHint(node, off) || changed;
  }
  if (changed) app.graph?.setDirtyCanvas?.(true, true);
}

app.registerExtension({
  name: "comfyui-mgpu.PreviewHint",
  async setup() {
    try {
      serverMethod = methodFromArgv((await api.getSystemStats())?.system?.argv);
    } catch {
      serverMethod = "none";
    }
    Badge = badgeClass();
    refreshHints();
    setInterval(refreshHints, CHECK_MS);
  },
  nodeCreated(node) {
    // At once, before "Nodes 2.0" draws the node: it reads the badges when it first renders it.
    if (SAMPLERS.has(node.comfyClass ?? node.type)) showHint(node, previewsOff());
  },
});
