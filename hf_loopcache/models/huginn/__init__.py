from hf_loopcache.models.huginn.configuration_huginn import HuginnConfig
from hf_loopcache.models.huginn.modeling_huginn import HuginnForCausalLM, HuginnPreTrainedModel

__all__ = ["HuginnConfig", "HuginnForCausalLM", "HuginnPreTrainedModel"]
