"""Imported for its effect: resolves jaxlib's CPU kernels of linear algebra (LAPACK, through
SciPy: about 0.3 s of CPU) in the process that imports it. A local cluster's process
template imports it, so every worker forked from the template starts with them resolved
instead of resolving them on its first compile (worker/xla.py resolves them anyway, at
no cost once done). The template resolves them single-threaded (template.py sets
OPENBLAS_NUM_THREADS=1), as it loads every library it preloads: the workers of one machine
then do not oversubscribe its cores with BLAS threads.
"""

from pathways.worker.jax_private import initialize_cpu_kernels

initialize_cpu_kernels()
