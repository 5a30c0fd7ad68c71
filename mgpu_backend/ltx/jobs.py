"""LTX-2 job types: load, encode, sample (stage 1), upscale (stage 2), decode."""
