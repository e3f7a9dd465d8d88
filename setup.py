"""The planner's C pass as an extension module, built at install time (everything else is
in pyproject.toml).

``optional=True``: where no C compiler or no Python headers are found the install
warns ("building extension ... failed") and goes on; the planner then runs its
Python passes (slower for fragmented steps, same results).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ecoffload.kernels._plan_native",
            ["kernels/plan_native.c"],
            # CPython's own release flags: asserts off, signed overflow defined.
            extra_compile_args=["-O2", "-fwrapv"],
            define_macros=[("NDEBUG", None)],
            optional=True,
        )
    ]
)
