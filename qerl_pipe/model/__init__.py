"""One decoder (Llama, Qwen2/3, Mistral, Gemma2/3, Phi3) over a frozen bf16/NVFP4/NF4 base with unmerged LoRA.

Import from the submodules (nothing is re-exported, so `model.config` stays importable without
pulling in the kernels):

- `config`: `DecoderConfig.from_hf(config_json_dict)` (each family's specifics: `families`, `hf_rope`)
- `load`: `load_model`, `model_memory_bytes` (random-weight stand-ins: `bench.random_model`)
- `decoder`: `Decoder` (forward / logits / prefill), `KVCache` (the decode step is the engine's)
- `lora`: `LoraSpec`, `apply_lora`, `lora_parameters`, `lora_state_dict`, `lora_disabled`
- `linear`: `QuantLinear`; `norm`: `RMSNorm` (AQN noise); `rope`; `attention` (masks, windows, caps)
"""
