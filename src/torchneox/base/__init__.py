"""Floor 0: error types and fault injection, imported by every floor above."""
