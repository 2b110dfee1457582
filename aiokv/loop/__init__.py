"""What runs on the event loop: batching, admission, deadlines, resolving callers."""
