"""torchneox."""
