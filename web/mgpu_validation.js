// comfyui-mgpu validation errors: one error per refusal, under the input at fault.
//
// ComfyUI v0.20.1 files a refusal of a node's VALIDATE_INPUTS under every input the method takes, so
// one bad frame count on SP Sampler came back as seven errors and circled seven inputs, linked ones
// too. The pack's refusals start with the name of the input at fault ("length: frames must be
// 8k+1 ..."; nodes/validation.py); this keeps that input's copy, its details the refusal itself,
// and drops the copies under the other inputs. Errors of any other form are left exactly as they are.

import { api } from "../../scripts/api.js";

const FAULT = /^([A-Za-z_][A-Za-z0-9_]*): ([\s\S]*)$/;

function refusal(error) {
  // ComfyUI writes "<input> - <what VALIDATE_INPUTS returned>" in details.
  const input = error?.extra_info?.input_name;
  if (error?.type !== "custom_validation_failed" || !input) return null;
  const prefix = `${input} - `;
  const returned = typeof error.details === "string" && error.details.startsWith(prefix) ? error.details.slice(prefix.length) : null;
  const match = returned?.match(FAULT);
  return match ? { input, fault: match[1], returned } : null;
}

export function oneErrorPerFault(nodeErrors) {
  if (!nodeErrors || typeof nodeErrors !== "object") return nodeErrors;
  for (const entry of Object.values(nodeErrors)) {
    if (!Array.isArray(entry?.errors)) continue;
    const inputs = new Set(entry.errors.map((error) => error?.extra_info?.input_name));
    entry.errors = entry.errors.flatMap((error) => {
      const parsed = refusal(error);
      if (!parsed || !inputs.has(parsed.fault)) return [error];
      return parsed.input === parsed.fault ? [{ ...error, details: parsed.returned }] : [];
    });
  }
  return nodeErrors;
}

if (typeof api.queuePrompt === "function") {
  const queuePrompt = api.queuePrompt.bind(api);
  api.queuePrompt = async (...args) => {
    try {
      const reply = await queuePrompt(...args);
      if (reply?.node_errors) oneErrorPerFault(reply.node_errors);
      return reply;
    } catch (error) {
      if (error?.response?.node_errors) oneErrorPerFault(error.response.node_errors);
      throw error;
    }
  };
}
