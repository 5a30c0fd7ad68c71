// comfyui-mgpu previews hint: a badge on SP Sampler and TDP Upscale while live previews are off.
//
// The samplers stream a strip of preview frames of the video being denoised, but only when ComfyUI
// previews at all: its "Live preview method" setting (Comfy.Execution.PreviewMethod), whose
// "default" means the server's --preview-method, which is "none" unless ComfyUI was started with
// one. Nothing in ComfyUI says so, so the nodes do, until previews are on.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const SAMPLERS = new Set(["MGPUSPSampler", "MGPUTDPUpscale"]);
const HINT = "previews off: Settings › Live preview method";
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

function hintBadge(node) {
  // The frontend's badge class, from a badge it gave the node (it exports no name for it).
  const existing = (node.badges ?? []).map((badge) => (typeof badge === "function" ? badge() : badge)).find((badge) => badge?.constructor);
  const Badge = existing?.constructor;
  if (!Badge || Badge === Object) return null;
  return new Badge({ text: HINT, fgColor: "#1d1d1d", bgColor: "#e0b050" });
}

function showHint(node, show) {
  node.mgpuPreviewHint ??= hintBadge(node);
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
    refreshHints();
    setInterval(refreshHints, CHECK_MS);
  },
  nodeCreated(node) {
    if (SAMPLERS.has(node.comfyClass ?? node.type)) setTimeout(refreshHints, 0);
  },
});
