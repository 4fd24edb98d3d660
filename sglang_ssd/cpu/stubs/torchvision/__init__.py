"""Import stand-in for ``torchvision`` with CPU torch (see ``sglang_ssd/cpu/__init__.py``).

SGLang imports ``torchvision.transforms`` at module level (multimodal helpers), but PyPI's
torchvision for torch 2.13 links CUDA and cannot load beside CPU torch.  Text-only models never
call it: every attribute is a mock that raises ``NotImplementedError`` when used, except a real
``InterpolationMode`` enum.
"""

import enum
import importlib.abc
import importlib.machinery
import sys
import types

IS_STANDIN = True
__version__ = "0.0.0+sglang-ssd-cpu-standin"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("torchvision is not available in the sglang-ssd CPU environment")

    def __class_getitem__(cls, item):
        return cls


def _module_getattr(modname):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        return type(name, (_Unavailable,), {"__module__": modname})

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _module_getattr(spec.name)
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = _module_getattr(__name__)
