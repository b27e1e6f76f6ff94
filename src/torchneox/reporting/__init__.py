"""Floor 3: run reporting: the metrics line and its writers (MFU), hardware peaks, the
profiler, and plots."""
