"""Triton gather/scatter between tensors and fixed-size blocks of an offload arena.

Reusable in any GPU <-> host block offload: this package knows tensors, byte
counts and block tables only (it never imports the engine or vLLM).

Set ``TRITON_INTERPRET=1`` before importing it to run the same kernels on CPU
tensors under the Triton interpreter.
"""

from .api import kernel_variants, pack, plan_batch, triton_available, unpack, warm_up
from .block_copy import KernelVariant
from .items import ItemViews, empty_items
from .plan import PACK_CONFIG, UNPACK_CONFIG, VEC_WIDTHS, CopyPlan, LaunchConfig
from .planner import plan_copy
from .reference import reference_pack, reference_unpack
from .step_table import PlanError, StepTable

__all__ = [
    "PACK_CONFIG",
    "UNPACK_CONFIG",
    "VEC_WIDTHS",
    "CopyPlan",
    "ItemViews",
    "KernelVariant",
    "LaunchConfig",
    "PlanError",
    "StepTable",
    "empty_items",
    "kernel_variants",
    "pack",
    "plan_batch",
    "plan_copy",
    "reference_pack",
    "reference_unpack",
    "triton_available",
    "unpack",
    "warm_up",
]
