"""One thread for every runtime of a benchmark: import this before NumPy or JAX.

OpenBLAS behind NumPy and numba, and XLA's Eigen pool, each get one thread: a per-core
comparison, and no spinning thread pools when the machine is shared (oversubscribed pools made
JAX and BLAS-heavy samplers 10-100x slower in testing). A variable already set in the
environment wins.
"""

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)
