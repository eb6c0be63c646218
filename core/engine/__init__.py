"""The continuous-batching engine: sequences, block manager, scheduler, loop and async client."""
