"""Everything is configured in pyproject.toml; this file only adds the lm-eval start-up hook to the wheels.

`hf_loopcache_lm_eval.pth` must sit at the root of site-packages, where Python runs it at start-up (see
`_hf_loopcache_lm_eval.py`: it imports nothing until lm-eval's model registry is imported, then registers
`hf-loopcache`). `build_py` copies it to the root of a regular wheel; for editable installs (`pip install -e .`)
setuptools builds the wheel through a private strategy object, which is wrapped to write the file too (skipped, with
the launcher `hf-loopcache-eval` as the door, if a setuptools release changes that private API).
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "hf_loopcache_lm_eval.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithStartupHook(build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


cmdclass = {"build_py": BuildPyWithStartupHook}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # pragma: no cover - setuptools < 64 has no PEP 660 editable wheels
    editable_wheel = None


class _StrategyWithStartupHook:
    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        with open(os.path.join(HERE, PTH), encoding="utf-8") as f:
            wheel.writestr(PTH, f.read())

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)


if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):

    class EditableWheelWithStartupHook(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _StrategyWithStartupHook(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = EditableWheelWithStartupHook


setup(cmdclass=cmdclass)
