"""Layer 3, the PyTorch side: the model definition (attention, MLA, MoE, routing), checkpoint loaders
(safetensors, FP8 blocks, GGUF), presets, the tokenizer and its chat-template sandbox, and how a model splits
into tensor/expert-parallel ranks."""
