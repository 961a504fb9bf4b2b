"""A chat bound to its files: the session directory, the transcript on disk, KV state files, the prefix store,
model fingerprints, the background writer."""
