"""The test package. Imported before conftest.py and so before numpy and any process the tests start, it sets
what they inherit.

numpy's OpenBLAS starts a thread per core, and each spins while it waits for work. On a machine of two cores the
tests keep both busy already (MLX's stream threads, the I/O threads, the servers and ranks they start), and the
spinning threads take turns from all of them: a prefill of 273 tokens on the small checkpoint through
`QLinear._blas` took 12-21 s of CPU with another process busy, 1.6 s with one BLAS thread. The bits do not depend
on it (OpenBLAS shares a product's output rows among its threads, never one row's sums).

Where PYTHONDONTWRITEBYTECODE is set (and no PYTHONPYCACHEPREFIX), every `python -m streamoe.cli` the tests start
(hundreds) compiled the project's modules from source again: 0.15 s a process. Their bytecode goes to a directory
of this run instead, removed at its end, so the tree stays as it was."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

if os.environ.get("PYTHONDONTWRITEBYTECODE") and "PYTHONPYCACHEPREFIX" not in os.environ:
    _bytecode = tempfile.mkdtemp(prefix="streamoe-tests-pyc-")
    atexit.register(shutil.rmtree, _bytecode, True)
    os.environ["PYTHONPYCACHEPREFIX"] = _bytecode
    del os.environ["PYTHONDONTWRITEBYTECODE"]
