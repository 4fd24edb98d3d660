"""Import stand-in for ``triton`` on CPU-only machines (see ``sglang_ssd/cpu/__init__.py``).

SGLang 0.5.23 defines ``@triton.jit`` kernels at import time even on CPU, but never runs one
there.  Modelled on SGLang's own Apple-Silicon stub (``sglang/_platform_stubs.py``): every
``triton.*`` module is a mock, decorators return the function unchanged, and the package is
falsy so feature checks fail cleanly.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "3.0.0"
IS_STANDIN = True


class _StubBase:
    """Anything code may subclass (``class K(triton.runtime.KernelInterface)``)."""


class _Mock(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, _FINDER, is_package=True)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():  # CamelCase: a class users may subclass or isinstance-check
            cls = type(name, (_StubBase,), {"__module__": self.__name__})
            setattr(self, name, cls)
            return cls
        return _child(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @triton.jit
        return lambda fn: fn  # @triton.jit(...), @triton.autotune(...)

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __contains__(self, item):
        return False


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("triton."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return sys.modules.get(spec.name) or _Mock(spec.name)

    def exec_module(self, module):
        parent, _, leaf = module.__name__.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], leaf, module)


_FINDER = _Finder()
sys.meta_path.insert(0, _FINDER)


def _child(name: str) -> _Mock:
    if name not in sys.modules:
        mod = _Mock(name)
        sys.modules[name] = mod
        parent, _, leaf = name.rpartition(".")
        setattr(_child(parent) if parent != "triton" else sys.modules["triton"], leaf, mod)
    return sys.modules[name]


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 1


class Config:
    def __init__(self, kwargs=None, num_warps=4, num_stages=2, **extra):
        self.kwargs, self.num_warps, self.num_stages = kwargs or {}, num_warps, num_stages


def jit(fn=None, **kwargs):
    return fn if fn is not None else (lambda f: f)


autotune = heuristics = lambda *a, **k: (lambda f: f)

language = _child("triton.language")


class _constexpr:
    def __init__(self, value=None):
        self.value = value


language.constexpr = _constexpr
runtime = _child("triton.runtime")
_jit_mod = _child("triton.runtime.jit")
_jit_mod.JITFunction = type("JITFunction", (), {})
_jit_mod.KernelInterface = type("KernelInterface", (_StubBase,), {})
_child("triton.runtime.cache").triton_key = lambda: "triton-standin"
_autotuner = _child("triton.runtime.autotuner")
_autotuner.OutOfResources = type("OutOfResources", (Exception,), {})
_autotuner.PTXASError = type("PTXASError", (Exception,), {})
_child("triton.compiler.compiler").triton_key = lambda: "triton-standin"


