"""Floor 5: Hugging Face conversion both ways and GPT-NeoX checkpoint import."""
