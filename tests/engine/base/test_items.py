"""An item's dtype as a stored name and back (engine/base/items.py); its CRC-32 is
tested in test_catalog.py and test_integrity.py."""

import pytest
import torch

from ecoffload.engine.base import items
from ecoffload.engine.base.items import dtype_from_name, dtype_name

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, torch.bool,
          torch.float8_e4m3fn]  # fmt: skip


@pytest.fixture(autouse=True)
def empty_table(monkeypatch):
    """Every test reads names through torch: the process-wide table starts empty (a
    forked test process would otherwise inherit the names its parent already read)."""
    monkeypatch.setattr(items, "_BY_NAME", {})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_dtype_is_stored_as_its_short_name_and_read_back_as_itself(dtype):
    assert dtype_name(dtype) not in items._BY_NAME
    name = dtype_name(dtype)
    assert name == str(dtype).split(".", 1)[1] and "torch" not in name
    assert dtype_from_name(name) is dtype
    assert items._BY_NAME[name] is dtype  # kept: the next read costs no getattr
    assert dtype_from_name(name) is dtype


def test_a_name_read_back_comes_from_the_kept_table_first(monkeypatch):
    monkeypatch.setitem(items._BY_NAME, "float16", torch.bfloat16)
    assert dtype_from_name("float16") is torch.bfloat16


@pytest.mark.parametrize("name", ["nn", "no_such_dtype", "Tensor"])
def test_a_name_that_is_no_torch_dtype_is_refused_by_name(name):
    with pytest.raises(ValueError) as err:
        dtype_from_name(name)
    assert str(err.value) == f"{name!r} is not a torch dtype name (e.g. 'bfloat16')"
    assert name not in items._BY_NAME


def test_a_name_never_imports_a_module_and_a_dtype_no_tensor_can_hold_is_refused():
    # Names come from the cluster store's value headers (unauthenticated without a
    # cluster key): torch's module __getattr__ imports torch.onnx for "onnx", and
    # quantized dtypes pass getattr but no tensor of them can be made to load into.
    import subprocess
    import sys

    probe = (
        "import sys, torch\n"
        "from ecoffload.engine.base.items import dtype_from_name\n"
        "try:\n    dtype_from_name('onnx')\nexcept ValueError:\n    pass\n"
        "print('torch.onnx' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.strip() == "False", "a dtype name imported torch.onnx"
    for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4"):
        if isinstance(getattr(torch, name, None), torch.dtype):
            with pytest.raises(ValueError, match="not a torch dtype name"):
                dtype_from_name(name)
