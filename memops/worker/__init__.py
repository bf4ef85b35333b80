"""Code that runs inside the Dask workers: sent to the scheduler by value with the scheduler's
code (a stock Dask image has no memops), and installed in the workers from there."""
