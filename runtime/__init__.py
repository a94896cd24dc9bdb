"""The runtime: plan, engine, model, streamed experts, text, images, sessions, server."""

import os

# MLX's CUDA backend runs float32 matmuls in TF32 (10-bit mantissa) unless told otherwise: a float32 run
# asks for float32 arithmetic (the chunked delta rule's matmuls drifted 5e-2 from the reference with TF32).
# Read once, at MLX's first matmul; bf16 runs are unaffected.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
