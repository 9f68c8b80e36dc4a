"""LoRA adapters: PEFT-format loading (:mod:`~zgen.lora.adapter`), injection into the typed graph as a
per-row gathered correction (:mod:`~zgen.lora.graph`, :mod:`~zgen.lora.bank`) and merging into the
weights (:mod:`~zgen.lora.merge`). Model description only: the runtime decides which rows use which."""

from zgen.lora.adapter import AdapterChoice, AdapterMix, LoraAdapter, adapter_fingerprint, adapter_pairs, check_adapter, load_adapter, random_adapter

__all__ = ["AdapterChoice", "AdapterMix", "LoraAdapter", "adapter_fingerprint", "adapter_pairs", "check_adapter", "load_adapter", "random_adapter"]
