"""The run's machinery around the rounds: the comm thread and stream, clocks, host reads, the watchdog, device placement, memory."""
