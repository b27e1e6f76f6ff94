"""The mixers a block holds, one module per layer family (models/block.py picks one per
layer from attention_config): attention (dense, and GPT-NeoX's block-sparse types)."""
