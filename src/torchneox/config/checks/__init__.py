"""The checks ``config/validate.py`` runs for each concern: the model's keys, Muon, online RL."""
