"""What runs on the event loop: batching, admission, deadlines, resolving callers, and the
check that a call comes from the engine's own loop (binding)."""
