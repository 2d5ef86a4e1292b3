"""Loading a CPU test module so a GPU module can run its tests again on the device (with its own fixtures)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load(relative: str) -> ModuleType:
    """``tests/<relative>`` as a module of its own (not collected twice under its own name)."""
    path = Path(__file__).parents[1] / relative
    spec = importlib.util.spec_from_file_location(f"cpu_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module
