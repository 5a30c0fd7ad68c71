"""End-to-end tests: the pack inside a real ComfyUI (skipped unless COMFYUI_DIR is set)."""
