"""The mixers a block holds, one module per layer family (models/block.py picks one per
layer from attention_config): attention (dense), sparse (GPT-NeoX's block-sparse types),
mamba, rwkv (RWKV-6) and gmlp (gMLP and aMLP)."""
