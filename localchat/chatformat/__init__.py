"""Chat formats: a model's chat template as deltas, its bounded renderer and sandbox, reasoning formats, stop
strings."""
