"""The gRPC surface: serving.v1 and admin.v1 servicers, API keys, server
assembly, and the one mapping from domain errors to gRPC status codes."""
