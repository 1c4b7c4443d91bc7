"""PyTorch side: config, model definition, checkpoint loaders, reference generation."""
