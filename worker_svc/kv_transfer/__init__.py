"""Worker-to-worker KV transfer (disaggregation): a paged cache's blocks as bytes
(codec.py), the transport that pulls them from another worker (transport.py: the
BlockSource protocol, worker.v1 ReadBlocks over gRPC behind it) and the two ends
of a move (mover.py). The scheduler names every block on both sides; nothing here
decides which."""
