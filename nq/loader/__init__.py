"""HF snapshot -> INT4 .nanoqwen file, and reading it back by mmap.

  quant    INT4 g128 symmetric quantisation, ValueShuffle packing (the layout decision)
  format   the .nanoqwen v1 writer/reader (docs/FORMAT.md)
  hf       resolve a snapshot, read safetensors by mmap, the HF->nq name map, pack()
  weights  fp32 host weights for the NumPy reference; fake_quantize for tests
  synth    synthetic Qwen2 snapshots (random weights, tokenizer) for tests and benchmarks
  resolve  `-m` (a file, a folder, a repo id) -> one .nanoqwen path

The names below are imported on first use (PEP 562), not with the package: `nq` imports
nq.loader.resolve to build its parser, and numpy's import (~0.1 s) should wait for a command
that reads a file.
"""
_EXPORTS = {"FormatError": "format", "NanoqwenFile": "format", "open_nanoqwen": "format",
            "write_nanoqwen": "format", "LoadError": "hf", "pack": "hf",
            "resolve_snapshot": "hf"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f"nq.loader.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'nq.loader' has no attribute {name!r}")
