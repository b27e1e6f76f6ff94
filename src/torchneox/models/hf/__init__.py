"""Hugging Face models: configs of each architecture as GPT-NeoX keys and back, the
defaults transformers assumes, tensor names both ways, and a folder named by ``load``."""
