// comfyui-mgpu templates: lists the pack's workflows in the template browser in the pack's order
// (the no-download tiny ones first), as web/template_order.json names them.
//
// ComfyUI v0.20.1 answers GET /workflow_templates with each pack's file names in the order its
// directory listing happens to give; frontend 1.43.18 shows them so, and takes each file name as
// the template's title. This wraps the one call that fetches that list and sorts this pack's
// names; other packs' lists and every other call are left as they are. template_order.json is
// written by workflows/make_workflows.py from its TEMPLATES table, the one place the order is set.

import { api } from "../../scripts/api.js";

// The folder ComfyUI loaded this pack from (its templates are listed under that name).
const PACK = decodeURIComponent(new URL(import.meta.url).pathname.split("/").at(-2));

async function templateOrder() {
  try {
    const response = await fetch(new URL("./template_order.json", import.meta.url));
    return response.ok ? await response.json() : [];
  } catch {
    return [];
  }
}

if (typeof api.getWorkflowTemplates === "function") {
  const listTemplates = api.getWorkflowTemplates.bind(api);
  api.getWorkflowTemplates = async () => {
    const [templates, order] = await Promise.all([listTemplates(), templateOrder()]);
    const names = templates?.[PACK];
    if (Array.isArray(names) && order.length) {
      const rank = (name) => (order.includes(name) ? order.indexOf(name) : order.length);
      templates[PACK] = [...names].sort((first, second) => rank(first) - rank(second) || first.localeCompare(second));
    }
    return templates;
  };
}
