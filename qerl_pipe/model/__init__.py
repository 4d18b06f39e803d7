"""One decoder (Llama, Qwen2/3, Qwen3-MoE, Mistral, Gemma2/3, Phi3) over a frozen bf16/NVFP4/NF4
base with unmerged LoRA. Import from the submodules: nothing is re-exported, so `model.config`
stays importable without pulling in the kernels.
See docs/model.md, section "The model (`qerl_pipe/model/`)" (the table of files)."""
