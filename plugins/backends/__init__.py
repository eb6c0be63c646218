"""Model-runner backends shipped with llmserve (each subpackage is one backend plugin)."""
