"""The torch backend's native CPU kernels, compiled on first use with the system C compiler.

Only what plain torch does badly on a CPU lives here: decode attention read straight from the
paged KV pool, fp32 linear layers over few rows with weights packed for the kernel (as fp32 or,
where that is lossless, 4- or 8-bit panels), the fused forward's small per-layer operations, and
a whole decode step in one call. ``build`` compiles and caches ``csrc/*.c``; ``ops`` wraps the
kernels with ctypes; ``panels`` finds the lossless 4- and 8-bit panels; ``step`` drives
``csrc/decoder_step.c``. Nothing here is imported until the backend packs a model.
"""
