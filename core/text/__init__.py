"""Text post-processing on the engine thread: incremental detokenization and stop strings."""
