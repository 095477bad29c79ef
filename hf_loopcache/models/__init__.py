"""Native, transformers-5 implementations of looped models, registered with the Auto classes on import.

Importing this module (which `import hf_loopcache` does) registers `model_type="ouro"` and
`model_type="huginn_raven"` with `AutoConfig` and `AutoModelForCausalLM` (`exist_ok=True`), so
`AutoModelForCausalLM.from_pretrained(path)` on an official checkpoint folder returns these classes without
`trust_remote_code`. `register()` does the same explicitly and is idempotent.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from hf_loopcache.models.huginn import HuginnConfig, HuginnForCausalLM
from hf_loopcache.models.ouro import OuroConfig, OuroForCausalLM, OuroModel

__all__ = ["HuginnConfig", "HuginnForCausalLM", "OuroConfig", "OuroForCausalLM", "OuroModel", "register"]


def register() -> None:
    """Register the native looped models with transformers' Auto classes (safe to call repeatedly)."""
    AutoConfig.register("ouro", OuroConfig, exist_ok=True)
    AutoConfig.register("huginn_raven", HuginnConfig, exist_ok=True)
    AutoModel.register(OuroConfig, OuroModel, exist_ok=True)
    AutoModelForCausalLM.register(OuroConfig, OuroForCausalLM, exist_ok=True)
    AutoModelForCausalLM.register(HuginnConfig, HuginnForCausalLM, exist_ok=True)


register()
