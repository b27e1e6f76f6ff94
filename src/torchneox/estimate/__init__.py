"""Floor 5: what a run will cost before it starts: parameters, activations, memory, the layout search."""
