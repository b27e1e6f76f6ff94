"""What ``config/derive.py`` computes for each concern: the model's values, precision, online RL."""
