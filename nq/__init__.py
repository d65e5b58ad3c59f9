"""nq: batch-1 INT4 inference for Qwen2/Qwen2.5 on NVIDIA Hopper, in Python.

Where things live (the folders follow the data):
  nq/loader   HF snapshot -> quantise -> .nanoqwen file, and reading it back by mmap
  nq/config   ModelConfig, the one place model dimensions are validated
  nq/ref      the NumPy reference engine (oracle for every kernel, and a CPU backend)
  nq/text     tokenizer, chat template, FIM prompts, streaming detokenisation
  nq/ptx      one wrapper per PTX instruction, each with a Python twin
  nq/kernels  every piece of device code
  nq/runtime/engine   the GPU orchestrator: weights, KV pages, decode graphs
  nq/cli      the `nq` command
"""
__version__ = "0.1.0"
