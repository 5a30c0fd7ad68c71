"""LTX-2 stages built on ltx-core 1.0.0 (wrapped, never edited). Runs inside the fleet's ranks."""
