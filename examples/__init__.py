"""Examples of training with Megatron-Core; each folder is a package (``examples.multimodal_dev``)."""
