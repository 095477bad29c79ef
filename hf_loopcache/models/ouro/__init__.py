from hf_loopcache.models.ouro.configuration_ouro import OuroConfig
from hf_loopcache.models.ouro.modeling_ouro import OuroForCausalLM, OuroModel, OuroPreTrainedModel

__all__ = ["OuroConfig", "OuroForCausalLM", "OuroModel", "OuroPreTrainedModel"]
