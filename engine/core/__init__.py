"""What a round works with and what a run records: flat buffers, the round context, dtypes, counters, the run's history."""
