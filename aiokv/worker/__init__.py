"""The store thread: its loop (thread), rounds (pure plans + execution), store calls, recovery."""
