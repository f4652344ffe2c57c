"""Fused CPU kernels over the page arena (decode attention with score bookkeeping, token writes): a C++/OpenMP
library compiled at first use (build.py) and the attention backend that calls it (backend.py)."""
