"""Quantized weights: checkpoint formats (AWQ, GPTQ, compressed-tensors, FP8) repacked into the engine's layouts.
(nanovllm/utils/quant_spec.py reads `quantization_config` into a QuantSpec, torch-free, for Config's checks.)

- layout.py: the two layouts ("int" groups, "fp8" blocks), the shared contract, and their reference dequantization.
- formats.py: each checkpoint format's tensors, and their repacking into a layout.
- method.py: the linear method a layer delegates to: its parameters, their loaders, its matmul.
"""
