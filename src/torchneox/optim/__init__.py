"""Floor 4: optimizers: the builder of GPT-NeoX's ``optimizer`` dict, GPT-NeoX's other
optimizers (SM3, MADGRAD, LAMB), 8-bit Adam, Muon, muP's parameter groups, and the learning-rate
schedules."""
