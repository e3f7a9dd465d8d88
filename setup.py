"""The two C fast passes as extension modules, built at install time (everything else is
in pyproject.toml): the planner's (``kernels/plan_native.c``) and the shared catalog's
hits, pins and unpins (``engine/catalog/shared/native.c``).

``optional=True``: where no C compiler or no Python headers are found the install
warns ("building extension ... failed") and goes on; the planner then runs its
Python passes (slower for fragmented steps, same results) and the catalog its
Python methods (same words written, slower per hit).
"""

import os

from setuptools import Extension, setup

# CPython's own release flags: asserts off, signed overflow defined.
FLAGS = dict(extra_compile_args=["-O2", "-fwrapv"], define_macros=[("NDEBUG", None)])
if os.environ.get("ECOFFLOAD_SANITIZE") == "1":  # `make sanitize`: ASan + UBSan, overflow UB
    SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    DEBUG = ["-O1", "-g", "-fno-omit-frame-pointer", "-fno-wrapv"]
    FLAGS = dict(extra_compile_args=[*DEBUG, *SANITIZE], extra_link_args=SANITIZE)

setup(
    ext_modules=[
        Extension(
            "ecoffload.kernels._plan_native", ["kernels/plan_native.c"], optional=True, **FLAGS
        ),
        Extension(
            "ecoffload.engine.catalog.shared._catalog_native",
            ["engine/catalog/shared/native.c"],
            optional=True,
            **FLAGS,
        ),
    ]
)
