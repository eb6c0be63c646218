"""The torch backend's CUDA path: Triton paged attention and KV store (as torch operators),
decode CUDA graphs over persistent step buffers, and the on-device sampler's fast path."""
