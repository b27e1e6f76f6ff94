"""One feature's keys each, read once: what they switch on, their problems in one line,
and what they add to the derived values."""
