"""Number formats and checkpoint layouts: pure math and file layouts, no I/O policy.

- `nvfp4`: NVFP4 quantize/dequantize, byte-exact with NVIDIA Model Optimizer.
- `nf4`: QLoRA NormalFloat-4 (the QLoRA baseline's frozen base).
- `modelopt_layout`, `compressed_tensors`: the two NVFP4 checkpoint layouts in use.
- `checkpoint`: stream any of them (or an unquantized checkpoint) from safetensors shards.
- `names`: HF, fused-projection and PEFT tensor names (the one table of them; no torch).

docs/formats.md has the math and what was verified against modelopt's source.
"""
