"""nq: batch-1 INT4 inference for Qwen2/Qwen2.5 on NVIDIA Hopper, in Python.

Where things live (the folders follow the data):
  nq/loader   HF snapshot -> quantise -> .nanoqwen file, and reading it back by mmap
  nq/config   ModelConfig, the one place model dimensions are validated
  nq/ref      the NumPy reference engine (oracle for every kernel, and a CPU backend)
  nq/text     tokenizer, chat template, FIM prompts, streaming detokenisation
  nq/ptx      one wrapper per PTX instruction, each with a Python twin
  nq/paged    the page pool and decode-state layout that kernels and runtime share
  nq/kernels  every piece of device code, compiled through kernels/build.py
  nq/runtime  the GPU engine: weights, KV pages, batched prefill, the decode graph
  nq/tools    nq bench and nq verify
  nq/serve    nq serve: the OpenAI- and llama.cpp-compatible HTTP server
  nq/cli      the `nq` command (generate, chat, pack, info, cache, ...)
"""
__version__ = "0.5.0"
