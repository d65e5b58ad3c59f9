"""Paged-attention decode for one query token (GQA), split over the context on tensor cores.

    plan.py       the split plan, measured defaults, shared-memory layout, partial buffers,
                  argument check (imports nothing of the kernels)
    reference.py  NumPy models: the float64 reference, split + combine, the fragment mapping
    combine.py    attn_combine: merge the splits' partials into o fp16
    decode.py     attn_split's body (tensor cores)
    launch.py     its name and compiled form, and decode_launcher (split, then combine)

Imports run top-down in that order; none imports one below it.
"""
from nq.kernels.attention.plan import decode_workspace, default_max_splits, split_plan
from nq.kernels.attention.reference import attention_reference
from nq.kernels.attention.launch import decode_launcher

__all__ = ["attention_reference", "decode_launcher", "decode_workspace", "default_max_splits",
           "split_plan"]
