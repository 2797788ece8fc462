"""Document KV caches: the segment type, the file format, encoding, the per-document store, and the
memory tiers (disk, pinned host, device pool) a cache passes through."""
