"""The test package. Imported before conftest.py and so before numpy, which reads the setting below as it loads.

numpy's OpenBLAS starts a thread per core, and each spins while it waits for work. On a machine of two cores the
tests keep both busy already (MLX's stream threads, the I/O threads, the servers and ranks they start), and the
spinning threads take turns from all of them: a prefill of 273 tokens on the small checkpoint through
`QLinear._blas` took 12-21 s of CPU with another process busy, 1.6 s with one BLAS thread. The bits do not depend
on it (OpenBLAS shares a product's output rows among its threads, never one row's sums). Subprocesses inherit it."""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
