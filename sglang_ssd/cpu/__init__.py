"""CPU-only runtime support for SGLang 0.5.23 (activated only on CPU machines).

PyPI ships only a CUDA build of ``sgl_kernel``; SGLang's CPU path imports about a dozen of its
``*_cpu`` ops at module import time and calls a few of them.  This subpackage holds:

* ``ops``    - our pure-torch implementations of the ops the CPU path actually calls;
* ``stubs/`` - import stand-ins for ``sgl_kernel``, ``triton`` and ``torchvision`` (packages that
  must merely import on CPU).  ``scripts/setup.sh`` puts ``stubs/`` on ``sys.path`` through a
  ``.pth`` file in the CPU virtual environment only; GPU installs never see them.
"""

import os

STUBS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")
