"""The key declarations of each group (io, model, training, online RL), assembled by
``config/schema.py`` into the typed config."""
