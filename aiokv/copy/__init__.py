"""The embedded store's data plane: moving pages between the GPU caches and host blocks."""
