"""What a replication rule may be, for the MemoryPolicy's schema (:mod:`memops.specs`) and the
scheduler's check of what the operator sends it (:mod:`memops.scheduler.rules`) alike: its bounds
and its glob. Standard library only: sent to the scheduler by value with the scheduler's code (a
stock Dask image has no memops)."""
