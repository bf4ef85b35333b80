"""Pure deciding code: what the operator does, from facts that the controllers read.

No I/O here (the import contracts forbid Kopf, HTTP and Dask clients): each module takes plain
data or the models of :mod:`memops.specs` and returns a decision, which the controllers apply.
"""
