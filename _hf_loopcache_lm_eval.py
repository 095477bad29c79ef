"""Makes the plain `lm_eval --model hf-loopcache ...` work with lm-eval 0.4.13, which reads no model entry points.

`pip install "hf-loopcache[eval]"` puts `hf_loopcache_lm_eval.pth` into site-packages; at interpreter start it calls
`install()`, which only adds a finder to `sys.meta_path` (this module imports nothing but `sys` and `os`, both loaded
by then). The finder waits for `lm_eval.models`, the module that fills lm-eval's model registry with the built-in
models, and right after it has run registers `hf-loopcache` as the lazy entry `"eval_tasks.model:LoopCacheLM"`, then
removes itself. Nothing of hf_loopcache, torch or eval_tasks is imported until lm-eval is asked for that model.

Registering after the built-ins matters: `lm_eval.api.registry.get_model` imports `lm_eval.models` only while the
registry is empty, so an entry added earlier would hide `--model hf`. The entry's target is the module and class that
carry `@register_model("hf-loopcache")`, so lm-eval upgrades the placeholder to the class without a name clash.

Set `HF_LOOPCACHE_LM_EVAL_HOOK=0` to switch the hook off (then use `hf-loopcache-eval`, the launcher).
"""

import os
import sys

MODEL_NAME = "hf-loopcache"
TARGET = "eval_tasks.model:LoopCacheLM"
WATCHED = "lm_eval.models"


def register() -> None:
    """Register `hf-loopcache` lazily in lm-eval's model registry (no-op when it is already there)."""
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=TARGET)


class _RegisteringLoader:
    """Runs the real loader of `lm_eval.models`, then `register()`; everything else is the real loader's."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        uninstall()
        register()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class LmEvalModelsFinder:
    """A `sys.meta_path` finder that answers only for `lm_eval.models`, with the spec the other finders give."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def installed() -> bool:
    return any(isinstance(f, LmEvalModelsFinder) for f in sys.meta_path)


def install() -> None:
    """Called by the .pth file at start-up. Never raises: a start-up hook must not break the interpreter."""
    try:
        if os.environ.get("HF_LOOPCACHE_LM_EVAL_HOOK", "1") == "0" or installed():
            return
        if WATCHED in sys.modules:  # lm-eval's registry is already filled: register now
            register()
            return
        sys.meta_path.insert(0, LmEvalModelsFinder())
    except Exception:  # pragma: no cover - defensive
        pass


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, LmEvalModelsFinder)]
