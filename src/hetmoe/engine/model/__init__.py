"""Opening a model: what loading reads and checks, where it comes from, its chat template, and
the `deferred="auto"` choice made once at load."""
