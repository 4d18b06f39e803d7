"""qerl-pipe: NVFP4 quantization, LoRA and GRPO/DAPO with adaptive quantization noise, as a pipeline."""

__version__ = "0.1.0"
