"""Import stand-in for ``sgl_kernel`` on CPU-only machines (see ``sglang_ssd/cpu/__init__.py``).

PyPI's ``sglang-kernel`` is CUDA-only, yet SGLang 0.5.23 imports ~a dozen ``*_cpu`` names from it
at module level when ``SGLANG_USE_CPU_ENGINE=1``.  Ops we implement in pure torch come from
``sglang_ssd.cpu.ops``; every other attribute is a placeholder that raises ``NotImplementedError``
naming the op when called.  ``torch.ops.sgl_kernel`` stays empty, so SGLang's AMX detection is
False and layers use their torch-native code.
"""

import importlib.abc
import importlib.machinery
import sys
import types

from sglang_ssd.cpu import ops as _ops

IS_STANDIN = True
__version__ = "0.0.0+sglang-ssd-cpu-standin"

# Submodules SGLang imports names from; any other submodule raises ModuleNotFoundError so SGLang's
# own try/except fallbacks run.
_SUBMODULES = ("mamba", "speculative", "kvcacheio", "elementwise")


def _placeholder(qualname: str):
    def _missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{qualname} is not available on CPU (sglang-ssd stand-in); "
            "use --attention-backend torch_native"
        )

    _missing.__name__ = qualname.rsplit(".", 1)[-1]
    _missing.__qualname__ = qualname
    return _missing


def _module_getattr(prefix: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        impl = getattr(_ops, name, None)
        if impl is not None and not name.startswith("_"):
            return impl
        return _placeholder(f"{prefix}{name}" if prefix else name)

    return __getattr__


__getattr__ = _module_getattr("")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("sgl_kernel.") and fullname.split(".")[1] in _SUBMODULES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _module_getattr(spec.name[len("sgl_kernel.") :] + ".")
        return mod

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
