"""HF snapshot -> INT4 .nanoqwen file, and reading it back by mmap.

  quant    INT4 g128 symmetric quantisation, ValueShuffle packing (the layout decision)
  format   the .nanoqwen v1 writer/reader (docs/FORMAT.md)
  hf       resolve a snapshot, read safetensors by mmap, the HF->nq name map, pack()
  weights  fp32 host weights for the NumPy reference; fake_quantize for tests
  synth    synthetic Qwen2 snapshots (random weights, tokenizer) for tests and benchmarks
"""
from nq.loader.format import FormatError, NanoqwenFile, open_nanoqwen, write_nanoqwen
from nq.loader.hf import LoadError, pack, resolve_snapshot

__all__ = ["FormatError", "LoadError", "NanoqwenFile", "open_nanoqwen", "pack",
           "resolve_snapshot", "write_nanoqwen"]
