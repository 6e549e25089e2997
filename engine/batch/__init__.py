"""How many micro-batches a round takes and which worker runs which: accumulation, pacing, dealing."""
