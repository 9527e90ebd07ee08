"""The engine's books, integers only: the scheduler, the block pool and its prefix cache, sessions, each request's
sequence, one step's plan (the seam to the backends), the prefix cache's KV events."""
